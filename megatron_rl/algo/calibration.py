"""Calibrated Clipping solvers (docs/CALIBRATED_CLIPPING.md, section 2): statistics, targets and bounds.

A solve sees one pooled token set (section "Which tokens a solve sees"). Its statistics are
additive values, `RatioStats`: every micro-batch of the set `add`s its valid tokens locally (no
communication), and `reduce(group)` combines the ranks once per solve:
- FP8 ratios: exact samples with counts (`allgather`, one padded all-gather) or histogram bins
  with A*r mass (`histogram`, one all-reduce of O(bins) floats);
- high-precision ratios (calibration events): 5 sums [|N|, |N below 1-eps_low|, C+_hp(1+eps_high),
  C-_hp(1-eps_low), |P|] (one all-reduce), from which alpha and rho are exact for either backend:
  alpha = |{N : r_hp < 1 - eps_low}| / |N|, rho = C+_hp(1 + eps_high) / C-_hp(1 - eps_low).

`solve_bounds(stats, targets, ...)` then applies, in this order (guard rails of section 2.4):
  1. L = the alpha-quantile of the FP8 negative ratios, kept at the previous L when N is empty: for bounds
     applied to the tokens they were solved on (`quantile="same_tokens"`) the k-th order statistic,
     k = floor(alpha |N|) + 1; for bounds applied to later tokens (`quantile="next_tokens"`, per_step) the
     type-6 quantile at position alpha (|N| + 1), whose expected coverage of new tokens is alpha
     (megatron_rl/algo/ratio_stats.py);
     L is at least the lowest FP8 negative ratio (the largest L that clips none of the solved tokens), so an
     alpha below the first token (alpha = 0) keeps a lower trust region;
  2. clamp L to [lower_min, lower_max];
  3. relax_only: L = min(L, 1 - eps_low);
  4. H from the `upper` rule at that L (match_contribution: smallest H >= 1 with
     C+_fp8(H) / C-_fp8(L) >= rho), kept at the previous H when it has no answer;
  5. clamp H to [upper_min, upper_max];
  6. relax_only: H = max(H, 1 + eps_high);
  7. (the clipper) EMA with `smoothing` into the held bounds.
Nothing returns NaN. Every tensor created here takes the device of the data it describes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from megatron_rl.algo.ratio_stats import HistSpec, HistStats, SampleStats, local_histogram
from megatron_rl.algo.registry import Registry
from megatron_rl.parallel import collectives

Stats = Union[SampleStats, HistStats]

HIST_BINS = 8192
"""histogram backend: bins over [HIST_LOG_MIN, HIST_LOG_MAX] (plus one underflow and one overflow bin)."""
HIST_LOG_MIN = -4.0
"""histogram backend: lower edge of the binned log-ratio range."""
HIST_LOG_MAX = 4.0
"""histogram backend: upper edge of the binned log-ratio range."""
LOWER_MAX = 1.0
"""Clamp: largest calibrated lower bound L."""
UPPER_MIN = 1.0
"""Clamp: smallest calibrated upper bound H."""
MAX_SAMPLES_PER_RANK = 65536
"""allgather backend: (ratio, advantage) pairs one rank contributes to a solve at most (uniform subsample beyond)."""
SEED = 0
"""Seed of the shadow_fraction row draws and of the allgather subsampling."""


@dataclass(frozen=True)
class CalibrationTargets:
    """What the high-precision pass says the FP8 run should reproduce."""

    alpha: float
    """Fraction of negative-advantage tokens with r_hp < 1 - eps_low (0 when N is empty)."""
    rho: float
    """C+_hp(1 + eps_high) / C-_hp(1 - eps_low) (inf when C- is 0 but C+ is not, 0 when C+ is 0)."""
    num_neg: float
    """|N| of the reference pass (0 means alpha carries no information)."""
    num_pos: float
    """|P| of the reference pass (0 means rho carries no information)."""
    sums: tuple[float, ...] = ()
    """The reference pass's `reference_sums` (|N|, |N below|, C+, C-, |P|), from which alpha and rho came; empty for
    targets given directly. Additive: pooled events sum them (`targets_from_sums`)."""

    @classmethod
    def of(cls, alpha: float, rho: float) -> "CalibrationTargets":
        """Targets given directly (static source, tests); the counts are set to 1."""
        return cls(float(alpha), float(rho), 1.0, 1.0)

    def merged_into(self, old: Optional["CalibrationTargets"]) -> "CalibrationTargets":
        """These targets, except that a side this pass saw no tokens of keeps `old`'s value (an empty side says nothing)."""
        if old is None:
            return self
        alpha = self.alpha if self.num_neg > 0 else old.alpha
        rho = self.rho if self.num_neg > 0 and self.num_pos > 0 else old.rho
        return CalibrationTargets(alpha, rho, self.num_neg, self.num_pos, self.sums)


