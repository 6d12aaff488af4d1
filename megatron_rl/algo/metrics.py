"""Loss-side metrics (docs/CALIBRATED_CLIPPING.md, section 4) in "sum form".

Every metric is returned as sums that add up exactly across micro-batches and ranks:
a key "x/num" with its "x/den" is finalised as num / den; a key "hist/..." is a log-ratio
histogram (counts) finalised into quantiles; any other key is a plain sum (e.g. the
aggregated loss terms, already weighted by token_weight). `finalize_metrics` turns summed
dicts into floats.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import torch

from megatron_rl.algo.kl import kl_k3

RATIO_QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)


def _pair(out: dict[str, torch.Tensor], name: str, num: torch.Tensor, den: torch.Tensor) -> None:
    out[f"{name}/num"] = num.detach().to(torch.float64)
    out[f"{name}/den"] = den.detach().to(torch.float64)


def clip_fraction_sums(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """clipfrac_lower_neg (A<0, r<L over A<0), clipfrac_upper_pos (A>0, r>H over A>0), clipfrac (either, over valid tokens)."""
    valid = loss_mask > 0
    neg, pos = valid & (adv < 0), valid & (adv > 0)
    lo, hi = neg & (ratio < lower), pos & (ratio > upper)
    out: dict[str, torch.Tensor] = {}
    _pair(out, f"{prefix}clipfrac_lower_neg", lo.sum(), neg.sum())
    _pair(out, f"{prefix}clipfrac_upper_pos", hi.sum(), pos.sum())
    _pair(out, f"{prefix}clipfrac", (lo | hi).sum(), valid.sum())
    return out


def ratio_histograms(
    ratio: torch.Tensor, adv: torch.Tensor, loss_mask: torch.Tensor, bins: int = 512, log_range: float = 2.0
) -> dict[str, torch.Tensor]:
    """Counts of log r over [-log_range, log_range] in `bins` bins plus under/overflow, for A<0 and A>0 (on the data's device)."""
    valid = loss_mask > 0
    lr = torch.log(ratio.detach().to(torch.float64)).clamp(-1e4, 1e4).reshape(-1)
    width = 2 * log_range / bins
    idx = (torch.floor((lr + log_range) / width).to(torch.int64) + 1).clamp(0, bins + 1)
    out = {}
    for name, sel in (("neg", valid & (adv < 0)), ("pos", valid & (adv > 0))):
        # masked weights instead of boolean indexing: no data-dependent shapes, no host sync
        h = torch.zeros(bins + 2, dtype=torch.float64, device=ratio.device)
        h.index_add_(0, idx, sel.reshape(-1).to(torch.float64))
        out[f"hist/ratio_{name}"] = h
    return out


def quantiles_from_histogram(counts: torch.Tensor, log_range: float, qs: Iterable[float] = RATIO_QUANTILES) -> list[float]:
    """Ratio quantiles from `ratio_histograms` counts: exp of the centre of the bin holding each quantile (nan if empty)."""
    counts = counts.detach().to("cpu", torch.float64)  # a finalised metric: host-side
    total = float(counts.sum())
    bins = counts.numel() - 2
    width = 2 * log_range / bins
    cum = counts.cumsum(0)
    out = []
    for q in qs:
        if total <= 0:
            out.append(math.nan)
            continue
        b = min(int(torch.searchsorted(cum, torch.tensor(q * total, dtype=torch.float64, device=cum.device), right=False)), bins + 1)
        centre = -log_range + (min(max(b, 1), bins) - 0.5) * width
        out.append(math.exp(-log_range) if b == 0 else math.exp(log_range) if b == bins + 1 else math.exp(centre))
    return out


def ratio_quantiles(ratio: torch.Tensor, qs: Iterable[float] = RATIO_QUANTILES) -> list[float]:
    """Exact (interpolated) quantiles of a 1-D ratio tensor; nan when empty (single process)."""
    if ratio.numel() == 0:
        return [math.nan for _ in qs]
    return torch.quantile(ratio.to(torch.float64), torch.tensor(list(qs), dtype=torch.float64, device=ratio.device)).tolist()


def rollout_correction_sums(weight: torch.Tensor, clipped: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """tis_weight_mean and tis_clipfrac (truncated or masked tokens) over valid tokens."""
    valid = loss_mask > 0
    out: dict[str, torch.Tensor] = {}
    _pair(out, "tis_weight_mean", (weight * valid).sum(), valid.sum())
    _pair(out, "tis_clipfrac", (clipped & valid).sum(), valid.sum())
    return out


def mismatch_sums(logp_train: torch.Tensor, logp_rollout: torch.Tensor, loss_mask: torch.Tensor,
                  log_ratio_clamp: float = 20.0) -> dict[str, torch.Tensor]:
    """Train-vs-rollout mismatch: mean |dlogp|, k3 KL(rollout || train), token_mult_prob_error = mean exp|dlogp| (|dlogp| clamped like the loss's log-ratio)."""
    valid = (loss_mask > 0).to(torch.float64)
    d = (logp_train.detach() - logp_rollout.detach()).to(torch.float64) * valid
    n = valid.sum()
    out: dict[str, torch.Tensor] = {}
    _pair(out, "mismatch_abs_dlogp", d.abs().sum(), n)
    _pair(out, "mismatch_k3_kl", (kl_k3(logp_rollout.detach().to(torch.float64), logp_train.detach().to(torch.float64)) * valid).sum(), n)
    _pair(out, "token_mult_prob_error", (torch.exp(d.abs().clamp(max=log_ratio_clamp)) * valid).sum(), n)
    return out


def masked_mean_sums(name: str, values: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A token-mean metric of `values` over the mask, as a num/den pair."""
    valid = (loss_mask > 0).to(torch.float64)
    out: dict[str, torch.Tensor] = {}
    _pair(out, name, (values.detach().to(torch.float64) * valid).sum(), valid.sum())
    return out


def add_sums(total: Optional[dict[str, torch.Tensor]], new: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accumulate one micro-batch's sums into `total` (a new dict when total is None)."""
    out = {} if total is None else total
    for k, v in new.items():
        out[k] = out[k] + v.detach() if k in out else v.detach().clone()
    return out


def finalize_metrics(sums: Mapping[str, torch.Tensor], log_range: float = 2.0) -> dict[str, float]:
    """Turn summed metrics into floats: num/den pairs divide (nan on 0/0), histograms become ratio quantiles."""
    out: dict[str, float] = {}
    for k, v in sums.items():
        if k.endswith("/den"):
            continue
        if k.endswith("/num"):
            name = k[: -len("/num")]
            den = float(sums[f"{name}/den"])
            out[name] = float(v) / den if den > 0 else math.nan
        elif k.startswith("hist/"):
            side = k[len("hist/ratio_"):]
            for q, val in zip(RATIO_QUANTILES, quantiles_from_histogram(v, log_range)):
                out[f"ratio_{side}_q{q * 100:g}"] = val
        else:
            out[k] = float(v)
    return out
