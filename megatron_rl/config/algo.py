"""RL algorithm configs: advantages, policy loss, Calibrated Clipping, rollout correction, DAPO, KL.

Names that select a variant (`estimator`, `name`, `agg_mode`, `upper`, ...) are validated
against the registries in megatron_rl/algo at use time as well; the Literal types here give
early, field-named errors when a YAML file is loaded.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, StrictConfig
from megatron_rl.config.experimental import ExperimentalConfig


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


class AdvantageConfig(StrictConfig):
    """How per-sample advantages are computed from the rewards of each prompt's group."""

    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """grpo: (r - group mean) / (group std + eps); drgrpo: r - group mean (no std); rloo: leave-one-out baseline."""
    std_eps: NonNegativeFloat = 1e-6
    """Added to the group std before dividing (grpo); >= 0."""
    unbiased_std: bool = True
    """Use the unbiased (n-1) group std, as torch.std and verl do; False uses the population std."""


class PolicyLossConfig(StrictConfig):
    """The per-token policy-gradient loss and how it is aggregated over tokens."""

    name: Literal["ppo", "dual_clip", "cispo"] = "ppo"
    """ppo: clipped surrogate with ratio bounds [L, H]; dual_clip: ppo plus the c-bound for A<0; cispo: clipped-IS-weight REINFORCE."""
    eps_low: float = Field(0.2, ge=0, lt=1, allow_inf_nan=False)
    """Lower clip range in [0, 1): the uncalibrated lower ratio bound is 1 - eps_low."""
    eps_high: NonNegativeFloat = 0.2
    """Upper clip range (>= 0): the uncalibrated upper ratio bound is 1 + eps_high (DAPO clip-higher: 0.28)."""
    dual_clip_c: float = Field(3.0, gt=1, allow_inf_nan=False)
    """Dual-clip constant c (> 1): for A < 0 the loss is capped at -c * A."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation over tokens of the global batch (seq-mean-token-sum-norm is Dr.GRPO's constant normaliser)."""
    max_response_length: Optional[PositiveInt] = None
    """Constant normaliser of seq-mean-token-sum-norm (Dr.GRPO), >= 1; None uses rollout.sampling.max_new_tokens."""
    log_ratio_clamp: PositiveFloat = 20.0
    """log(pi/pi_old) is clamped to +-this (> 0) before exp, so a wild token cannot overflow."""
    entropy_coef: NonNegativeFloat = 0.0
    """Entropy bonus coefficient (>= 0; the loss subtracts coef * entropy)."""
    clip_decision: Literal["learner", "high_precision"] = "learner"
    """Ratio that decides which tokens the clip zeroes: learner (its own forward's) or high_precision (high-precision forwards of pi_old and of every update's policy, paid every step). The learner's forward still gives loss and gradient."""


_REMOVED_RULE = "delete it and set algo.calibration.strength to targeted (the default), decision or full"
REMOVED_CALIBRATION_FIELDS: dict[str, tuple[object, str]] = {
    # field: (the value whose behaviour the code keeps, or None where only a removed rule read it; what to do instead)
    "gate_opens_to": (None, _REMOVED_RULE),
    "excess_tolerance": (None, _REMOVED_RULE),
    "gate_min_tokens": (None, _REMOVED_RULE),
    "lower_target": ("event_alpha", "delete it (L takes the last calibration event's alpha)"),
    "agreement_beta": (None, "delete it (L takes the last calibration event's alpha)"),
    "agreement_points": (None, "delete it (L takes the last calibration event's alpha)"),
    "deflate_prior_tokens": (None, "delete it (L takes the last calibration event's alpha)"),
    "target_events": (1, "delete it (each calibration event's targets stand alone)"),
    "target_source": ("shadow", "delete it (the targets come from the high-precision shadow)"),
    "static_alpha": (None, "delete it (the targets come from the high-precision shadow)"),
    "static_rho": (None, "delete it (the targets come from the high-precision shadow)"),
    "lower_floor": ("lowest_ratio", "delete it (L is at least the lowest FP8 negative ratio solved on)"),
    "on_policy_bounds": ("open", "delete it (the on-policy update trains at [lower_min, upper_max] under strength=full)"),
    "hist_log_min": (-4.0, "delete it (fixed at -4, megatron_rl.algo.calibration.HIST_LOG_MIN)"),
    "hist_log_max": (4.0, "delete it (fixed at 4, megatron_rl.algo.calibration.HIST_LOG_MAX)"),
    "lower_max": (1.0, "delete it (fixed at 1, megatron_rl.algo.calibration.LOWER_MAX)"),
    "upper_min": (1.0, "delete it (fixed at 1, megatron_rl.algo.calibration.UPPER_MIN)"),
    "max_samples_per_rank": (65536, "delete it (fixed at 65536, megatron_rl.algo.calibration.MAX_SAMPLES_PER_RANK)"),
    "seed": (0, "delete it (fixed at 0, megatron_rl.algo.calibration.SEED)"),
    "hist_bins": (8192, "delete it (fixed at 8192, megatron_rl.algo.calibration.HIST_BINS)"),
}
"""Removed algo.calibration fields: a config that sets one is refused with its line here."""
REMOVED_STRENGTHS = ("gated", "excess")
"""Removed algo.calibration.strength values (refused, naming the ones that remain)."""


