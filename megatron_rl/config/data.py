"""Prompt data, tokenizer and reward configs."""
from __future__ import annotations

from typing import Optional

from megatron_rl.config.base import NonNegativeInt, PositiveInt, Seed, StrictConfig


class DataConfig(StrictConfig):
    """Where prompts come from and how they are scored."""

    train_file: Optional[str] = None
    """JSONL prompt file for RL (rows {prompt, answer, ...}); None generates `task` rows into the run dir."""
    eval_file: Optional[str] = None
    """JSONL held-out prompts for greedy evaluation; None generates held-out `task` rows."""
    tokenizer_dir: Optional[str] = None
    """HF tokenizer directory; None builds the character tokenizer into the run dir."""
    task: str = "addition"
    """Synthetic task used when files are not given (megatron_rl.data.tasks registry)."""
    task_options: dict[str, NonNegativeInt] = {"min_digits": 1, "max_digits": 2}
    """Options of the synthetic task generator (ints >= 0)."""
    num_train_prompts: PositiveInt = 8000
    """Generated training prompts (>= 1; synthetic task only)."""
    num_eval_prompts: NonNegativeInt = 200
    """Generated held-out prompts (>= 0; synthetic task only; disjoint from training)."""
    reward: str = "exact_match"
    """Reward function name (megatron_rl.reward registry)."""
    seed: Seed = 1234
    """Seed of data generation and prompt shuffling."""
