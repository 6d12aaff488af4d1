"""Worker for test_calibration_collectives.py: global calibration statistics on gloo ranks.

Each rank takes its (uneven, possibly empty) slice of one deterministic data set, runs the
calibration API with group=WORLD for both backends, and reports the results as JSON.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from dist_report import report
from megatron_rl.algo.calibration import calibrate_bounds, gather_ratio_stats, reference_targets
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.config.algo import CalibrationConfig
from megatron_rl.parallel.collectives import gather_samples

COUNTS = [1300, 0, 751]
EPS_LOW, EPS_HIGH = 0.2, 0.28
CLAMPS = dict(lower_min=1e-3, upper_max=100.0)


def make_data(seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole data set: hp ratios, fp8 ratios (float32) and advantages, concatenated in rank order."""
    g = torch.Generator().manual_seed(seed)
    n = sum(COUNTS)
    r_hp = torch.exp(torch.randn(n, generator=g) * 0.2)
    r_fp8 = r_hp * torch.exp(torch.randn(n, generator=g) * 0.15)
    adv = torch.randn(n, generator=g)
    adv[::17] = 0.0
    return r_hp, r_fp8, adv


def rank_slice(rank: int, world: int) -> slice:
    """This rank's rows; ranks beyond len(COUNTS) get none."""
    counts = (COUNTS + [0] * world)[:world]
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def shadow_mask(rank: int, world: int) -> torch.Tensor:
    """This rank's tokens that carry a high-precision ratio (shadow_fraction < 1: every third token)."""
    return (torch.arange(sum(COUNTS))[rank_slice(rank, world)] % 3) == 0


def per_step_solves(backend: str, r_fp8, r_hp, adv, known, group) -> list[float]:
    """bounds_update: per_step on this rank's tokens: an event (FP8 of every token, targets from the `known` ones, two
    micro-batches), then an ordinary step at the held targets; [L1, H1, alpha, rho, L2, H2] after the two solves."""
    cfg = CalibrationConfig(enabled=True, strength="full", backend=backend, **CLAMPS)
    clip = CalibratedClipper(cfg, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    stats = clip.new_stats(reference=True)
    half = r_fp8.numel() // 2
    for part in (slice(0, half), slice(half, None)):
        stats.add(r_fp8[part], adv[part], ratio_hp=r_hp[part], hp_mask=known[part])
    first = clip.solve(stats, group, smooth=False, quantile="next_tokens")
    ordinary = clip.new_stats()
    ordinary.add(r_fp8 * 0.97, adv)
    second = clip.solve(ordinary, group, smooth=False, quantile="next_tokens")
    out = [first.lower, first.upper, clip.targets.alpha, clip.targets.rho, second.lower, second.upper]
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    r_hp, r_fp8, adv = (x[rank_slice(rank, world)] for x in make_data())
    t = reference_targets(r_hp, adv, eps_low=EPS_LOW, eps_high=EPS_HIGH, group=group)
    out = {"alpha": float(t.alpha), "rho": float(t.rho)}
    for backend in ("allgather", "histogram"):
        lo, hi = calibrate_bounds(r_fp8, adv, t, eps_low=EPS_LOW, eps_high=EPS_HIGH, group=group, backend=backend, **CLAMPS)
        out[backend] = [float(lo), float(hi)]
    stats = gather_ratio_stats(r_fp8, adv, group=group, backend="allgather")
    out["num_neg"], out["num_pos"] = stats.num_neg, stats.num_pos
    rows = torch.stack([r_fp8, adv], dim=1)
    sub, weight = gather_samples(rows, 300, group, torch.Generator().manual_seed(rank))
    out["subsampled_rows"], out["subsampled_weight_sum"] = int(sub.shape[0]), float(weight.sum())
    for backend in ("allgather", "histogram"):
        # one pooled solve: two local "micro-batches" per rank, one reduce over the group
        clip = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", smoothing=0.0, backend=backend, **CLAMPS),
                                 eps_low=EPS_LOW, eps_high=EPS_HIGH)
        stats = clip.new_stats(reference=True)
        half = r_fp8.numel() // 2
        stats.add(r_fp8[:half], adv[:half], ratio_hp=r_hp[:half])
        stats.add(r_fp8[half:], adv[half:], ratio_hp=r_hp[half:])
        sol = clip.solve(stats, group)
        out[f"clipper_{backend}"] = [sol.lower, sol.upper, clip.targets.alpha, clip.targets.rho]
        out[f"per_step_{backend}"] = per_step_solves(backend, r_fp8, r_hp, adv, shadow_mask(rank, world), group)
    report(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
