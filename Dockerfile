# megatron_rl GPU image: NVIDIA's PyTorch container (CUDA, torch, Transformer Engine, apex), megatron-core and
# this package in the image's Python; SGLang in its own virtual environment, because it pins its own torch.
#
#   docker build -t megatron_rl:latest .
#   docker run --gpus all --ipc=host --rm -it megatron_rl:latest \
#       megatron-rl plan examples/configs/qwen3_8b_fp8_grpo.yaml --nodes 2
#
# Not built by this repository's CI (no container engine or image registry there): tests/test_dockerfile.py
# lints it with hadolint and checks the pins below against constraints/cpu.txt.
#
# Versions live in one place each: the build arguments below (base image, SGLang, apex, and the Python pins the
# test compares with constraints/cpu.txt and, for SGLang, constraints/conformance.txt: the version the conformance
# tier checks the project against), and constraints/cpu.txt for every other Python package.
# BASE_IMAGE is the NGC release megatron-core 0.16.1's own development image is built on
# (docker/.ngc_version.dev at tag core_v0.16.1): torch 2.10 pre-release, CUDA 13, Transformer Engine 2.x, Python 3.12.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_CORE_VERSION=0.16.1
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG SGLANG_VERSION=0.5.23
ARG APEX_REF=25.09
ARG SGLANG_VENV=/opt/sglang

# The NGC image pins its own packages through PIP_CONSTRAINT; this project installs against its own constraints.
ENV PIP_CONSTRAINT="" \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megatron_rl

# Transformer Engine and apex ship with the base image; fail here rather than at the first FP8 step if not, and
# build apex from its release tag for a base image that lacks it.
RUN python -c "import torch, transformer_engine.pytorch as te; print('torch', torch.__version__, 'TE', te.__version__)" \
 && (python -c "import apex" 2>/dev/null \
     || APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install --no-cache-dir --no-build-isolation \
        "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_REF}")

# Project files, then the install: constraints/cpu.txt without its torch pin (the image's CUDA build of torch stays).
COPY setup.py pyproject.toml README.md ./
COPY constraints/ constraints/
COPY megatron_rl/ megatron_rl/
COPY examples/ examples/
COPY tools/ tools/
COPY scripts/ scripts/
RUN grep -v '^torch==' constraints/cpu.txt > /tmp/constraints.txt \
 && pip install --no-cache-dir -c /tmp/constraints.txt \
        "megatron-core==${MEGATRON_CORE_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" -e ".[router,wandb]" \
 && python -c "import megatron.core, megatron_rl, sglang_router; print('megatron-core', megatron.core.__version__)"

# SGLang with its own torch: configs point rollout.sglang_python at this interpreter
# (examples/configs/qwen3_*.yaml set /opt/sglang/bin/python).
RUN python -m venv "${SGLANG_VENV}" \
 && "${SGLANG_VENV}/bin/pip" install --no-cache-dir "sglang==${SGLANG_VERSION}" \
 && "${SGLANG_VENV}/bin/python" -c "import sglang; print('sglang', sglang.__version__)"

CMD ["bash"]
