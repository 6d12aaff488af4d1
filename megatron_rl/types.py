"""Contracts between the phases of an RL step: Sample (one rollout), RolloutBatch, TrainBatch.

Token alignment used everywhere: a sequence of tokens `t_0..t_{n-1}` becomes
`input_ids = t_0..t_{n-2}` and `labels = t_1..t_{n-1}`; every per-token tensor of a
TrainBatch (loss_mask, advantages, log-probs, weights) is aligned with `labels`, i.e. entry j
is about predicting t_{j+1} from t_0..t_j.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch


@dataclass
class Sample:
    """One prompt + completion from a rollout engine, with everything the learner needs."""

    prompt_ids: list[int]
    """Prompt token ids."""
    response_ids: list[int]
    """Generated token ids (may be empty)."""
    rollout_logprobs: list[float]
    """Engine log-probs of response_ids (raw logits), same length as response_ids."""
    finish_reason: str
    """'stop', 'length' or 'abort'."""
    group_id: int
    """Index of the prompt in the step's prompt batch (GRPO group)."""
    answer: Any = None
    """Ground-truth answer from the dataset row, for the reward function."""
    weight_version: str = ""
    """Weight version the engine reported for this sample."""
    response_text: str = ""
    """Decoded completion text."""
    reward: float = 0.0
    """Scalar reward (filled by the reward phase)."""
    correct: bool = False
    """Whether the answer was exactly right (for accuracy metrics)."""


@dataclass
class TrainBatch:
    """Padded learner batch; per-token tensors are [B, S] and aligned with `labels`."""

    input_ids: torch.Tensor
    """[B, S] int64 tokens fed to the model."""
    labels: torch.Tensor
    """[B, S] int64 next tokens whose log-probs are scored."""
    loss_mask: torch.Tensor
    """[B, S] float, 1 on response tokens (the ones trained on), 0 on prompt and padding."""
    advantages: torch.Tensor
    """[B, S] float per-token advantages (0 where loss_mask is 0)."""
    rollout_logprobs: torch.Tensor
    """[B, S] float log-probs reported by the rollout engine (0 off the mask)."""
    old_logprobs: Optional[torch.Tensor] = None
    """[B, S] learner log-probs before the update (pi_old, FP8 forward)."""
    old_logprobs_hp: Optional[torch.Tensor] = None
    """[B, S] high-precision shadow pi_old (calibration steps only)."""
    logprobs_hp: Optional[torch.Tensor] = None
    """[B, S] high-precision shadow log-probs of the current policy, taken just before the update (calibration steps only)."""
    ref_logprobs: Optional[torch.Tensor] = None
    """[B, S] reference-policy log-probs (only when a KL term is on)."""
    rollout_weight: Optional[torch.Tensor] = None
    """[B, S] precomputed rollout-correction weights (sequence-level TIS/MIS needs whole sequences, which CP splits)."""
    token_weight: Optional[torch.Tensor] = None
    """[B, S] loss weights carrying the global aggregation (sum of weight*loss over all ranks = the loss)."""
    sample_index: Optional[torch.Tensor] = None
    """[B] int64 index of each row in the step's global sample list."""
    hp_decision_rows: Optional[torch.Tensor] = None
    """[B] bool: the rows whose clips are decided on high-precision ratios under strength=targeted (None: every row)."""

    @property
    def batch_size(self) -> int:
        """Number of sequences."""
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor | slice) -> "TrainBatch":
        """Rows `index` of every tensor field (None fields stay None)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        return TrainBatch(**out)

    def with_fields(self, **changes: Any) -> "TrainBatch":
        """A copy with some fields replaced."""
        return replace(self, **changes)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-None tensor fields by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


@dataclass
class RolloutBatch:
    """All samples of one RL step (n per prompt, prompt-major) plus rollout-side stats."""

    samples: list[Sample]
    """Samples, the n completions of one prompt adjacent."""
    n_per_prompt: int
    """GRPO group size."""
    stats: dict[str, float] = field(default_factory=dict)
    """Rollout metrics (throughput, lengths, finish reasons)."""
