# megatron_rl GPU image: one Python, one torch, one NCCL for the learner and the SGLang engines. It starts from
# SGLang's own release image (SGLang with the torch and NCCL it pins, CUDA 13, Python 3.12) and installs Transformer
# Engine, megatron-core and this package into that same interpreter, as slime and miles build theirs: the
# `distributed` weight transport puts learner ranks and engine ranks into one NCCL group, and NCCL refuses peers of
# different versions (a second torch in a virtual environment would bring a second NCCL).
#
#   docker build -t megatron_rl:latest .
#   docker run --gpus all --ipc=host --rm -it megatron_rl:latest \
#       megatron-rl plan examples/configs/qwen3_8b_fp8_grpo.yaml --nodes 2
#   docker run --gpus all --ipc=host --rm megatron_rl:latest bash tests/gpu/run_image.sh     # the image's GPU checks
#
# Not built by this repository's CI (no container engine or image registry there): tests/test_dockerfile.py lints it
# with hadolint and checks its rules (one interpreter, the proof step, pins agreeing with constraints/).
#
# Versions live in one place each: the build arguments below; SGLANG_VERSION is constraints/conformance.txt's sglang
# (the version the conformance tier checks the project against), MEGATRON_CORE_VERSION and SGLANG_ROUTER_VERSION are
# constraints/cpu.txt's, TRANSFORMER_ENGINE_VERSION is conformance.txt's transformer-engine. Every other package
# keeps the version the SGLang image has, else takes constraints/cpu.txt's (tools/check_one_environment.py
# constraints), so installing the learner never moves a package SGLang was built with.
#
# BASE_IMAGE: SGLang publishes lmsysorg/sglang:v<version> and, for its CUDA 13 build, v<version>-cu130 (the release
# tag_config of sgl-project/sglang .github/workflows/_docker-build-and-publish.yml callers, as
# test/registered/unit/tools/test_docker_build_metadata_args.py spells it: "v{version}-cu130"), built from
# docker/Dockerfile's framework_final stage on nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04 (nvcc and cuDNN headers
# present: Transformer Engine's torch extension compiles there). sglang 0.5.23 requires torch==2.14.1, which requires
# nvidia-nccl-cu13==2.30.7 (their wheels' METADATA); the image's python3 is the interpreter holding them.
ARG SGLANG_VERSION=0.5.23
ARG BASE_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}-cu130
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION
ARG MEGATRON_CORE_VERSION=0.16.1
ARG SGLANG_ROUTER_VERSION=0.3.2
# Transformer Engine 2.20.2 beside megatron-core 0.16.1, although megatron-core's own `dev` extra asks for
# transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0 (its METADATA): that range is the TE its release was tested
# with (its newest TE gate is is_te_min_version("2.10.0")), not a known break. The evidence for crossing it:
# (1) TE's torch extension is compiled here against the image's torch, and sglang 0.5.23 pins torch==2.14.1; TE 2.11.0,
# the newest in megatron's range, was built in January 2026 (its wheel's file dates), before torch 2.14, while TE
# 2.20.2 is of sglang 0.5.23's own month (PyPI) and declares the same torch>=2.1; (2) every name megatron-core 0.16.1
# imports from TE resolves alike in TE 2.11.0 and 2.20.2 (the two its try/except leaves unused, attention's
# _SplitAlongDim and module.base.get_workspace, are absent from both), and so does everything precision/te.py uses
# (tests/conformance/test_conformance_te_megatron.py reads the pinned TE's source); (3) tests/gpu checks the pairing
# on hardware (TE training, FP8 recipes). Moving to TE < 2.12 would mean a TE older than the torch it compiles against.
ARG TRANSFORMER_ENGINE_VERSION=2.20.2
ARG APEX_REF=25.09
ARG PYTHON=python3
# The GPUs the image targets (Hopper sm90, Blackwell sm100), for Transformer Engine's build and for apex's
# (torch.utils.cpp_extension reads TORCH_CUDA_ARCH_LIST; without it apex compiles for whatever GPU the build host has,
# none on a CPU builder), and parallel jobs.
ARG NVTE_CUDA_ARCHS=90;100
ARG TORCH_CUDA_ARCH_LIST=9.0;10.0
ARG MAX_JOBS=8

