"""megatron_rl: full-pipeline FP8 RL for LLMs (megatron-core learners, SGLang rollouts, Calibrated Clipping)."""

__version__ = "0.1.0"
