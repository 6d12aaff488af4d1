"""Sufficient statistics of (ratio, advantage) pairs for the Calibrated Clipping solvers.

Two representations with the same query interface, one per distributed backend:
- `SampleStats`: the (gathered) pairs themselves, sorted, each with a count weight
  (1 unless the all-gather subsampled its rank). Exact.
- `HistStats`: counts and |A|*r mass in fixed bins over log r (plus under/overflow), for
  N = {A < 0} and P = {A > 0}. Within one bin width.

In the terms of docs/CALIBRATED_CLIPPING.md (section 2), on the solve's token set T with
N = {t : A_t < 0}, P = {t : A_t > 0} (tokens with A_t = 0 belong to neither):
- `lower_quantile(alpha)` is L = Quantile_alpha({r_t : t in N}), defined as the k-th order
  statistic x_(k) of the negative ratios (ascending, 1-based) with k = floor(alpha * |N|) + 1;
  so exactly floor(alpha * |N|) negative ratios lie strictly below L when they are distinct
  (with ties at L, fewer). alpha * |N| within 1e-6 of an integer c counts as c (alpha is itself a
  ratio of counts, n_below / |N|, and must give k = n_below + 1 on the same token set despite
  float rounding). With weights (subsampled ranks), k generalises to the first sample whose
  cumulative weight exceeds alpha * |N|. When k > |N| (alpha = 1) L is the largest negative
  ratio times (1 + 1e-6), so every negative token lies below it. The histogram returns the lower
  edge of the bin holding x_(k) (never more tokens below, |log L - log x_(k)| < bin width).
- `predictive_lower_quantile(alpha)` is the bound for tokens the statistics did not see (the next
  step's, under `bounds_update: per_step`): the k-th order statistic of n draws covers, in
  expectation, k / (n + 1) of their distribution, so x_(k) applied to new tokens clips
  k / (n + 1) of them, not (k - 1) / n. It returns the value at position h = alpha (n + 1) on the
  sorted ratios (Hyndman and Fan's type 6), linear in log r between x_(floor h) and x_(floor h + 1)
  (h within 1e-6 of an integer k gives x_(k) itself): in expectation a fraction alpha of new tokens
  from the same distribution lies below it. h < 1 gives 0 (below every ratio: the caller's lower
  clamp), h > n the largest ratio times (1 + 1e-6). With weights, positions are cumulative weights
  and n is the total weight. The histogram reads each
  token as the lower edge of its bin and interpolates between them in log r.
- `neg_mass_from(L)` = C-(L) = sum_{t in N, r_t >= L} |A_t| r_t;
  `pos_mass_to(H)` = C+(H) = sum_{t in P, r_t <= H} A_t r_t.
- `smallest_upper(target)`: the smallest H >= 1 with C+(H) >= target (H is 1 or a positive
  ratio; a relative tolerance of 1e-9 absorbs summation order); when unreachable, the largest
  positive ratio (all positive tokens active). The histogram returns the upper edge of the bin
  where C+ crosses the target.

Every tensor created here takes the device of the data, so the solve runs where the gathered
statistics live (CPU or GPU); only a handful of scalars cross to the host per query.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# cum counts compare against alpha*|N| + this, so alpha*|N| that should be an integer c but
# rounds to c - 1e-13 still selects x_(c+1)
_COUNT_TOL = 1e-6
# cumulative masses compare against target * (1 - this): the same data summed in another
# order (a reference pass, an all-reduce) must still reach its own target
_MASS_RTOL = 1e-9


def _split(ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if ratio.shape != adv.shape or ratio.dim() != 1:
        raise ValueError(f"ratio and adv must be 1-D of equal length, got {tuple(ratio.shape)} and {tuple(adv.shape)}")
    return adv < 0, adv > 0


@dataclass
class _Side:
    """One advantage sign: sorted ratios, their count weights, cumulative weights and masses."""

    r: torch.Tensor
    cum_w: torch.Tensor
    cum_m: torch.Tensor

    @classmethod
    def build(cls, r: torch.Tensor, absadv: torch.Tensor, w: torch.Tensor) -> "_Side":
        """Sort by ratio (stable, so equal data in equal order gives bit-equal sums)."""
        r64, order = r.to(torch.float64).sort(stable=True)
        w = w.to(torch.float64)[order]
        m = absadv.to(torch.float64)[order] * r64 * w
        return cls(r64, w.cumsum(0), m.cumsum(0))

    def scalar(self, x: float) -> torch.Tensor:
        """A 0-d float64 query value on this side's device."""
        return torch.tensor(x, dtype=torch.float64, device=self.r.device)

    @property
    def count(self) -> float:
        """Weighted number of tokens."""
        return float(self.cum_w[-1]) if self.r.numel() else 0.0

    @property
    def mass(self) -> float:
        """Total |A| r mass."""
        return float(self.cum_m[-1]) if self.r.numel() else 0.0