class CalibrationConfig(StrictConfig):
    """Calibrated Clipping (docs/calibration.md): FP8 ratio bounds or clip decisions matched to high precision."""

    enabled: bool = False
    """Turn Calibrated Clipping on; off, the bounds are 1 - eps_low and 1 + eps_high."""
    strength: Literal["full", "decision", "targeted"] = "targeted"
    """targeted: vanilla bounds, clips of the targeted_fraction of answers where engine and FP8 learner log-probs disagree most decided on the high-precision ratio; decision: every clip so (high-precision forwards of every row, every step); full: the paper's solved bounds."""
    upper: Literal["match_contribution", "log_scale", "fixed"] = "match_contribution"
    """Upper-bound rule under strength=full: match_contribution (the paper), log_scale, or fixed (1 + eps_high)."""
    calibrate_every: PositiveInt = 5
    """A calibration event (high-precision shadow forwards refresh the targets alpha and rho) every this many steps, >= 1 (paper: 20)."""
    smoothing: float = Field(0.5, ge=0, lt=1, allow_inf_nan=False)
    """EMA weight in [0, 1) of the held bound at each calibration event: new = smoothing * old + (1 - smoothing) * solved."""
    bounds_update: Literal["per_step", "per_calibration", "per_minibatch"] = "per_step"
    """per_step: a pooled solve at the end of every step at the held targets; per_calibration (the paper): one per event; per_minibatch: also before every off-policy mini-batch, from an FP8 pre-pass."""
    relax_only: bool = True
    """Guard rail: calibration only relaxes the bounds (L <= 1 - eps_low, H >= 1 + eps_high); false allows tightening."""
    shadow_fraction: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    """Fraction in (0, 1] of the off-policy rows that run the shadow forwards and give the targets (same seeded draw on every rank)."""
    backend: Literal["allgather", "histogram"] = "allgather"
    """Distributed statistics: allgather (exact unless subsampled) or histogram (one all-reduce of 8192 bin counts)."""
    targeted_fraction: float = Field(0.1, gt=0, le=1, allow_inf_nan=False)
    """strength=targeted: fraction in (0, 1] of each step's off-policy answers decided in high precision, those whose |engine - FP8 learner pi_old log-prob| summed over the answer is largest."""
    lower_min: float = Field(0.05, gt=0, le=1, allow_inf_nan=False)
    """Clamp in (0, 1]: smallest allowed calibrated lower bound L."""
    upper_max: float = Field(10.0, ge=1, allow_inf_nan=False)
    """Clamp (>= 1): largest allowed calibrated upper bound H."""

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: object) -> object:
        if isinstance(data, dict):
            gone = [k for k in data if k in REMOVED_CALIBRATION_FIELDS]
            if gone:
                raise ValueError("; ".join(f"algo.calibration.{k} was removed: {REMOVED_CALIBRATION_FIELDS[k][1]}"
                                           for k in gone))
        return data

    @field_validator("strength", mode="before")
    @classmethod
    def _removed_strengths(cls, value: object) -> object:
        if value in REMOVED_STRENGTHS:
            raise ValueError(f"algo.calibration.strength={value} was removed: set algo.calibration.strength to "
                             "targeted (the default), decision or full")
        return value

    @field_validator("bounds_update", mode="before")
    @classmethod
    def _removed_modes(cls, value: object) -> object:
        if value == "per_microbatch":
            raise ValueError("algo.calibration.bounds_update=per_microbatch was removed (it solved on one micro-batch's "
                             "tokens); use per_minibatch (a pooled solve before every off-policy mini-batch) or "
                             "per_calibration (the paper's default)")
        return value