class BoundsSolution(NamedTuple):
    """One solve: the bounds after the guard rails (before EMA), the raw ones, and what the metrics report."""

    lower: float
    """L after clamps and relax_only, rounded to the ratios' dtype."""
    upper: float
    """H after clamps and relax_only, rounded to the ratios' dtype."""
    lower_solved: bool
    """False when N was empty and the previous L was kept."""
    upper_solved: bool
    """False when the previous H was kept (P empty, or C-(L) = 0 for match_contribution)."""
    rho_achieved: float
    """C+(H) / C-(L) on the FP8 ratios at the returned bounds (nan when C-(L) = 0)."""
    alpha_achieved: float
    """Fraction of FP8 negative ratios strictly below the returned L (nan when N is empty)."""
    lower_raw: float = math.nan
    """The alpha-quantile before any guard rail (nan when N was empty)."""
    upper_raw: float = math.nan
    """The upper rule's answer at the guarded L, before any guard rail (nan when it had none)."""


def _check_backend(backend: str) -> None:
    STATS_BACKENDS.get(backend)


def _valid(ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ratio, adv = ratio.detach().reshape(-1), adv.detach().reshape(-1)
    if ratio.shape != adv.shape:
        raise ValueError(f"ratio and adv must have the same number of tokens, got {ratio.numel()} and {adv.numel()}")
    keep = adv != 0
    return ratio[keep], adv[keep]


def flatten_valid(ratio: torch.Tensor, adv: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] ratio and advantages -> 1-D detached tensors over the tokens where loss_mask > 0."""
    keep = loss_mask > 0
    return ratio.detach()[keep], adv.detach()[keep]


def reference_sums(ratio_hp: torch.Tensor, adv: torch.Tensor, *, eps_low: float, eps_high: float,
                   weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Local [|N|, |N below 1-eps_low|, C+_hp(1+eps_high), C-_hp(1-eps_low), |P|] (float64, data's device); additive.
    With `weight` each token counts that many times (counts and masses alike)."""
    r64, a64 = ratio_hp.detach().reshape(-1).to(torch.float64), adv.detach().reshape(-1).to(torch.float64)
    w = torch.ones_like(r64) if weight is None else weight.detach().reshape(-1).to(torch.float64)
    neg, pos = a64 < 0, a64 > 0
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    return torch.stack([
        (w * neg).sum(),
        (w * (neg & (r64 < lo))).sum(),
        (w * a64 * r64 * (pos & (r64 <= hi))).sum(),
        (-w * a64 * r64 * (neg & (r64 >= lo))).sum(),
        (w * pos).sum(),
    ])


def targets_from_sums(sums: Union[torch.Tensor, Sequence[float]]) -> CalibrationTargets:
    """alpha and rho from (global) `reference_sums` output (or the element-wise sum of several events')."""
    values = tuple(float(x) for x in (sums.tolist() if isinstance(sums, torch.Tensor) else sums))
    n_neg, n_below, c_plus, c_minus, n_pos = values
    alpha = n_below / n_neg if n_neg > 0 else 0.0
    if c_minus > 0:
        rho = c_plus / c_minus
    else:
        rho = math.inf if c_plus > 0 else 0.0
    return CalibrationTargets(alpha, rho, n_neg, n_pos, values)


StatsBackend = Callable[..., Stats]
STATS_BACKENDS: Registry[StatsBackend] = Registry("calibration backend")


@STATS_BACKENDS.register("histogram")
def _histogram_stats(parts: list[torch.Tensor], group, *, hist_spec: HistSpec, **_: object) -> HistStats:
    local = sum(parts[1:], parts[0]) if parts else torch.zeros(4, hist_spec.bins + 2, dtype=torch.float64)  # device-ok: a rank that saw no tokens contributes zeros; the collective places it on the group's device
    return HistStats(collectives.all_reduce_sum(local, group), hist_spec)


@STATS_BACKENDS.register("allgather")
def _allgather_stats(parts: list[torch.Tensor], group, *, max_samples_per_rank: int,
                     generator: Optional[torch.Generator], weighted: bool = False, **_: object) -> SampleStats:
    # weighted: a third column holds each token's weight (identical layout on every rank: the gather needs it)
    rows = torch.cat(parts) if parts else torch.zeros(0, 3 if weighted else 2, dtype=torch.float64)  # device-ok: as above, no tokens on this rank
    rows, weight = collectives.gather_samples(rows, max_samples_per_rank, group, generator)
    return SampleStats(rows[:, 0], rows[:, 1], weight * rows[:, 2] if weighted else weight)


class ReducedStats(NamedTuple):
    """Global statistics of one solve's token set."""

    fp8: Optional[Stats]
    """FP8 ratio statistics (None when the solve collects none: a targets-only event)."""
    targets: Optional[CalibrationTargets]
    """alpha and rho of the high-precision ratios (None when the solve has no shadow tokens)."""


class RatioStats:
    """One rank's additive statistics of a solve's token set: `add` per micro-batch, `reduce` once per solve.

    What it collects is fixed at construction (identical on every rank, so every rank runs the same
    collectives in `reduce`, even one that added no tokens). With `record` it also keeps the tokens
    themselves (FP8 and high-precision ratios, advantages, update index) for the ratio dumps.
    `weighted` statistics count each token `weight` times (`add(..., weight=)`, required then): the
    rollout-correction weights of stale samples under rollout.overlap=one_step_off.
    """

    def __init__(self, backend: str, *, fp8: bool = True, reference: bool = False, eps_low: float = 0.2,
                 eps_high: float = 0.2, hist_spec: HistSpec = HistSpec(), record: bool = False,
                 weighted: bool = False) -> None:
        """An empty accumulator for `backend` ("allgather" | "histogram")."""
        _check_backend(backend)
        self.weighted = weighted
        self.backend, self.hist_spec = backend, hist_spec
        self.collect_fp8, self.collect_reference = fp8, reference
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.parts: list[torch.Tensor] = []
        self.reference: Optional[torch.Tensor] = None
        self.records: Optional[list[dict[str, torch.Tensor]]] = [] if record else None
        self.num_tokens = 0

    def add(self, ratio: torch.Tensor, adv: torch.Tensor, *, ratio_hp: Optional[torch.Tensor] = None, update: int = 0,
            weight: Optional[torch.Tensor] = None, hp_mask: Optional[torch.Tensor] = None) -> None:
        """Add 1-D FP8 ratios and advantages of valid tokens (and their high-precision ratios when collected; their
        weights when the statistics are weighted). `hp_mask` (bool per token) marks the tokens whose high-precision
        ratio the reference sums count (per_step with shadow_fraction < 1: the FP8 statistics take every row, the
        targets the shadow rows); without it every added token counts."""
        ratio, adv = ratio.detach().reshape(-1), adv.detach().reshape(-1)
        if ratio.shape != adv.shape:
            raise ValueError(f"ratio and adv must have the same number of tokens, got {ratio.numel()} and {adv.numel()}")
        if self.weighted != (weight is not None) or (weight is not None and weight.numel() != ratio.numel()):
            raise ValueError("weighted statistics need one weight per token (and unweighted ones none)")
        if hp_mask is not None and hp_mask.numel() != ratio.numel():
            raise ValueError(f"hp_mask needs one flag per token, got {hp_mask.numel()} for {ratio.numel()} tokens")
        if weight is not None:  # a non-finite or negative weight counts nothing
            weight = weight.detach().reshape(-1).to(torch.float64)
            weight = torch.where(torch.isfinite(weight) & (weight > 0), weight, torch.zeros_like(weight))
        if self.collect_reference and (ratio_hp is None or ratio_hp.numel() != ratio.numel()):
            raise ValueError("a calibration event needs the high-precision ratio of every token it adds")
        # a non-finite token (a diverged forward the health guard skips) must not turn the bounds into NaN:
        # it becomes (r = 1, A = 0), in neither N nor P (torch.where keeps shapes static: no host sync)
        finite = torch.isfinite(ratio) & torch.isfinite(adv)
        in_hp = None
        if ratio_hp is not None:
            ratio_hp = ratio_hp.detach().reshape(-1)
            in_hp = torch.ones_like(finite) if hp_mask is None else hp_mask.detach().reshape(-1).to(torch.bool)
            # outside hp_mask the high-precision ratio is not known (it may hold anything): it neither counts nor filters
            ratio_hp = torch.where(in_hp, ratio_hp, torch.ones_like(ratio_hp))
            finite = finite & torch.isfinite(ratio_hp)
            ratio_hp = torch.where(finite, ratio_hp, torch.ones_like(ratio_hp))
        raw = (ratio, adv, ratio_hp)
        ratio = torch.where(finite, ratio, torch.ones_like(ratio))
        adv = torch.where(finite, adv, torch.zeros_like(adv))
        if self.collect_reference:
            ref_w = in_hp.to(torch.float64) if weight is None else weight * in_hp
            sums = reference_sums(ratio_hp, adv, eps_low=self.eps_low, eps_high=self.eps_high,
                                  weight=None if hp_mask is None and weight is None else ref_w)
            self.reference = sums if self.reference is None else self.reference + sums
        if self.collect_fp8:
            if self.backend == "histogram":
                self.parts = [local_histogram(ratio, adv, self.hist_spec, weight) + (self.parts[0] if self.parts else 0.0)]
            else:
                columns = [ratio.to(torch.float64), adv.to(torch.float64)] + ([weight] if weight is not None else [])
                self.parts.append(torch.stack(columns, dim=1))
        if self.records is not None:
            rec = {"ratio": raw[0][finite], "adv": raw[1][finite]}
            rec["minibatch"] = torch.full_like(rec["adv"], update, dtype=torch.int64)
            if ratio_hp is not None:
                hp = torch.where(in_hp, raw[2], torch.full_like(raw[2], math.nan))
                rec["ratio_hp"] = hp[finite]
            self.records.append(rec)
        self.num_tokens += int(ratio.numel())

    def reduce(self, group: Optional[object] = None, *, max_samples_per_rank: int = MAX_SAMPLES_PER_RANK,
               generator: Optional[torch.Generator] = None) -> ReducedStats:
        """Global statistics over `group` (collective: every rank of the group calls it, even with no tokens)."""
        fp8 = None
        if self.collect_fp8:
            fp8 = STATS_BACKENDS.get(self.backend)(self.parts, group, hist_spec=self.hist_spec,
                                                   max_samples_per_rank=max_samples_per_rank, generator=generator,
                                                   weighted=self.weighted)
        targets = None
        if self.collect_reference:
            local = self.reference if self.reference is not None else torch.zeros(5, dtype=torch.float64)  # device-ok: no tokens on this rank; the collective places it
            targets = targets_from_sums(collectives.all_reduce_sum(local, group))
        return ReducedStats(fp8, targets)

    def dump_arrays(self) -> dict[str, np.ndarray]:
        """The recorded tokens as numpy arrays: ratio, ratio_hp (float64; nan where not collected), adv (float64), minibatch (int64)."""
        recs = self.records or []
        host = lambda t, dt: t.detach().to("cpu", dt)  # noqa: E731
        out = {}
        for key, dt in (("ratio", torch.float64), ("ratio_hp", torch.float64), ("adv", torch.float64), ("minibatch", torch.int64)):
            parts = [host(r[key], dt) if key in r else torch.full_like(host(r["adv"], dt), math.nan) for r in recs]
            out[key] = torch.cat(parts).numpy() if parts else np.zeros(0, dtype=np.int64 if dt == torch.int64 else np.float64)
        return out


def reference_targets(ratio_hp: torch.Tensor, adv: torch.Tensor, *, eps_low: float, eps_high: float,
                      group: Optional[object] = None, backend: str = "allgather") -> CalibrationTargets:
    """alpha and rho of the high-precision ratios (global over `group`; exact sums for both backends)."""
    stats = RatioStats(backend, fp8=False, reference=True, eps_low=eps_low, eps_high=eps_high)
    r, a = _valid(ratio_hp, adv)
    stats.add(r, a, ratio_hp=r)
    return stats.reduce(group).targets


def gather_ratio_stats(ratio: torch.Tensor, adv: torch.Tensor, *, group: Optional[object] = None,
                       backend: str = "allgather", max_samples_per_rank: int = MAX_SAMPLES_PER_RANK, hist_spec: HistSpec = HistSpec(),
                       generator: Optional[torch.Generator] = None) -> Stats:
    """Global statistics of (ratio, adv) over `group` by `backend` (one collective round per call)."""
    stats = RatioStats(backend, hist_spec=hist_spec)
    stats.add(*_valid(ratio, adv))
    return stats.reduce(group, max_samples_per_rank=max_samples_per_rank, generator=generator).fp8


UpperRule = Callable[[Stats, float, CalibrationTargets, float, float], Optional[float]]
UPPER_RULES: Registry[UpperRule] = Registry("calibration upper rule")


@UPPER_RULES.register("match_contribution")
def _upper_match(stats: Stats, lower: float, targets: CalibrationTargets, eps_low: float, eps_high: float) -> Optional[float]:
    c_minus = stats.neg_mass_from(lower)
    if c_minus <= 0:
        return None
    return stats.smallest_upper(targets.rho * c_minus)


@UPPER_RULES.register("log_scale")
def _upper_log_scale(stats: Stats, lower: float, targets: CalibrationTargets, eps_low: float, eps_high: float) -> Optional[float]:
    if eps_low <= 0 or lower <= 0:
        return 1.0 + eps_high
    return math.exp(math.log1p(eps_high) * math.log(lower) / math.log1p(-eps_low))


@UPPER_RULES.register("fixed")
def _upper_fixed(stats: Stats, lower: float, targets: CalibrationTargets, eps_low: float, eps_high: float) -> Optional[float]:
    return 1.0 + eps_high


QUANTILES = {"same_tokens": "lower_quantile", "next_tokens": "predictive_lower_quantile"}
"""How L is read off the FP8 negative ratios: for the tokens the statistics hold, or for tokens not yet seen."""


def _finite_or(x: Optional[float], fallback: float) -> float:
    return fallback if x is None or not math.isfinite(x) else x


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.bfloat16: np.float32, torch.float16: np.float16}


