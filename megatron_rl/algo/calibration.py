"""Calibrated Clipping solvers (docs/CALIBRATED_CLIPPING.md, section 2): targets and bounds.

- `reference_targets(ratio_hp, adv, ...)`: alpha = |{N : r_hp < 1 - eps_low}| / |N| and
  rho = C+_hp(1 + eps_high) / C-_hp(1 - eps_low) from the high-precision shadow ratios.
  Both are ratios of global sums, so with a `group` one all-reduce of 5 floats makes them
  exact for either backend.
- `calibrate_bounds(ratio, adv, targets, ...)`: L = the alpha-quantile of the FP8 negative
  ratios (definition in megatron_rl/algo/ratio_stats.py: with distinct ratios exactly
  floor(alpha * |N|) of them lie strictly below L) and H from the `upper` rule, clamped.
  With no negative (positive) tokens the previous L (H) is kept; nothing returns NaN.

Inputs are 1-D tensors over valid tokens (tokens with A = 0 are ignored). With `group`,
statistics are global over that process group ("allgather" or "histogram" backend); every
rank must call with the same arguments except the data, even with zero tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch

from megatron_rl.algo.ratio_stats import HistSpec, HistStats, SampleStats, local_histogram
from megatron_rl.algo.registry import Registry
from megatron_rl.parallel import collectives

Stats = Union[SampleStats, HistStats]


@dataclass
class CalibrationTargets:
    """What the high-precision pass says the FP8 run should reproduce."""

    alpha: torch.Tensor
    """0-d float64: fraction of negative-advantage tokens with r_hp < 1 - eps_low (0 when N is empty)."""
    rho: torch.Tensor
    """0-d float64: C+_hp(1 + eps_high) / C-_hp(1 - eps_low) (inf when C- is 0 but C+ is not, 0 when C+ is 0)."""
    num_neg: torch.Tensor
    """0-d float64: |N| of the reference pass (0 means alpha carries no information)."""
    num_pos: torch.Tensor
    """0-d float64: |P| of the reference pass (0 means rho carries no information)."""

    @classmethod
    def of(cls, alpha: float, rho: float) -> "CalibrationTargets":
        """Targets given directly (static source, tests); the counts are set to 1."""
        f64 = lambda x: torch.tensor(float(x), dtype=torch.float64)  # noqa: E731
        return cls(f64(alpha), f64(rho), f64(1), f64(1))


class BoundsSolution(NamedTuple):
    """Solved bounds plus what the metrics report."""

    lower: torch.Tensor
    """0-d lower ratio bound L (clamped)."""
    upper: torch.Tensor
    """0-d upper ratio bound H (clamped)."""
    lower_solved: bool
    """False when N was empty and the previous L was kept."""
    upper_solved: bool
    """False when the previous H was kept (P empty, or C-(L) = 0 for match_contribution)."""
    rho_achieved: float
    """C+(H) / C-(L) on the live ratios at the returned bounds (nan when C-(L) = 0)."""
    alpha_achieved: float
    """Fraction of live negative ratios strictly below the returned L (nan when N is empty)."""


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


def reference_sums(
    ratio_hp: torch.Tensor,
    adv: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    group: Optional[object] = None,
) -> torch.Tensor:
    """Global [|N|, |N below 1-eps_low|, C+_hp(1+eps_high), C-_hp(1-eps_low), |P|] (float64); additive over batches."""
    r, a = _valid(ratio_hp, adv)
    r64, a64 = r.to(torch.float64), a.to(torch.float64)
    neg, pos = a64 < 0, a64 > 0
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    sums = torch.stack(
        [
            neg.sum().to(torch.float64),
            (neg & (r64 < lo)).sum().to(torch.float64),
            (a64 * r64 * (pos & (r64 <= hi))).sum(),
            (-a64 * r64 * (neg & (r64 >= lo))).sum(),
            pos.sum().to(torch.float64),
        ]
    )
    return collectives.all_reduce_sum(sums, group)


def targets_from_sums(sums: torch.Tensor) -> CalibrationTargets:
    """alpha and rho from `reference_sums` output (possibly summed over several micro-batches)."""
    n_neg, n_below, c_plus, c_minus, n_pos = sums.tolist()
    alpha = n_below / n_neg if n_neg > 0 else 0.0
    if c_minus > 0:
        rho = c_plus / c_minus
    else:
        rho = math.inf if c_plus > 0 else 0.0
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return CalibrationTargets(f64(alpha), f64(rho), f64(n_neg), f64(n_pos))


def reference_targets(
    ratio_hp: torch.Tensor,
    adv: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    group: Optional[object] = None,
    backend: str = "allgather",
) -> CalibrationTargets:
    """alpha and rho of the high-precision ratios (global over `group`; exact sums for both backends)."""
    _check_backend(backend)
    return targets_from_sums(reference_sums(ratio_hp, adv, eps_low=eps_low, eps_high=eps_high, group=group))


StatsBackend = Callable[..., Stats]
STATS_BACKENDS: Registry[StatsBackend] = Registry("calibration backend")


@STATS_BACKENDS.register("histogram")
def _histogram_stats(r, a, group, *, hist_spec: HistSpec, **_: object) -> HistStats:
    return HistStats(collectives.all_reduce_sum(local_histogram(r, a, hist_spec), group), hist_spec)


@STATS_BACKENDS.register("allgather")
def _allgather_stats(r, a, group, *, max_samples_per_rank: int, generator: Optional[torch.Generator], **_: object) -> SampleStats:
    dt = torch.float64 if torch.float64 in (r.dtype, a.dtype) else torch.float32
    rows, weight = collectives.gather_samples(torch.stack([r.to(dt), a.to(dt)], dim=1), max_samples_per_rank, group, generator)
    return SampleStats(rows[:, 0], rows[:, 1], weight)


def gather_ratio_stats(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    *,
    group: Optional[object] = None,
    backend: str = "allgather",
    max_samples_per_rank: int = 65536,
    hist_spec: HistSpec = HistSpec(),
    generator: Optional[torch.Generator] = None,
) -> Stats:
    """Global statistics of (ratio, adv) over `group` by `backend` (one collective round per call)."""
    fn = STATS_BACKENDS.get(backend)
    r, a = _valid(ratio, adv)
    return fn(r, a, group, hist_spec=hist_spec, max_samples_per_rank=max_samples_per_rank, generator=generator)


UpperRule = Callable[[Stats, float, CalibrationTargets, float, float], Optional[float]]
UPPER_RULES: Registry[UpperRule] = Registry("calibration upper rule")


@UPPER_RULES.register("match_contribution")
def _upper_match(stats: Stats, lower: float, targets: CalibrationTargets, eps_low: float, eps_high: float) -> Optional[float]:
    c_minus = stats.neg_mass_from(lower)
    if c_minus <= 0:
        return None
    return stats.smallest_upper(float(targets.rho) * c_minus)


@UPPER_RULES.register("log_scale")
def _upper_log_scale(stats: Stats, lower: float, targets: CalibrationTargets, eps_low: float, eps_high: float) -> Optional[float]:
    if eps_low <= 0 or lower <= 0:
        return 1.0 + eps_high
    return math.exp(math.log1p(eps_high) * math.log(lower) / math.log1p(-eps_low))


@UPPER_RULES.register("fixed")
def _upper_fixed(stats: Stats, lower: float, targets: CalibrationTargets, eps_low: float, eps_high: float) -> Optional[float]:
    return 1.0 + eps_high


def _finite_or(x: Optional[float], fallback: float) -> float:
    return fallback if x is None or not math.isfinite(x) else x


def solve_bounds(
    stats: Stats,
    targets: CalibrationTargets,
    *,
    eps_low: float,
    eps_high: float,
    upper: str = "match_contribution",
    lower_min: float = 0.05,
    lower_max: float = 1.0,
    upper_min: float = 1.0,
    upper_max: float = 10.0,
    previous: Optional[tuple[float, float]] = None,
    dtype: torch.dtype = torch.float32,
) -> BoundsSolution:
    """L and H from global statistics (no communication); `previous` (default 1 -/+ eps) fills an empty side.

    The bounds come back as 0-d tensors of `dtype`: use the ratios' dtype, so that a bound
    equal to a data point stays equal to it.
    """
    rule = UPPER_RULES.get(upper)
    prev_lo, prev_hi = (1.0 - eps_low, 1.0 + eps_high) if previous is None else (float(previous[0]), float(previous[1]))
    raw_lo = stats.lower_quantile(float(targets.alpha))
    lo = min(max(_finite_or(raw_lo, prev_lo), lower_min), lower_max)
    raw_hi = rule(stats, lo, targets, eps_low, eps_high) if stats.num_pos > 0 else None
    hi = min(max(_finite_or(raw_hi, prev_hi), upper_min), upper_max)
    c_minus = stats.neg_mass_from(lo)
    rho_achieved = stats.pos_mass_to(hi) / c_minus if c_minus > 0 else math.nan
    alpha_achieved = stats.neg_count_below(lo) / stats.num_neg if stats.num_neg > 0 else math.nan
    as_t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    return BoundsSolution(as_t(lo), as_t(hi), raw_lo is not None, raw_hi is not None, rho_achieved, alpha_achieved)


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
    lower_max: float = 1.0,
    upper_min: float = 1.0,
    upper_max: float = 10.0,
    previous: Optional[tuple[float, float]] = None,
    max_samples_per_rank: int = 65536,
    hist_spec: HistSpec = HistSpec(),
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d (lower, upper) in the ratios' dtype for the FP8 ratios at `targets`, global over `group` (see module docstring)."""
    stats = gather_ratio_stats(
        ratio, adv, group=group, backend=backend, max_samples_per_rank=max_samples_per_rank, hist_spec=hist_spec, generator=generator
    )
    sol = solve_bounds(
        stats, targets, eps_low=eps_low, eps_high=eps_high, upper=upper, lower_min=lower_min,
        lower_max=lower_max, upper_min=upper_min, upper_max=upper_max, previous=previous,
        dtype=ratio.dtype if ratio.is_floating_point() else torch.float32,
    )
    return sol.lower, sol.upper


def calibration_bytes(backend: str, *, world_size: int, tokens_per_rank: int, max_samples_per_rank: int = 65536, hist_spec: HistSpec = HistSpec()) -> int:
    """Bytes one rank receives per `calibrate_bounds` call (ring algorithms) for `backend`."""
    _check_backend(backend)
    if backend == "histogram":
        return collectives.all_reduce_bytes(world_size, hist_spec.numel, 8)
    rows = min(tokens_per_rank, max_samples_per_rank)
    return collectives.all_gather_bytes(world_size, rows, 3 * 8)


def reference_bytes(world_size: int) -> int:
    """Bytes one rank receives per `reference_targets` call (all-reduce of 5 float64)."""
    return collectives.all_reduce_bytes(world_size, 5, 8)
