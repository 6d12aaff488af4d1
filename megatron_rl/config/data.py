"""Prompt data, tokenizer and reward configs."""
from __future__ import annotations

from typing import Optional

from pydantic import model_validator

from megatron_rl.config.base import StrictConfig


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
    task_options: dict[str, int] = {"min_digits": 1, "max_digits": 2}
    """Options of the synthetic task generator."""
    num_train_prompts: int = 8000
    """Generated training prompts (synthetic task only)."""
    num_eval_prompts: int = 200
    """Generated held-out prompts (synthetic task only; disjoint from training)."""
    reward: str = "exact_match"
    """Reward function name (megatron_rl.reward registry)."""
    seed: int = 1234
    """Seed of data generation and prompt shuffling."""

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.num_train_prompts < 1 or self.num_eval_prompts < 0:
            raise ValueError("data.num_train_prompts must be >= 1 and data.num_eval_prompts >= 0")
        return self