class SampleStats:
    """Exact statistics from explicit (ratio, advantage, weight) samples."""

    def __init__(self, ratio: torch.Tensor, adv: torch.Tensor, weight: Optional[torch.Tensor] = None) -> None:
        """Split by advantage sign and sort; `weight` = how many tokens each sample stands for (default 1)."""
        neg, pos = _split(ratio, adv)
        w = torch.ones_like(ratio, dtype=torch.float64) if weight is None else weight.to(torch.float64)
        self.neg = _Side.build(ratio[neg], adv[neg].abs(), w[neg])
        self.pos = _Side.build(ratio[pos], adv[pos], w[pos])

    @property
    def num_neg(self) -> float:
        """|N| (weighted)."""
        return self.neg.count

    @property
    def num_pos(self) -> float:
        """|P| (weighted)."""
        return self.pos.count

    def lower_quantile(self, alpha: float) -> Optional[float]:
        """L as defined in the module docstring; None when N is empty."""
        if not self.neg.r.numel():
            return None
        thr = torch.tensor(alpha * self.neg.count + _COUNT_TOL, dtype=torch.float64, device=self.neg.r.device)
        k = int(torch.searchsorted(self.neg.cum_w, thr, right=True))
        if k >= self.neg.r.numel():
            # 1e-6 relative survives a cast to float32 (whose spacing is 1.2e-7 relative)
            return float(self.neg.r[-1]) * (1.0 + 1e-6)
        return float(self.neg.r[k])

    def predictive_lower_quantile(self, alpha: float) -> Optional[float]:
        """The type-6 alpha-quantile for unseen tokens (module docstring); None when N is empty."""
        side = self.neg
        if not side.r.numel():
            return None
        h = alpha * (side.count + 1.0)
        return _interpolate(side.cum_w, side.r, h)

    def neg_mass_from(self, lower: float) -> float:
        """C-(L) = sum over N with r >= L of |A| r."""
        if not self.neg.r.numel():
            return 0.0
        i = int(torch.searchsorted(self.neg.r, self.neg.scalar(lower), right=False))
        return self.neg.mass - (float(self.neg.cum_m[i - 1]) if i > 0 else 0.0)

    def pos_mass_to(self, upper: float) -> float:
        """C+(H) = sum over P with r <= H of A r."""
        i = int(torch.searchsorted(self.pos.r, self.pos.scalar(upper), right=True))
        return float(self.pos.cum_m[i - 1]) if i > 0 else 0.0

    def neg_count_below(self, x: float) -> float:
        """Weighted count of N with r < x."""
        i = int(torch.searchsorted(self.neg.r, self.neg.scalar(x), right=False))
        return float(self.neg.cum_w[i - 1]) if i > 0 else 0.0

    def smallest_upper(self, target: float) -> Optional[float]:
        """Smallest H >= 1 with C+(H) >= target; the largest positive ratio when unreachable; None when P is empty."""
        if not self.pos.r.numel():
            return None
        goal = target * (1.0 - _MASS_RTOL)
        if self.pos_mass_to(1.0) >= goal:
            return 1.0
        j = int(torch.searchsorted(self.pos.cum_m, self.pos.scalar(goal), right=False))
        if j >= self.pos.r.numel():
            return max(1.0, float(self.pos.r[-1]))
        return max(1.0, float(self.pos.r[j]))