class RolloutCorrectionConfig(StrictConfig):
    """Train-vs-rollout mismatch correction: importance weights pi_old / pi_rollout on the loss."""

    mode: Literal["none", "tis", "mis"] = "tis"
    """none; tis: truncated IS weight min(w, C); mis: masked IS (w kept inside [mis_low, mis_high], 0 outside; ICEPOP at token level)."""
    level: Literal["token", "sequence"] = "token"
    """token: a weight per token; sequence: one weight per sequence from the summed log-ratio."""
    tis_cap: PositiveFloat = 2.0
    """Truncation C of TIS (> 0; paper and peers: 2)."""
    mis_low: NonNegativeFloat = 0.5
    """MIS/ICEPOP: weights below this (>= 0) are masked to 0."""
    mis_high: PositiveFloat = 2.0
    """MIS/ICEPOP: weights above this (> mis_low) are masked to 0."""

    @model_validator(mode="after")
    def _validate(self) -> "RolloutCorrectionConfig":
        p = "algo.rollout_correction."
        _check(self.mis_low < self.mis_high, f"{p}mis_low must be < {p}mis_high")
        return self


class DapoConfig(StrictConfig):
    """DAPO extras: dynamic sampling and overlong reward shaping."""

    dynamic_sampling: bool = False
    """Drop prompt groups whose rewards all agree (zero spread) and generate more prompts until train.prompts_per_step groups with spread are collected (DAPO)."""
    max_gen_batches: NonNegativeInt = 10
    """Dynamic sampling: at most this many generation rounds (of train.prompts_per_step prompts) per step; the run stops with an error naming this field when they do not fill the batch (0 = no limit, as verl's max_num_gen_batches)."""
    overlong_buffer: NonNegativeInt = 0
    """Length of the soft overlong buffer (>= 0; 0 = shaping off)."""
    overlong_penalty_factor: NonNegativeFloat = 1.0
    """Penalty at the hard limit (>= 0): penalty = min(-(len - (Lmax - buffer)) / buffer * factor, 0)."""
    max_response_length: Optional[PositiveInt] = None
    """Lmax of the shaping (>= 1; default: the rollout's max_new_tokens, filled in by the loop)."""

    @model_validator(mode="after")
    def _validate(self) -> "DapoConfig":
        p = "algo.dapo."
        if self.max_response_length is not None:
            _check(self.max_response_length > self.overlong_buffer, f"{p}max_response_length must exceed {p}overlong_buffer")
        return self


class KLConfig(StrictConfig):
    """KL penalty to a frozen reference policy, added to the per-token loss."""

    coef: NonNegativeFloat = 0.0
    """KL coefficient (>= 0; 0 = off, no reference forward is needed then)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator: k1 = log-ratio, k2 = half squared log-ratio, k3 = Schulman's low-variance estimator."""


class AlgoConfig(StrictConfig):
    """Everything the RL objective needs, composed."""

    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    """Policy loss, clip ranges and aggregation."""
    calibration: CalibrationConfig = CalibrationConfig()
    """Calibrated Clipping."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Train-vs-rollout importance correction."""
    dapo: DapoConfig = DapoConfig()
    """DAPO dynamic sampling and overlong shaping."""
    kl: KLConfig = KLConfig()
    """KL-to-reference penalty."""
    experimental: ExperimentalConfig = ExperimentalConfig()
    """Study instruments, off by default and refused in shipped configs (config/experimental.py)."""
    ratio_hist_bins: int = Field(512, ge=2)
    """Bins (>= 2) of the log-ratio histograms carried in the loss metrics (for ratio quantiles)."""
    ratio_hist_log_range: PositiveFloat = 2.0
    """Those histograms cover log r in [-range, range] (> 0; plus under/overflow)."""

    def every_step_decision_scale(self, recipe: str) -> float:
        """k of the PPO clip decision on every step: 0 (the high-precision ratio) under
        policy_loss.clip_decision=high_precision or calibration strength=decision, the instrument's k otherwise, 1 (the
        learner's own ratio) under precision.recipe=none. The planner and the study reports read it."""
        if recipe == "none":
            return 1.0
        if self.policy_loss.clip_decision == "high_precision" or (self.calibration.enabled
                                                                  and self.calibration.strength == "decision"):
            return 0.0
        return self.experimental.clip_error_scale

    def every_step_hp_share(self, recipe: str) -> float:
        """Share of each step's off-policy answers that run high-precision forwards for the clip decision on every step:
        1 under a decision on every answer (every_step_decision_scale != 1), calibration.targeted_fraction under
        strength=targeted, 0 otherwise (calibration events' shadows are counted apart). The planner reads it."""
        if recipe == "none":
            return 0.0
        if self.every_step_decision_scale(recipe) != 1.0:
            return 1.0
        if self.calibration.enabled and self.calibration.strength == "targeted":
            return self.calibration.targeted_fraction
        return 0.0
