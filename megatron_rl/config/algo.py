"""RL algorithm configs: advantages, policy loss, Calibrated Clipping, rollout correction, DAPO, KL.

Names that select a variant (`estimator`, `name`, `agg_mode`, `upper`, ...) are validated
against the registries in megatron_rl/algo at use time as well; the Literal types here give
early, field-named errors when a YAML file is loaded.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator, model_validator

from megatron_rl.config.base import StrictConfig


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


class AdvantageConfig(StrictConfig):
    """How per-sample advantages are computed from the rewards of each prompt's group."""

    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """grpo: (r - group mean) / (group std + eps); drgrpo: r - group mean (no std); rloo: leave-one-out baseline."""
    std_eps: float = 1e-6
    """Added to the group std before dividing (grpo)."""
    unbiased_std: bool = True
    """Use the unbiased (n-1) group std, as torch.std and verl do; False uses the population std."""

    @model_validator(mode="after")
    def _validate(self) -> "AdvantageConfig":
        _check(self.std_eps >= 0, f"algo.advantage.std_eps must be >= 0, got {self.std_eps}")
        return self


class PolicyLossConfig(StrictConfig):
    """The per-token policy-gradient loss and how it is aggregated over tokens."""

    name: Literal["ppo", "dual_clip", "cispo"] = "ppo"
    """ppo: clipped surrogate with ratio bounds [L, H]; dual_clip: ppo plus the c-bound for A<0; cispo: clipped-IS-weight REINFORCE."""
    eps_low: float = 0.2
    """Lower clip range: the uncalibrated lower ratio bound is 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip range: the uncalibrated upper ratio bound is 1 + eps_high (DAPO clip-higher: 0.28)."""
    dual_clip_c: float = 3.0
    """Dual-clip constant c (> 1): for A < 0 the loss is capped at -c * A."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation over tokens of the global batch (seq-mean-token-sum-norm is Dr.GRPO's constant normaliser)."""
    max_response_length: Optional[int] = None
    """Normaliser of seq-mean-token-sum-norm (Dr.GRPO); required by that mode."""
    log_ratio_clamp: float = 20.0
    """log(pi/pi_old) is clamped to +-this before exp, so a wild token cannot overflow."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the loss subtracts coef * entropy)."""

    @model_validator(mode="after")
    def _validate(self) -> "PolicyLossConfig":
        _check(0 <= self.eps_low < 1, f"algo.policy_loss.eps_low must be in [0, 1), got {self.eps_low}")
        _check(self.eps_high >= 0, f"algo.policy_loss.eps_high must be >= 0, got {self.eps_high}")
        _check(self.dual_clip_c > 1, f"algo.policy_loss.dual_clip_c must be > 1, got {self.dual_clip_c}")
        _check(self.log_ratio_clamp > 0, f"algo.policy_loss.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        _check(self.entropy_coef >= 0, f"algo.policy_loss.entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.agg_mode == "seq-mean-token-sum-norm":
            _check(
                self.max_response_length is not None and self.max_response_length > 0,
                "algo.policy_loss.max_response_length must be a positive int when agg_mode=seq-mean-token-sum-norm",
            )
        return self


class CalibrationConfig(StrictConfig):
    """Calibrated Clipping (docs/CALIBRATED_CLIPPING.md): FP8 ratio bounds matched to high precision."""

    enabled: bool = False
    """Turn Calibrated Clipping on (off: bounds are 1 - eps_low and 1 + eps_high)."""
    upper: Literal["match_contribution", "log_scale", "fixed"] = "match_contribution"
    """Upper-bound rule: match_contribution (paper default), log_scale, or fixed (1 + eps_high)."""
    calibrate_every: int = 20
    """A calibration event every this many steps (paper: 20): shadow forwards, one pooled solve at the end of the step, bounds held from the next step."""
    smoothing: float = 0.5
    """EMA weight of the held bound, once per calibration event: new = smoothing * old + (1 - smoothing) * solved (per_minibatch pre-pass solves apply unsmoothed)."""
    bounds_update: Literal["per_calibration", "per_minibatch"] = "per_calibration"
    """per_calibration (paper): one pooled solve per calibration step, held until the next; per_minibatch: also re-solve before every off-policy mini-batch from a no-grad FP8 pre-pass."""
    relax_only: bool = True
    """Guard rail: calibration only relaxes the bounds (L <= 1 - eps_low, H >= 1 + eps_high); false allows tightening."""
    target_source: Literal["shadow", "static"] = "shadow"
    """shadow: alpha and rho from the high-precision shadow pass; static: alpha and rho from this config."""
    static_alpha: Optional[float] = None
    """alpha (fraction of negative-advantage tokens below the lower bound) when target_source=static."""
    static_rho: Optional[float] = None
    """rho (positive/negative contribution ratio) when target_source=static."""
    shadow_fraction: float = 1.0
    """Fraction of the step's rows that run the high-precision shadow forwards and feed the calibration solve (same seeded draw on every rank)."""
    backend: Literal["allgather", "histogram"] = "allgather"
    """Distributed statistics backend: allgather (exact unless subsampled) or histogram (one all-reduce)."""
    max_samples_per_rank: int = 65536
    """allgather: each rank contributes at most this many (ratio, advantage) pairs to a solve (uniform subsample beyond; the dumps then hold more than the solve saw)."""
    hist_bins: int = 8192
    """histogram: number of bins over log r (plus one underflow and one overflow bin)."""
    hist_log_min: float = -4.0
    """histogram: lower edge of the binned log-ratio range."""
    hist_log_max: float = 4.0
    """histogram: upper edge of the binned log-ratio range."""
    lower_min: float = 0.05
    """Clamp: smallest allowed calibrated lower bound L."""
    lower_max: float = 1.0
    """Clamp: largest allowed calibrated lower bound L."""
    upper_min: float = 1.0
    """Clamp: smallest allowed calibrated upper bound H."""
    upper_max: float = 10.0
    """Clamp: largest allowed calibrated upper bound H."""
    seed: int = 0
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
    tis_cap: float = 2.0
    """Truncation C of TIS (paper and peers: 2)."""
    mis_low: float = 0.5
    """MIS/ICEPOP: weights below this are masked to 0."""
    mis_high: float = 2.0
    """MIS/ICEPOP: weights above this are masked to 0."""

    @model_validator(mode="after")
    def _validate(self) -> "RolloutCorrectionConfig":
        p = "algo.rollout_correction."
        _check(self.tis_cap > 0, f"{p}tis_cap must be > 0, got {self.tis_cap}")
        _check(0 <= self.mis_low < self.mis_high, f"{p}mis_low/mis_high need 0 <= mis_low < mis_high")
        return self


class DapoConfig(StrictConfig):
    """DAPO extras: dynamic sampling and overlong reward shaping."""

    dynamic_sampling: bool = False
    """Drop prompt groups whose rewards all agree (zero std): they carry no GRPO signal."""
    overlong_buffer: int = 0
    """Length of the soft overlong buffer (0 = shaping off)."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the hard limit: penalty = min(-(len - (Lmax - buffer)) / buffer * factor, 0)."""
    max_response_length: Optional[int] = None
    """Lmax of the shaping (default: the rollout's max_new_tokens, filled in by the loop)."""

    @model_validator(mode="after")
    def _validate(self) -> "DapoConfig":
        p = "algo.dapo."
        _check(self.overlong_buffer >= 0, f"{p}overlong_buffer must be >= 0, got {self.overlong_buffer}")
        _check(self.overlong_penalty_factor >= 0, f"{p}overlong_penalty_factor must be >= 0")
        if self.max_response_length is not None:
            _check(self.max_response_length > self.overlong_buffer, f"{p}max_response_length must exceed {p}overlong_buffer")
        return self


class KLConfig(StrictConfig):
    """KL penalty to a frozen reference policy, added to the per-token loss."""

    coef: float = 0.0
    """KL coefficient (0 = off; no reference forward is needed then)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator: k1 = log-ratio, k2 = half squared log-ratio, k3 = Schulman's low-variance estimator."""

    @model_validator(mode="after")
    def _validate(self) -> "KLConfig":
        _check(self.coef >= 0, f"algo.kl.coef must be >= 0, got {self.coef}")
        return self


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
    ratio_hist_bins: int = 512
    """Bins of the log-ratio histograms carried in the loss metrics (for ratio quantiles)."""
    ratio_hist_log_range: float = 2.0
    """Those histograms cover log r in [-range, range] (plus under/overflow)."""

    @model_validator(mode="after")
    def _validate(self) -> "AlgoConfig":
        _check(self.ratio_hist_bins >= 2, f"algo.ratio_hist_bins must be >= 2, got {self.ratio_hist_bins}")
        _check(self.ratio_hist_log_range > 0, "algo.ratio_hist_log_range must be > 0")
        return self
