"""megatron_rl: full-pipeline FP8 RL for LLMs (megatron-core learners, SGLang rollouts, Calibrated Clipping)."""

from megatron_rl import jit_fuser_hook as _jit_fuser_hook

__version__ = "0.1.0"

_jit_fuser_hook.install()  # before any megatron import: megatron's torch.compile decorators are dead weight on CPU
