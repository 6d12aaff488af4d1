"""Prompt data, tokenizer and reward configs."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import model_validator

from megatron_rl.config.base import NonNegativeInt, PositiveInt, Seed, StrictConfig


class DataConfig(StrictConfig):
    """Where prompts come from and how they are scored."""

    train_file: Optional[str] = None
    """JSONL or Parquet prompt file for RL (fields per prompt_key/answer_key); None generates `task` rows into the run dir."""
    eval_file: Optional[str] = None
    """JSONL or Parquet held-out prompts for greedy evaluation (same field map); None generates held-out `task` rows."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a dotted path into nested objects/lists ('prompt.0.content'); a string or a chat-message list."""
    answer_key: str = "answer"
    """Field holding the ground truth, a dotted path ('reward_model.ground_truth')."""
    layout: Optional[Literal["dapo_math_17k", "math"]] = None
    """Field-map preset of a known dataset (megatron_rl.data.sources.LAYOUTS): dapo_math_17k or math; replaces the two keys."""
    apply_chat_template: Union[Literal["auto"], bool] = "auto"
    """Render prompts with the tokenizer's chat template: auto (when it has one), true (required), false (raw text)."""
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

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.layout is not None and (self.prompt_key, self.answer_key) != ("prompt", "answer"):
            raise ValueError("data.layout sets the field map itself: leave data.prompt_key/data.answer_key unset")
        for name in ("prompt_key", "answer_key"):
            if not getattr(self, name) or any(not part for part in getattr(self, name).split(".")):
                raise ValueError(f"data.{name} must be a dotted path with non-empty parts, got {getattr(self, name)!r}")
        return self
