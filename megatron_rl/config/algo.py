"""RL algorithm configs: advantages, policy loss, Calibrated Clipping, rollout correction, DAPO, KL.

Names that select a variant (`estimator`, `name`, `agg_mode`, `upper`, ...) are validated
against the registries in megatron_rl/algo at use time as well; the Literal types here give
early, field-named errors when a YAML file is loaded.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Seed, StrictConfig,
                                     UnitFloat)
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
    """Ratio that decides which tokens the clip zeroes: learner (its own forward's) or high_precision (high-precision forwards of pi_old and of every update's policy decide, the learner's forward still gives loss and gradient; costs those forwards; docs/RESULTS.md section 11)."""


class CalibrationConfig(StrictConfig):
    """Calibrated Clipping (docs/CALIBRATED_CLIPPING.md): FP8 ratio bounds matched to high precision."""

    enabled: bool = False
    """Turn Calibrated Clipping on (off: bounds are 1 - eps_low and 1 + eps_high)."""
    upper: Literal["match_contribution", "log_scale", "fixed"] = "match_contribution"
    """Upper-bound rule: match_contribution (paper default), log_scale, or fixed (1 + eps_high)."""
    calibrate_every: PositiveInt = 5
    """A calibration event every this many steps (>= 1): high-precision shadow forwards refresh the targets alpha and rho (paper: 20, at lr 1e-6 on 8B-32B models; the measured default 5 keeps the targets fresh where the policy moves faster, docs/RESULTS.md)."""
    smoothing: float = Field(0.5, ge=0, lt=1, allow_inf_nan=False)
    """EMA weight of the held bound, once per calibration event: new = smoothing * old + (1 - smoothing) * solved (per_step and per_minibatch pre-pass solves apply unsmoothed)."""
    bounds_update: Literal["per_step", "per_calibration", "per_minibatch"] = "per_step"
    """per_step: every step ends with a pooled solve over the FP8 ratios its off-policy updates' training forwards computed, at the targets held from the last calibration event, and the next step trains with it (no extra forward); per_calibration (paper): one pooled solve per calibration step, held until the next; per_minibatch: also re-solve before every off-policy mini-batch from a no-grad FP8 pre-pass."""
    on_policy_bounds: Literal["held", "open"] = "open"
    """Bounds of each step's first update (on-policy: its high-precision ratio is exactly 1, so high precision clips none of its tokens): open trains it at [lower_min, upper_max], clipping no more than the guard rails; held uses the calibrated bounds like every other update."""
    relax_only: bool = True
    """Guard rail: calibration only relaxes the bounds (L <= 1 - eps_low, H >= 1 + eps_high); false allows tightening."""
    target_source: Literal["shadow", "static"] = "shadow"
    """shadow: alpha and rho from the high-precision shadow pass; static: alpha and rho from this config."""
    static_alpha: Optional[UnitFloat] = None
    """alpha (fraction of negative-advantage tokens below the lower bound) when target_source=static."""
    static_rho: Optional[NonNegativeFloat] = None
    """rho (positive/negative contribution ratio) when target_source=static."""
    shadow_fraction: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    """Fraction in (0, 1] of the rows off-policy updates train on that run the high-precision shadow forwards and give the targets (same seeded draw on every rank; per_calibration's solve also takes its FP8 ratios from them); 1 (the paper): an event of a small batch holds only a few shadow-clipped tokens, and half of them left the targets noisier (docs/RESULTS.md section 7); 0.5 halves the event's cost."""
    backend: Literal["allgather", "histogram"] = "allgather"
    """Distributed statistics backend: allgather (exact unless subsampled) or histogram (one all-reduce)."""
    max_samples_per_rank: PositiveInt = 65536
    """allgather: each rank contributes at most this many (ratio, advantage) pairs to a solve (uniform subsample beyond; the dumps then hold more than the solve saw)."""
    hist_bins: int = Field(8192, ge=2)
    """histogram: number of bins over log r (plus one underflow and one overflow bin)."""
    hist_log_min: float = Field(-4.0, ge=-100, le=100, allow_inf_nan=False)
    """histogram: lower edge of the binned log-ratio range."""
    hist_log_max: float = Field(4.0, ge=-100, le=100, allow_inf_nan=False)
    """histogram: upper edge of the binned log-ratio range."""
    lower_min: float = Field(0.05, gt=0, le=1, allow_inf_nan=False)
    """Clamp: smallest allowed calibrated lower bound L."""
    strength: Literal["excess", "full", "gated", "decision"] = "decision"
    """decision (the default since 2026-12-05, session 42): the bounds stay 1 - eps_low, 1 + eps_high and every token's clip is decided on its high-precision ratio from the first step (as algo.policy_loss.clip_decision=high_precision decides it, paying high-precision forwards of pi_old and of every off-policy update's policy on every step); the calibration events measure the distortion (calib/gate_ratio) and the shadow's targets but move nothing. It clips what high precision clips (tracks its own shadow 1.00x and separate high-precision runs 0.99x FP8 tensorwise, 1.00x NVFP4) and was above vanilla at FP8's real error (+1.05 points, 24 seeds) and at 8x it (+6.5) on the 200-step deep miniature (docs/RESULTS.md sections 11-13); gated: the same decision (or the solved bounds, gate_opens_to) only once the run's low precision has clipped more than (1 + excess_tolerance) times what high precision clipped on the same shadow tokens, counted over every calibration event so far (and at least gate_min_tokens of them clipped by high precision), the vanilla bounds and the learner's decision before and whenever that no longer holds (vanilla bit for bit below the tolerance, so no forwards there, but no tracking either); full: the solved bounds as they are (the paper; tracks the shadow's clip fraction at any distortion); excess: the solved bounds are applied in proportion to the measured distortion, w = clamp(1 - (1 + excess_tolerance) * alpha_hp / alpha_lp, 0, 1) from each calibration event (alpha_lp: the fraction of negative tokens the low-precision ratios put below 1 - eps_low), log L = (1 - w) log(1 - eps_low) + w log L_solved, likewise H."""
    gate_opens_to: Literal["solved_bounds", "high_precision_decision"] = "high_precision_decision"
    """strength=gated: what an open gate changes. high_precision_decision (the default): the bounds stay vanilla and every token's clip is decided on its high-precision ratio (on the 200-step deep miniature at 8x FP8's error this recovered vanilla's whole loss against high precision, where moving the bounds recovered 12% of it; docs/RESULTS.md section 12); solved_bounds: the bounds move to the solve's (the paper's rule from then on). high_precision_decision: as algo.policy_loss.clip_decision=high_precision decides it, so the high-precision forwards of pi_old and of every update's policy (and a calibration event's shadow on every row, whatever shadow_fraction) are paid only on the steps that start with the gate open (docs/RESULTS.md section 12). Read only under strength=gated (the other rules have no gate)."""
    lower_target: Literal["event_alpha", "deflated", "agreement"] = "event_alpha"
    """What fraction of negative tokens a solve puts below L: event_alpha = the last calibration event's high-precision alpha, held until the next (the paper); deflated = the solved tokens' own low-precision fraction below 1 - eps_low times the pooled alpha_hp / alpha_lp of the recent events (the measured inflation of clipping by low precision, shrunk toward none by deflate_prior_tokens), so the bounds follow how far each step moved and move only as far as the distortion; agreement = the low-precision fraction below the candidate L whose clip decisions agree best, token by token, with the shadow's on the pooled events (F_beta of precision and recall, agreement_beta), so the bounds clip the tokens high precision clips rather than as many of them."""
    agreement_beta: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    """lower_target=agreement: beta of the F_beta score (0-100]: > 1 weights recall (keep the trust region on tokens high precision clips), < 1 precision (spare the gradients of tokens only the noise pushed below 1 - eps_low)."""
    agreement_points: int = Field(64, ge=2, le=4096)
    """lower_target=agreement: candidate lower bounds scored per event, log-spaced from lower_min to 1 - eps_low (to lower_max without relax_only), 2-4096."""
    deflate_prior_tokens: float = Field(4.0, ge=0, le=1e6, allow_inf_nan=False)
    """lower_target=deflated: pseudo-tokens added to both the high- and the low-precision count below 1 - eps_low before their ratio is taken (>= 0): with a handful of shadow tokens the deflation stays near 1 (vanilla bounds) instead of following a count of 0."""
    target_events: PositiveInt = 1
    """The targets (alpha, rho) and strength=excess's w come from the pooled token counts of this many most recent calibration events (>= 1; 1: each event alone). One event of a small batch has a few dozen tokens below 1 - eps_low; pooling trades staleness for a steadier target."""
    excess_tolerance: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    """strength=excess and gated: the excess clipping (alpha_lp / alpha_hp - 1) tolerated before the bounds move (0-100); 1.0 tolerates clipping up to 2x high precision, where the measured dose-response showed no harm from zeroed negative gradients (docs/RESULTS.md section 3)."""
    gate_min_tokens: float = Field(30.0, ge=0, le=1e9, allow_inf_nan=False)
    """strength=gated: the gate stays closed until the shadow's negative tokens below 1 - eps_low, counted over the run's calibration events, reach this many (>= 0): one event holds a handful, and a ratio of two handfuls would open the gate on noise."""
    lower_floor: Literal["lowest_ratio", "lower_min"] = "lowest_ratio"
    """When the target alpha lies below the solve's first negative token (alpha = 0: the shadow clipped nothing), lowest_ratio sets L to the lowest FP8 negative ratio solved on (clips none of them, keeps the trust region as tight as the data allow); lower_min lets the extrapolated quantile fall to lower_min (no lower trust region until the next solve)."""
    lower_max: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    """Clamp: largest allowed calibrated lower bound L."""
    upper_min: float = Field(1.0, ge=1, allow_inf_nan=False)
    """Clamp: smallest allowed calibrated upper bound H."""
    upper_max: float = Field(10.0, ge=1, allow_inf_nan=False)
    """Clamp: largest allowed calibrated upper bound H."""
    seed: Seed = 0
    """Seed of the shadow_fraction draws and of the allgather subsampling."""

    @field_validator("bounds_update", mode="before")
    @classmethod
    def _removed_modes(cls, value: object) -> object:
        if value == "per_microbatch":
            raise ValueError("algo.calibration.bounds_update=per_microbatch was removed (it solved on one micro-batch's "
                             "tokens); use per_minibatch (a pooled solve before every off-policy mini-batch) or "
                             "per_calibration (the paper's default)")
        return value

    @model_validator(mode="after")
    def _validate(self) -> "CalibrationConfig":
        p = "algo.calibration."
        _check(self.calibrate_every >= 1, f"{p}calibrate_every must be >= 1, got {self.calibrate_every}")
        _check(0 <= self.smoothing < 1, f"{p}smoothing must be in [0, 1), got {self.smoothing}")
        _check(0 < self.shadow_fraction <= 1, f"{p}shadow_fraction must be in (0, 1], got {self.shadow_fraction}")
        _check(self.max_samples_per_rank >= 1, f"{p}max_samples_per_rank must be >= 1, got {self.max_samples_per_rank}")
        _check(self.hist_bins >= 2, f"{p}hist_bins must be >= 2, got {self.hist_bins}")
        _check(self.hist_log_min < self.hist_log_max, f"{p}hist_log_min must be < {p}hist_log_max")
        _check(0 < self.lower_min <= self.lower_max, f"{p}lower_min/lower_max need 0 < lower_min <= lower_max")
        _check(self.lower_max <= 1.0, f"{p}lower_max must be <= 1, got {self.lower_max}")
        _check(1.0 <= self.upper_min <= self.upper_max, f"{p}upper_min/upper_max need 1 <= upper_min <= upper_max")
        if self.target_source == "static":
            _check(
                self.static_alpha is not None and 0 <= self.static_alpha <= 1,
                f"{p}static_alpha must be set in [0, 1] when {p}target_source=static",
            )
            _check(
                self.static_rho is not None and self.static_rho >= 0,
                f"{p}static_rho must be set and >= 0 when {p}target_source=static",
            )
        return self


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
        """k of the PPO clip decision on every step, fixed by the config whatever the calibration's state: 0 (the
        high-precision ratio) under policy_loss.clip_decision=high_precision or calibration strength=decision, the
        instrument's k otherwise, 1 (the learner's own ratio) under precision.recipe=none. What the loop's
        phases.error_scale.decision_scale gives at a closed gate; the planner and the study reports read it."""
        if recipe == "none":
            return 1.0
        if self.policy_loss.clip_decision == "high_precision" or (self.calibration.enabled
                                                                  and self.calibration.strength == "decision"):
            return 0.0
        return self.experimental.clip_error_scale
