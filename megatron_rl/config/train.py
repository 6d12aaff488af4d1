"""Step schedule, batch sizes, checkpointing and tracking configs."""
from __future__ import annotations

import importlib.util
from typing import Literal, Optional

from pydantic import Field, model_validator

from megatron_rl.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Seed, StrictConfig


class HealthConfig(StrictConfig):
    """Training-health guard (see megatron_rl/phases/health.py).

    An optimizer update whose loss or gradient norm is non-finite on any rank is skipped on every
    rank. A step with a skipped update, or whose updated policy gives non-finite log-probs, is
    unhealthy: its weights are neither synced to the engines nor checkpointed. The run stops with
    a one-line error (exit code 3) after `max_consecutive_skips` unhealthy steps in a row, or when a
    divergence or collapse signal below trips. Each signal condemns the weights its evidence came
    from (rewards: the weights that generated the samples); checkpoints holding them are set aside,
    so the newest checkpoint left holds weights whose own rollouts passed every check.
    """

    max_consecutive_skips: PositiveInt = 3
    """Stop the run after this many consecutive unhealthy steps (>= 1)."""
    check_updated_policy: bool = True
    """After a step's updates, one no-grad forward of the new policy on one micro-batch per DP rank: non-finite log-probs make the step unhealthy, and its entropy is judged before the weights reach the engines."""
    max_entropy_frac: Optional[float] = Field(0.9, gt=0, le=1, allow_inf_nan=False)
    """Stop when the policy's mean token entropy exceeds this fraction (in (0, 1]) of ln(vocab size), the entropy of a uniform policy (a collapsed policy sits at 1.0; healthy runs stay far below); None disables."""
    collapse_step_entropy_frac: Optional[float] = Field(0.02, gt=0, lt=1, allow_inf_nan=False)
    """Stop when one step's updates cut the policy's mean token entropy on the probe's tokens below this fraction (in (0, 1)) of its value before them: a collapse toward a deterministic policy, caught before the weights leave (needs check_updated_policy; None disables)."""
    collapse_reward: Optional[float] = Field(0.0, ge=-1, le=1, allow_inf_nan=False)
    """Stop when the step's mean train reward (in [-1, 1]; the rewards score 0 or 1) is at or below this after an earlier step scored above it while the policy's entropy on the step's samples is below collapse_entropy_frac of the run's highest: the policy collapsed onto wrong answers (None disables)."""
    collapse_entropy_frac: float = Field(0.25, gt=0, lt=1, allow_inf_nan=False)
    """With collapse_reward: the fraction (in (0, 1)) of the highest pre-update entropy of the run below which the policy counts as collapsed."""
    entropy_jump: Optional[float] = Field(None, gt=1, allow_inf_nan=False)
    """Stop when the step's entropy exceeds this multiple (> 1) of the mean entropy of the previous `window` healthy steps; None disables."""
    max_kl_ref: Optional[PositiveFloat] = None
    """Stop when the mean per-token KL to the reference policy (metric kl_ref, > 0) exceeds this; needs algo.kl.coef > 0; None disables."""
    reward_drop: Optional[PositiveFloat] = None
    """Stop when the mean train reward of the last `window` steps falls more than this (> 0) below the best `window`-step mean so far; None disables."""
    window: PositiveInt = 5
    """Steps (>= 1) averaged by entropy_jump and reward_drop."""


class TrainConfig(StrictConfig):
    """How many RL steps, and how each step's rollouts are split for the learner."""

    steps: PositiveInt = 50
    """Number of RL steps (>= 1; rollout -> train -> sync)."""
    prompts_per_step: PositiveInt = 16
    """Prompts per RL step (>= 1; each yields rollout.n_samples_per_prompt samples)."""
    num_minibatches: PositiveInt = 1
    """Optimizer steps per RL step (>= 1); the step's samples are split into this many mini-batches."""
    ppo_epochs: PositiveInt = 1
    """Passes over the step's samples (>= 1)."""
    micro_batch_size: PositiveInt = 16
    """Sequences per forward/backward micro-batch on each data-parallel rank (>= 1)."""
    old_logprob_batches: Literal["update", "rollout"] = "update"
    """Micro-batches of the pi_old forward: update = those the step's first epoch trains on (same rows, order and DP shard), so pi_old equals the first update's pi_theta bit for bit under per-tensor scales. rollout = rollout order, where per-tensor scales change with the batch and add ratio noise."""
    eval_every: NonNegativeInt = 0
    """Greedy held-out evaluation every N steps (>= 0; 0: only before and after the run)."""
    eval_max_prompts: NonNegativeInt = 200
    """Held-out prompts used per evaluation (>= 0)."""
    seed: Seed = 1
    """Seed of model init, shuffling and sampling."""
    health: HealthConfig = HealthConfig()
    """Training-health guard: skipped non-finite updates, stop rules."""

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (steps x num_minibatches x ppo_epochs): the length of optim's decay."""
        return self.steps * self.num_minibatches * self.ppo_epochs