# The base image may pin its packages through PIP_CONSTRAINT; every install below passes the merged constraints.
ENV PIP_CONSTRAINT="" \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megatron_rl

# The base image's torch and NCCL, recorded before anything is added (the last step checks they are still the ones
# imported), and the constraints every install runs under.
# A package installed later that needs another version of a frozen one stops the constraints step with its name (the
# --need lines: megatron-core 0.16.1's METADATA requirements; --need-setup: this package's install_requires).
COPY tools/check_one_environment.py tools/check_one_environment.py
COPY constraints/ constraints/
COPY setup.py setup.py
RUN "${PYTHON}" -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '${SGLANG_VERSION}' else f'base image has sglang {v}, not ${SGLANG_VERSION}')" \
 && "${PYTHON}" tools/check_one_environment.py probe --import sglang > base_environment.json \
 && "${PYTHON}" tools/check_one_environment.py constraints constraints/cpu.txt \
        --ours megatron-core --ours sglang-router --ours pybind11 \
        --need "megatron-core ${MEGATRON_CORE_VERSION}: torch>=2.6.0" --need "megatron-core ${MEGATRON_CORE_VERSION}: packaging>=24.2" \
        --need-setup setup.py > constraints/image.txt

# Transformer Engine into the same interpreter: its core library for CUDA 13, and its torch extension compiled against
# this torch (--no-build-isolation) with the headers of the NCCL torch loads. (Steps stay separate layers: the long TE
# and apex builds are cached apart from the project's own install, and the proof step fails on its own line.)
# hadolint ignore=DL3059
RUN "${PYTHON}" -m pip install --no-cache-dir -c constraints/image.txt "pybind11[global]==3.1.0" \
 && NCCL_HOME="$("${PYTHON}" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')" \
 && CPATH="${NCCL_HOME}/include${CPATH:+:${CPATH}}" LIBRARY_PATH="${NCCL_HOME}/lib${LIBRARY_PATH:+:${LIBRARY_PATH}}" \
    NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    "${PYTHON}" -m pip install --no-cache-dir --no-build-isolation -c constraints/image.txt \
        "transformer_engine[pytorch,core_cu13]==${TRANSFORMER_ENGINE_VERSION}" \
 && "${PYTHON}" -c "import transformer_engine.pytorch as te; print('TE', te.__version__)"

# apex (megatron's gradient-accumulation fusion kernels), built against this torch from its release tag when the base
# image lacks it. Its setup aborts when nvcc's CUDA differs from torch.version.cuda: the base image's nvcc (CUDA 13.0)
# is the one its cu130 torch was built for.
# hadolint ignore=DL3059
RUN "${PYTHON}" -c "import apex" 2>/dev/null \
 || TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 MAX_JOBS="${MAX_JOBS}" \
    "${PYTHON}" -m pip install --no-cache-dir --no-build-isolation \
        -c constraints/image.txt "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_REF}"

# Project files, then megatron-core, sglang-router and this package under the same constraints.
COPY setup.py pyproject.toml README.md ./
COPY megatron_rl/ megatron_rl/
COPY examples/ examples/
COPY tools/ tools/
COPY scripts/ scripts/
COPY tests/ tests/
RUN "${PYTHON}" -m pip install --no-cache-dir -c constraints/image.txt \
        "megatron-core==${MEGATRON_CORE_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" -e ".[router,wandb]"

# The proof: SGLang (rollout.sglang_python, by default the learner's own interpreter) and the learner import one torch
# and one NCCL, the one torch pins and the base image had; TE and megatron-core import at their pins.
# hadolint ignore=DL3059
RUN "${PYTHON}" tools/check_one_environment.py check --sglang-python "$(command -v "${PYTHON}")" \
        --sglang-version "${SGLANG_VERSION}" --te-version "${TRANSFORMER_ENGINE_VERSION}" \
        --megatron-core-version "${MEGATRON_CORE_VERSION}" --baseline base_environment.json

CMD ["bash"]
