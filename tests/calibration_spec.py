"""An independent implementation of one Calibrated Clipping solve, written from docs/CALIBRATED_CLIPPING.md
(section 2) in plain numpy: it never calls megatron_rl's solver, statistics or collectives.

    sol = spec_solve(ratio, ratio_hp, adv, eps_low=0.2, eps_high=0.2)   # arrays over the pooled token set
    sol.alpha, sol.rho, sol.lower_raw, sol.lower, sol.upper_raw, sol.upper

Definitions used (N = {A < 0}, P = {A > 0}; A = 0 tokens belong to neither):
- alpha = |{t in N : r_hp < 1 - eps_low}| / |N|;
- rho = C+_hp(1 + eps_high) / C-_hp(1 - eps_low), C+(H) = sum_{P, r <= H} A r, C-(L) = sum_{N, r >= L} |A| r,
  summed exactly (rational arithmetic), so "C+(H) / C-(L) >= rho" is decided without rounding;
- L_raw = the k-th smallest FP8 negative ratio, k = floor(alpha |N|) + 1 = n_below + 1 (counted exactly: the
  FP8 and high-precision ratios describe the same tokens, so |N| is the same count); when k > |N| no
  ratio qualifies and L_raw lies just above the largest (the project's documented convention: * (1 + 1e-6));
  with targets held from an earlier event (per_step's ordinary steps), or high-precision ratios for only part
  of the tokens (shadow_fraction < 1), k = floor(alpha |N| + 1e-6) + 1;
- quantile="next_tokens" (per_step: the bounds are for the next step's tokens): L_raw = the type-6 quantile,
  position h = alpha (|N| + 1) on the sorted negative ratios; h within 1e-6 of an integer k gives the k-th
  smallest, otherwise log L_raw is linear between the floor(h)-th and the next; h < 1 gives 0 (below every
  ratio), raised to the smallest negative ratio, h > |N| the largest ratio * (1 + 1e-6);
- guard rails in the documented order: clamp L to [lower_min, lower_max], relax_only L <= 1 - eps_low;
  H_raw = the smallest H >= 1 (1 or a positive FP8 ratio) with C+_fp8(H) >= rho * C-_fp8(L) * (1 - 1e-9) (the
  project's documented relative tolerance for summation order), the largest positive ratio when no H reaches it; clamp H to [upper_min, upper_max], relax_only H >= 1 + eps_high;
- bounds are reported in float32, the precision the loss compares ratios in.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple, Optional

import numpy as np


class SpecSolution(NamedTuple):
    """The unsmoothed solution of one calibration event."""

    alpha: float
    rho: float
    lower_raw: float
    lower: float
    upper_raw: float
    upper: float


_MASS_RTOL = Fraction(1, 10**9)
"""C+ reaches its target within this relative tolerance (megatron_rl/algo/ratio_stats.py documents the same)."""


def _f32(x: float) -> float:
    return float(np.float32(x))


def _exact_sum(a: np.ndarray, r: np.ndarray) -> Fraction:
    """sum(a * r) in exact rational arithmetic over the float64 values."""
    return sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a, r)), Fraction(0))


def _type6(negs: np.ndarray, alpha: float) -> float:
    """The type-6 quantile of sorted `negs` at alpha (module docstring, quantile="next_tokens")."""
    n = negs.size
    h = alpha * (n + 1)
    if h < 1 - 1e-6:
        return 0.0
    if h > n + 1e-6:
        return float(negs[-1]) * (1.0 + 1e-6)
    k = int(math.floor(h + 1e-6))
    t = h - k
    if abs(t) <= 1e-6:
        return float(negs[k - 1])
    lo, hi = float(negs[k - 1]), float(negs[k])
    return math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))


def spec_solve(ratio: np.ndarray, ratio_hp: Optional[np.ndarray], adv: np.ndarray, *, eps_low: float, eps_high: float,
               lower_min: float = 0.05, lower_max: float = 1.0, upper_min: float = 1.0, upper_max: float = 10.0,
               relax_only: bool = True, previous: Optional[tuple[float, float]] = None,
               targets: Optional[tuple[float, float]] = None, quantile: str = "same_tokens") -> SpecSolution:
    """alpha, rho, L and H of one pooled token set, from the spec: targets from `ratio_hp` (nan where a token has
    none), or `targets` = (alpha, rho) held from an earlier event when no token has one."""
    ratio, adv = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (ratio, adv))
    hp = np.full_like(ratio, np.nan) if ratio_hp is None else np.asarray(ratio_hp, dtype=np.float64).reshape(-1)
    neg, pos = adv < 0, adv > 0
    lo_ref, hi_ref = 1.0 - eps_low, 1.0 + eps_high
    prev_lo, prev_hi = previous if previous is not None else (lo_ref, hi_ref)
    n_neg = int(neg.sum())
    known = np.isfinite(hp)
    if known.any() or targets is None:
        n_ref = int((neg & known).sum())
        n_below = int((hp[neg & known] < lo_ref).sum())
        alpha = n_below / n_ref if n_ref else 0.0
        # masses are summed exactly (Fractions of the float64 values): "C+ >= rho C-" is decided without rounding,
        # so a tie (the same data in both passes) is a tie whatever the summation order
        c_plus_hp = _exact_sum(adv[pos & known & (hp <= hi_ref)], hp[pos & known & (hp <= hi_ref)])
        c_minus_hp = _exact_sum(-adv[neg & known & (hp >= lo_ref)], hp[neg & known & (hp >= lo_ref)])
        if c_minus_hp > 0:
            rho = float(c_plus_hp / c_minus_hp)
        else:
            rho = math.inf if c_plus_hp > 0 else 0.0
        same_tokens = bool(known[neg].all())
    else:
        alpha, rho = float(targets[0]), float(targets[1])
        c_plus_hp, c_minus_hp = (Fraction(rho), Fraction(1)) if math.isfinite(rho) else (Fraction(1), Fraction(0))
        n_below, same_tokens = None, False

    negs = np.sort(ratio[neg])
    if n_neg == 0:
        lower_raw, lower = math.nan, prev_lo
    else:
        if quantile == "next_tokens":
            lower_raw = max(_type6(negs, alpha), float(negs[0]))
        else:
            k = n_below + 1 if same_tokens else int(math.floor(alpha * n_neg + 1e-6)) + 1
            lower_raw = float(negs[k - 1]) if k <= n_neg else float(negs[-1]) * (1.0 + 1e-6)
        lower = lower_raw
    lower = min(max(lower, lower_min), lower_max)
    if relax_only:
        lower = min(lower, lo_ref)
    lower = _f32(lower)

    c_minus = _exact_sum(-adv[neg & (ratio >= lower)], ratio[neg & (ratio >= lower)])
    upper_raw = math.nan
    if pos.any() and c_minus > 0:
        # smallest H in {1} u {positive ratios > 1} with C+(H) / C-(L) >= rho, i.e. C+(H) C-_hp >= C+_hp C-(L)
        order = np.argsort(ratio[pos], kind="stable")
        pr, pa = ratio[pos][order], adv[pos][order]
        cum, i = Fraction(0), 0
        for h in [1.0] + sorted({float(x) for x in pr if x > 1.0}):
            while i < len(pr) and pr[i] <= h:
                cum += Fraction(float(pa[i])) * Fraction(float(pr[i]))
                i += 1
            if c_minus_hp > 0:
                reached = cum * c_minus_hp >= c_plus_hp * c_minus * (1 - _MASS_RTOL)
            else:
                reached = c_plus_hp == 0  # rho = 0 is reached at once, rho = inf never
            if reached:
                upper_raw = h
                break
        else:
            upper_raw = max(1.0, float(pr.max()))
    upper = prev_hi if math.isnan(upper_raw) else upper_raw
    upper = min(max(upper, upper_min), upper_max)
    if relax_only:
        upper = max(upper, hi_ref)
    return SpecSolution(alpha, rho, lower_raw, lower, upper_raw, _f32(upper))


def load_dumps(run_dir, step: int) -> tuple[int, dict[str, np.ndarray]]:
    """(number of rank files, their arrays concatenated) of `step`'s ratio dumps under run_dir/calibration."""
    from pathlib import Path

    files = sorted((Path(run_dir) / "calibration").glob(f"step_{step:06d}.rank*.npz"))
    parts = [dict(np.load(f)) for f in files]
    keys = ("ratio", "ratio_hp", "adv", "minibatch")
    return len(files), {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in keys}