def _interpolate(cum_w: torch.Tensor, r: torch.Tensor, h: float) -> float:
    """The ratio at cumulative weight `h` on sorted ratios `r` (cum_w[i]: weight up to and including r[i]): a sample's
    own ratio when h is its position (within 1e-6), linear in log r between two samples; 0 below the first position
    (h < 1 for unit weights), just above the largest ratio past the total weight."""
    if h < min(float(cum_w[0]), 1.0) - _COUNT_TOL:
        return 0.0
    if h > float(cum_w[-1]) + _COUNT_TOL:
        return float(r[-1]) * (1.0 + 1e-6)
    j = int(torch.searchsorted(cum_w, torch.tensor(h - _COUNT_TOL, dtype=cum_w.dtype, device=cum_w.device), right=False))
    j = min(j, r.numel() - 1)
    c1 = float(cum_w[j])
    if j == 0 or c1 <= h + _COUNT_TOL:
        return float(r[j])
    c0, r0, r1 = float(cum_w[j - 1]), float(r[j - 1]), float(r[j])
    t = (h - c0) / (c1 - c0)
    if r0 <= 0.0:
        return r0 + t * (r1 - r0)
    return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))


@dataclass(frozen=True)
class HistSpec:
    """Bin layout over log r: `bins` equal bins on [log_min, log_max] plus underflow and overflow."""

    bins: int = 8192
    """Number of regular bins."""
    log_min: float = -4.0
    """Lower edge of the binned log-ratio range."""
    log_max: float = 4.0
    """Upper edge of the binned log-ratio range."""

    @property
    def width(self) -> float:
        """Bin width in log r."""
        return (self.log_max - self.log_min) / self.bins

    @property
    def numel(self) -> int:
        """Floats in one all-reduce buffer: counts and mass for N and P, bins + 2 each."""
        return 4 * (self.bins + 2)

    def index(self, ratio: torch.Tensor) -> torch.Tensor:
        """Bin index of each ratio: 0 underflow, 1..bins regular, bins + 1 overflow."""
        # clamp so 0 and inf land in the under/overflow bins instead of casting inf to int64
        lr = torch.log(ratio.to(torch.float64)).clamp(-1e4, 1e4)
        idx = torch.floor((lr - self.log_min) / self.width).to(torch.int64) + 1
        return idx.clamp(0, self.bins + 1)