class SftConfig(StrictConfig):
    """Supervised warm start on the task (`megatron-rl sft`)."""

    steps: PositiveInt = 750
    """Optimizer steps (>= 1); with stop_accuracy the most it may take."""
    global_batch_size: PositiveInt = 64
    """Sequences per optimizer step (>= 1; all data-parallel ranks together; a multiple of DP size * micro_batch_size)."""
    micro_batch_size: PositiveInt = 64
    """Sequences per micro-batch on each data-parallel rank (>= 1)."""
    lr: PositiveFloat = 3e-3
    """Learning rate (constant, > 0)."""
    clip_grad: NonNegativeFloat = 0.0
    """Global gradient-norm clip of the warm start (>= 0; 0 disables; clipping at 1.0 stalls the tiny model's SFT)."""
    output_dir: Optional[str] = None
    """Where the SFT checkpoint and HF export go (default <run_dir>/sft)."""
    high_precision: bool = True
    """Train the warm start without FP8, as the BF16 base model an FP8 RL run starts from would be."""
    eval_every: NonNegativeInt = 0
    """Greedy accuracy on `eval_prompts` prompts the warm start never trains on, every N steps (>= 0; 0: never), logged to <output_dir>/metrics.jsonl."""
    eval_prompts: PositiveInt = 200
    """Prompts the checks score (>= 1; with eval_every > 0 the first ones of the train set, left out of the SFT batches; RL still uses them)."""
    stop_accuracy: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    """End the warm start once the median of the last stop_window checks reaches this (in (0, 1]; needs eval_every > 0); None: all steps."""
    stop_window: PositiveInt = 3
    """Checks (>= 1, odd) whose median stop_accuracy is compared with: 3 = two of the last three, so one lucky check does not stop it."""
    settle_steps: NonNegativeInt = 0
    """Steps the warm start keeps training once stop_accuracy is reached (>= 0; within steps), so it ends settled on the plateau, not at its edge."""
    teacher_carry_drop: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False)
    """Share of carrying sums whose demonstration drops the units carry (in [0, 1); 'a+b=' rows only: generated `addition` or a data file's): an imperfect teacher RL can correct."""

    @model_validator(mode="after")
    def _check(self) -> "SftConfig":
        if self.stop_accuracy is not None and self.eval_every == 0:
            raise ValueError("sft.stop_accuracy needs sft.eval_every > 0 (the checks that measure the accuracy)")
        if self.stop_window % 2 == 0:
            raise ValueError(f"sft.stop_window must be odd (a median of checks), got {self.stop_window}")
        return self


class CheckpointConfig(StrictConfig):
    """Distributed checkpoints of the learner and the RL state."""

    save_every: NonNegativeInt = 0
    """Save every N RL steps (>= 0; 0: only at the end)."""
    keep_last: PositiveInt = 2
    """How many checkpoints to keep (>= 1)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in <run_dir>/checkpoints when one exists."""


class TrackingConfig(StrictConfig):
    """Where metrics go."""

    jsonl: bool = True
    """Write one JSON object per step to <run_dir>/metrics.jsonl."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to <run_dir>/tb."""
    progress_bar: bool = True
    """Show progress on the controller: a bar on a terminal, plain periodic lines in logs."""
    plots: bool = True
    """Draw <run_dir>/plots/*.png (reward, entropy, clip fractions, L/H) at the end of the run."""
    log_samples: NonNegativeInt = 2
    """Completions printed to the sample log per step (>= 0)."""
    wandb: bool = False
    """Also log step metrics to Weights & Biases (optional extra: pip install megatron_rl[wandb]); files under <run_dir>/wandb."""
    wandb_project: str = "megatron_rl"
    """W&B project."""
    wandb_name: Optional[str] = None
    """W&B run name (default: the run directory's name)."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """offline writes the run under <run_dir>/wandb without a network (upload later with `wandb sync`); online streams it."""
    dump_ratios: bool = False
    """On calibration steps write <run_dir>/calibration/step_N.rankR.npz: the tokens of the calibration solve (FP8 and high-precision ratios, advantages, mini-batch)."""

    @model_validator(mode="after")
    def _check(self) -> "TrackingConfig":
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("tracking.wandb=true needs the wandb package: pip install 'megatron_rl[wandb]' (or wandb)")
        return self