def held_targets(sol: SpecSolution, n_neg: int, n_pos: int,
                 previous: Optional[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, rho) held after an event (spec section 2.4: a side with no tokens says nothing, so its target is kept).

    alpha needs negative tokens; rho needs both signs. The first event has nothing to keep and holds what it found.
    """
    if previous is None:
        return sol.alpha, sol.rho
    return (sol.alpha if n_neg else previous[0]), (sol.rho if n_neg and n_pos else previous[1])


def _same(logged, want: float, rel_tol: float = 0.0) -> bool:
    """A logged metric equals the spec's value (metrics.jsonl logs nan and inf as null; in memory they stay floats)."""
    if not math.isfinite(want):
        return logged is None or (isinstance(logged, float) and (logged == want or math.isnan(logged) and math.isnan(want)))
    return logged is not None and (logged == want or math.isclose(logged, want, rel_tol=rel_tol, abs_tol=0.0))


def check_run_dumps(run_dir, rows: list[dict], *, ranks: int, eps_low: float, eps_high: float, hist_width: float = 0.0,
                    quantile: str = "same_tokens", **clamps) -> list[int]:
    """Recompute every dumped step's solve with `spec_solve` and compare with its metrics row; returns the checked steps.

    Every dumped step is checked, whichever advantage signs its token set holds. A step whose dumps hold
    high-precision ratios is a calibration event: its targets come from those rows, except that a side with no
    tokens among them keeps the previous target (`held_targets`), and then its bounds are solved at the held
    targets. A dumped step without any (per_step's ordinary steps) solves at the targets the previous row held.
    `quantile` is the run's (next_tokens under per_step). Exact for the allgather backend. For the histogram
    backend pass its bin width (in log r): alpha and rho are still exact (their sums are), L must lie within one
    bin of the spec's L_raw, and H is only checked to respect the guard rails (it comes from the histogram's own
    C+ at its own L).
    """
    checked = []
    previous = (1.0 - eps_low, 1.0 + eps_high)
    held: Optional[tuple[float, float]] = None
    for row in rows:
        n_files, d = load_dumps(run_dir, row["step"])
        if not n_files:
            previous, held = (row["calib/lower"], row["calib/upper"]), _held_of(row, held)
            continue
        step = row["step"]
        assert n_files == ranks, f"step {step}: {n_files} dump files, expected one per DP x CP rank ({ranks})"
        assert d["ratio"].dtype == np.float64 and d["minibatch"].dtype == np.int64
        assert (d["minibatch"] > 0).all(), "the on-policy first update never feeds a solve"
        known = np.isfinite(d["ratio_hp"])
        event = bool(known.any())
        assert event or held is not None, f"step {step}: an ordinary step's solve before any targets"
        kw = dict(eps_low=eps_low, eps_high=eps_high, previous=previous, quantile=quantile, **clamps)
        n_neg, n_pos = int((d["adv"] < 0).sum()), int((d["adv"] > 0).sum())
        where = f"step {step} (|N|={n_neg}, |P|={n_pos}, {'event' if event else 'held targets'})"
        if event:
            want = spec_solve(d["ratio"], d["ratio_hp"], d["adv"], **kw)
            n_neg_hp, n_pos_hp = int((known & (d["adv"] < 0)).sum()), int((known & (d["adv"] > 0)).sum())
            targets = held_targets(want, n_neg_hp, n_pos_hp, held)
            if targets != (want.alpha, want.rho):
                # a side kept its old target: the bounds are solved at the held ones
                want = spec_solve(d["ratio"], None, d["adv"], targets=targets, **kw)
        else:
            targets = held
            want = spec_solve(d["ratio"], None, d["adv"], targets=targets, **kw)
        alpha, rho = targets
        assert _same(row["calib/alpha_target"], alpha), (where, row["calib/alpha_target"], alpha)
        assert _same(row["calib/rho_target"], rho, rel_tol=1e-9), (where, row["calib/rho_target"], rho)
        if hist_width:
            if n_neg and want.lower_raw == 0.0:
                assert row["calib/solve_lower_raw"] == 0.0, (where, row["calib/solve_lower_raw"])
            elif n_neg:
                assert abs(math.log(row["calib/solve_lower_raw"]) - math.log(want.lower_raw)) <= hist_width * 1.001, \
                    (where, row["calib/solve_lower_raw"], want.lower_raw)
            else:
                assert row["calib/solve_lower"] == want.lower, (where, row["calib/solve_lower"], want.lower)
            assert clamps.get("upper_min", 1.0) <= row["calib/solve_upper"] <= clamps.get("upper_max", 10.0)
        else:
            assert row["calib/solve_lower"] == want.lower, (where, row["calib/solve_lower"], want.lower)
            assert _same(row["calib/solve_lower_raw"], want.lower_raw), (where, row["calib/solve_lower_raw"], want.lower_raw)
            assert row["calib/solve_upper"] == want.upper, (where, row["calib/solve_upper"], want.upper)
            assert _same(row["calib/solve_upper_raw"], want.upper_raw), (where, row["calib/solve_upper_raw"], want.upper_raw)
        checked.append(step)
        previous, held = (row["calib/lower"], row["calib/upper"]), _held_of(row, held)
    return checked


def _held_of(row: dict, held: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """The (alpha, rho) targets a metrics row holds (None before the first event; a null rho was logged for inf)."""
    alpha, rho = row.get("calib/alpha_target"), row.get("calib/rho_target")
    if alpha is None or (isinstance(alpha, float) and math.isnan(alpha)):
        return held
    return float(alpha), math.inf if rho is None else float(rho)