def local_histogram(ratio: torch.Tensor, adv: torch.Tensor, spec: HistSpec, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's [4, bins + 2] float64 buffer (on the data's device): rows = N counts, N |A| r mass, P counts, P A r mass
    (each token counted `weight` times when given)."""
    neg, pos = _split(ratio, adv)
    mass = adv.to(torch.float64).abs() * ratio.to(torch.float64)
    idx = spec.index(ratio)
    rows = []
    # masked weights instead of boolean indexing: no data-dependent shapes, no host sync
    for sel in (neg, pos):
        w = sel.to(torch.float64) if weight is None else sel.to(torch.float64) * weight.to(torch.float64)
        for values in (w, w * mass):
            rows.append(torch.zeros(spec.bins + 2, dtype=torch.float64, device=ratio.device).index_add_(0, idx, values))
    return torch.stack(rows)


class HistStats:
    """Statistics from a (globally summed) histogram buffer of `local_histogram` layout."""

    def __init__(self, hist: torch.Tensor, spec: HistSpec) -> None:
        """Wrap a [4, bins + 2] buffer."""
        self.spec = spec
        self.h = hist.to(torch.float64).reshape(4, spec.bins + 2)
        self.cum = self.h.cumsum(dim=1)

    @property
    def num_neg(self) -> float:
        """|N|."""
        return float(self.cum[0, -1])

    @property
    def num_pos(self) -> float:
        """|P|."""
        return float(self.cum[2, -1])

    def _log_edge(self, b: int) -> float:
        """Lower edge (log r) of bin b; the underflow bin reports log_min, the overflow bin log_max."""
        s = self.spec
        return s.log_min + min(max(b - 1, 0), s.bins) * s.width

    def _cum_at(self, row: int, log_x: float) -> float:
        """Row total over tokens with log r <= log_x, linear inside a bin; under/overflow sit at the range ends."""
        s = self.spec
        if log_x < s.log_min:
            return 0.0
        if log_x >= s.log_max:
            return float(self.cum[row, -1])
        p = (log_x - s.log_min) / s.width
        i = min(int(math.floor(p)), s.bins - 1)
        return float(self.cum[row, i]) + (p - i) * float(self.h[row, i + 1])

    def lower_quantile(self, alpha: float) -> Optional[float]:
        """Lower edge of the bin holding x_(k) (see module docstring); None when N is empty."""
        if self.num_neg <= 0:
            return None
        thr = torch.tensor(alpha * self.num_neg + _COUNT_TOL, dtype=torch.float64, device=self.cum.device)
        b = int(torch.searchsorted(self.cum[0], thr, right=True))
        if b >= self.spec.bins + 2:
            last = int(torch.nonzero(self.h[0]).max())
            return math.exp(self._log_edge(last + 1))
        return math.exp(self._log_edge(b))

    def predictive_lower_quantile(self, alpha: float) -> Optional[float]:
        """The type-6 alpha-quantile for unseen tokens (module docstring); None when N is empty.

        Token k is read as the lower edge of its bin (as `lower_quantile` reads x_(k)), and position h lies between
        tokens floor(h) and floor(h) + 1, linear in log r: within one bin width of the exact samples' answer."""
        n = self.num_neg
        if n <= 0:
            return None
        h = alpha * (n + 1.0)
        if h < 1.0 - _COUNT_TOL:
            return 0.0
        if h > n + _COUNT_TOL:
            return self.lower_quantile(1.0)
        k = max(1.0, math.floor(h + _COUNT_TOL))
        t = min(max(h - k, 0.0), 1.0)
        lo = self._log_edge(self._bin_of_token(k))
        if t <= _COUNT_TOL or k + 1.0 > n + _COUNT_TOL:
            return math.exp(lo)
        return math.exp(lo + t * (self._log_edge(self._bin_of_token(k + 1.0)) - lo))

    def _bin_of_token(self, k: float) -> int:
        """Index of the bin holding the k-th smallest negative ratio (1-based; weighted counts)."""
        thr = torch.tensor(k - _COUNT_TOL, dtype=torch.float64, device=self.cum.device)
        return min(int(torch.searchsorted(self.cum[0], thr, right=False)), self.spec.bins + 1)

    def neg_mass_from(self, lower: float) -> float:
        """C-(L), linear inside L's bin."""
        return float(self.cum[1, -1]) - self._cum_at(1, math.log(lower))

    def pos_mass_to(self, upper: float) -> float:
        """C+(H), linear inside H's bin."""
        return self._cum_at(3, math.log(upper))

    def neg_count_below(self, x: float) -> float:
        """Count of N with r < x, linear inside x's bin."""
        return self._cum_at(0, math.log(x))

    def smallest_upper(self, target: float) -> Optional[float]:
        """Upper edge of the bin where C+ first reaches target (1 if C+(1) does); None when P is empty."""
        if self.num_pos <= 0:
            return None
        goal = target * (1.0 - _MASS_RTOL)
        if self.pos_mass_to(1.0) >= goal:
            return 1.0
        b = int(torch.searchsorted(self.cum[3], torch.tensor(goal, dtype=torch.float64, device=self.cum.device), right=False))
        if b >= self.spec.bins + 2:
            b = int(torch.nonzero(self.h[2]).max())
        return max(1.0, math.exp(self._log_edge(b + 1)))