def _round(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype` (the ratios' precision), so a bound equal to a data point stays equal to it in the loss."""
    return float(_NUMPY_DTYPES.get(dtype, np.float32)(x))


def solve_bounds(
    stats: Stats,
    targets: CalibrationTargets,
    *,
    eps_low: float,
    eps_high: float,
    upper: str = "match_contribution",
    lower_min: float = 0.05,
    lower_max: float = LOWER_MAX,
    upper_min: float = UPPER_MIN,
    upper_max: float = 10.0,
    relax_only: bool = False,
    previous: Optional[tuple[float, float]] = None,
    dtype: torch.dtype = torch.float32,
    quantile: str = "same_tokens",
) -> BoundsSolution:
    """L and H from global statistics in the module docstring's order (no communication); `previous` (default 1 -/+ eps) fills an empty side."""
    rule = UPPER_RULES.get(upper)
    if quantile not in QUANTILES:
        raise ValueError(f"unknown calibration quantile {quantile!r}; choose one of {sorted(QUANTILES)}")
    prev_lo, prev_hi = (1.0 - eps_low, 1.0 + eps_high) if previous is None else (float(previous[0]), float(previous[1]))
    raw_lo = getattr(stats, QUANTILES[quantile])(targets.alpha)
    if raw_lo is not None:
        # below the first order statistic the type-6 quantile extrapolates toward 0, which leaves the negative side
        # without a trust region until the next solve; the lowest ratio seen clips none of the solved tokens either
        raw_lo = max(raw_lo, stats.lower_quantile(0.0))
    lo = min(max(_finite_or(raw_lo, prev_lo), lower_min), lower_max)
    if relax_only:
        lo = min(lo, 1.0 - eps_low)
    lo = _round(lo, dtype)
    raw_hi = rule(stats, lo, targets, eps_low, eps_high) if stats.num_pos > 0 else None
    hi = min(max(_finite_or(raw_hi, prev_hi), upper_min), upper_max)
    if relax_only:
        hi = max(hi, 1.0 + eps_high)
    hi = _round(hi, dtype)
    c_minus = stats.neg_mass_from(lo)
    rho_achieved = stats.pos_mass_to(hi) / c_minus if c_minus > 0 else math.nan
    alpha_achieved = stats.neg_count_below(lo) / stats.num_neg if stats.num_neg > 0 else math.nan
    return BoundsSolution(lo, hi, raw_lo is not None, raw_hi is not None, rho_achieved, alpha_achieved,
                          _finite_or(raw_lo, math.nan), _finite_or(raw_hi, math.nan))


def calibrate_bounds(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    targets: CalibrationTargets,
    *,
    eps_low: float,
    eps_high: float,
    upper: str = "match_contribution",
    group: Optional[object] = None,
    backend: str = "allgather",
    lower_min: float = 0.05,
    lower_max: float = LOWER_MAX,
    upper_min: float = UPPER_MIN,
    upper_max: float = 10.0,
    relax_only: bool = False,
    previous: Optional[tuple[float, float]] = None,
    max_samples_per_rank: int = MAX_SAMPLES_PER_RANK,
    hist_spec: HistSpec = HistSpec(),
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d (lower, upper) in the ratios' dtype and device for the FP8 ratios at `targets`, global over `group` (one-shot form)."""
    stats = gather_ratio_stats(ratio, adv, group=group, backend=backend, max_samples_per_rank=max_samples_per_rank,
                               hist_spec=hist_spec, generator=generator)
    dtype = ratio.dtype if ratio.is_floating_point() else torch.float32
    sol = solve_bounds(stats, targets, eps_low=eps_low, eps_high=eps_high, upper=upper, lower_min=lower_min,
                       lower_max=lower_max, upper_min=upper_min, upper_max=upper_max, relax_only=relax_only,
                       previous=previous, dtype=dtype)
    return (torch.tensor(sol.lower, dtype=dtype, device=ratio.device),
            torch.tensor(sol.upper, dtype=dtype, device=ratio.device))


def calibration_bytes(backend: str, *, world_size: int, tokens_per_rank: int, max_samples_per_rank: int = MAX_SAMPLES_PER_RANK,
                      hist_spec: HistSpec = HistSpec()) -> int:
    """Bytes one rank receives per FP8-statistics reduce of `tokens_per_rank` tokens (ring algorithms) for `backend`."""
    _check_backend(backend)
    if backend == "histogram":
        return collectives.all_reduce_bytes(world_size, hist_spec.numel, 8)
    rows = min(tokens_per_rank, max_samples_per_rank)
    return collectives.all_gather_bytes(world_size, rows, 3 * 8)


def reference_bytes(world_size: int) -> int:
    """Bytes one rank receives per high-precision reduce (all-reduce of 5 float64)."""
    return collectives.all_reduce_bytes(world_size, 5, 8)
