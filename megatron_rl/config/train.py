"""Step schedule, batch sizes, checkpointing and tracking configs."""
from __future__ import annotations

from typing import Optional

from pydantic import model_validator

from megatron_rl.config.base import StrictConfig


class TrainConfig(StrictConfig):
    """How many RL steps, and how each step's rollouts are split for the learner."""

    steps: int = 50
    """Number of RL steps (rollout -> train -> sync)."""
    prompts_per_step: int = 16
    """Prompts per RL step (each yields rollout.n_samples_per_prompt samples)."""
    num_minibatches: int = 1
    """Optimizer steps per RL step; the step's samples are split into this many mini-batches."""
    ppo_epochs: int = 1
    """Passes over the step's samples."""
    micro_batch_size: int = 16
    """Sequences per forward/backward micro-batch on each data-parallel rank."""
    eval_every: int = 0
    """Greedy held-out evaluation every N steps (0: only before and after the run)."""
    eval_max_prompts: int = 200
    """Held-out prompts used per evaluation."""
    seed: int = 1
    """Seed of model init, shuffling and sampling."""

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        for name in ("steps", "prompts_per_step", "num_minibatches", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1")
        return self


class SftConfig(StrictConfig):
    """Supervised warm start on the task (`megatron-rl sft`)."""

    steps: int = 750
    """Optimizer steps."""
    global_batch_size: int = 64
    """Sequences per optimizer step (all data-parallel ranks together)."""
    micro_batch_size: int = 64
    """Sequences per micro-batch on each data-parallel rank."""
    lr: float = 3e-3
    """Learning rate (constant)."""
    clip_grad: float = 0.0
    """Global gradient-norm clip of the warm start (0 disables; clipping at 1.0 stalls the tiny model's SFT)."""
    output_dir: Optional[str] = None
    """Where the SFT checkpoint and HF export go (default <run_dir>/sft)."""
    high_precision: bool = True
    """Train the warm start without FP8, as the BF16 base model an FP8 RL run starts from would be."""


class CheckpointConfig(StrictConfig):
    """Distributed checkpoints of the learner and the RL state."""

    save_every: int = 0
    """Save every N RL steps (0: only at the end)."""
    keep_last: int = 2
    """How many checkpoints to keep."""
    resume: bool = True
    """Resume from the newest complete checkpoint in <run_dir>/checkpoints when one exists."""


class TrackingConfig(StrictConfig):
    """Where metrics go."""

    jsonl: bool = True
    """Write one JSON object per step to <run_dir>/metrics.jsonl."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to <run_dir>/tb."""
    progress_bar: bool = True
    """Show a progress bar on the controller."""
    log_samples: int = 2
    """Completions printed to the sample log per step."""
    dump_ratios: bool = False
    """On calibration steps write <run_dir>/calibration/step_N.rankR.npz: the tokens of the calibration solve (FP8 and high-precision ratios, advantages, mini-batch)."""

    @model_validator(mode="after")
    def _check(self) -> "TrackingConfig":
        if self.log_samples < 0:
            raise ValueError("tracking.log_samples must be >= 0")
        return self
