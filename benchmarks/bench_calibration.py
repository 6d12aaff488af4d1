"""Calibrated vs plain loss: time per micro-batch and bytes exchanged per rank, side by side.

    python benchmarks/bench_calibration.py [--tokens 4096 8192 16384 32768] [--reps 5] [--world 8 64]

Times one micro-batch of the learner's loss (forward + backward of policy_objective on [B, S]
log-probs) with the uncalibrated bounds, and with the calibration tap of an event step (the
micro-batch's tokens added to the step's `RatioStats`, each backend), plus the once-per-event
solve over that many tokens (single process, so the time is the local statistics work, not the
network). Bytes are what one rank receives per solve's statistics collective (ring algorithms)
for a group of `--world` ranks.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# runnable from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.algo.aggregation import count_tokens_and_seqs, token_weights
from megatron_rl.algo.calibration import calibration_bytes, flatten_valid, reference_bytes
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.objective import default_bounds, policy_objective
from megatron_rl.algo.ratio_stats import HistSpec
from megatron_rl.config.algo import AlgoConfig, CalibrationConfig

SEQ = 1024


def _batch(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = max(tokens // SEQ, 1)
    old = -torch.rand(b, SEQ, generator=g) * 3
    lp = old + torch.randn(b, SEQ, generator=g) * 0.2
    adv = torch.randn(b, 1, generator=g).expand(b, SEQ).contiguous()
    mask = torch.ones(b, SEQ)
    r_hp = torch.exp(torch.randn(b * SEQ, generator=g) * 0.15)
    return lp, old, adv, mask, r_hp


def _time_interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median CPU seconds per call of each function, timed round-robin so machine noise hits all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            # process CPU time: on a shared, loaded box wall time mostly measures the other jobs
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    # the median resists the other jobs sharing a small CPU
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def bench(tokens: int, reps: int, cfg: AlgoConfig) -> dict[str, float]:
    """Seconds per micro-batch: plain, and calibrated with each backend."""
    lp, old, adv, mask, r_hp = _batch(tokens)
    t, s = count_tokens_and_seqs(mask)
    w = token_weights(mask, cfg.policy_loss.agg_mode, t, s)

    def step(bounds):
        """One micro-batch: loss forward and backward at `bounds`."""
        x = lp.clone().requires_grad_(True)
        loss, _ = policy_objective(x, old, adv, w, mask, bounds, cfg=cfg)
        loss.backward()

    fns = {"plain": lambda: step(default_bounds(cfg))}
    ratio, a = flatten_valid(torch.exp(lp - old), adv, mask)
    for backend in ("allgather", "histogram"):
        ccfg = CalibrationConfig(enabled=True, backend=backend)
        clip = CalibratedClipper(ccfg, eps_low=cfg.policy_loss.eps_low, eps_high=cfg.policy_loss.eps_high)

        def calibrated(clip=clip):
            """The micro-batch at the held bounds, its tokens added to the step's statistics (what the loss does on an event)."""
            stats = clip.new_stats(reference=True)
            r, av = flatten_valid(torch.exp(lp - old), adv, mask)
            stats.add(r, av, ratio_hp=r_hp)
            step(clip.bounds())

        def solve(clip=clip):
            """The once-per-event solve over this many pooled tokens (single process: no network)."""
            stats = clip.new_stats(reference=True)
            stats.add(ratio, a, ratio_hp=r_hp)
            clip.solve(stats)

        fns[backend] = calibrated
        fns[f"{backend}_solve"] = solve
    out = _time_interleaved(fns, reps)
    return out


def main() -> None:
    """Parse arguments, run, print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--world", type=int, nargs="+", default=[8, 64])
    args = ap.parse_args()
    cfg = AlgoConfig()
    spec = HistSpec()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU time per micro-batch forward+backward of the loss")
    print("calibrated = the loss plus adding its tokens to the step's statistics; solve = one pooled solve over that many tokens")
    print(f"{'tokens':>8} {'plain ms':>10} {'allgather ms':>13} {'x plain':>8} {'histogram ms':>13} {'x plain':>8}"
          f" {'ag solve ms':>12} {'hist solve ms':>14}")
    for n in args.tokens:
        r = bench(n, args.reps, cfg)
        print(
            f"{n:>8} {r['plain'] * 1e3:>10.2f} {r['allgather'] * 1e3:>13.2f} {r['allgather'] / r['plain']:>8.2f}"
            f" {r['histogram'] * 1e3:>13.2f} {r['histogram'] / r['plain']:>8.2f}"
            f" {r['allgather_solve'] * 1e3:>12.2f} {r['histogram_solve'] * 1e3:>14.2f}"
        )
    print("\nbytes received per rank per solve of `tokens/rank` pooled tokens (statistics collective; the "
          f"high-precision sums add {reference_bytes(8)} B at world 8 on calibration events)")
    print(f"{'world':>6} {'tokens/rank':>12} {'allgather B':>14} {'histogram B':>12} {'allgather/histogram':>20}")
    for world in args.world:
        for n in args.tokens:
            ag = calibration_bytes("allgather", world_size=world, tokens_per_rank=n)
            hi = calibration_bytes("histogram", world_size=world, tokens_per_rank=n, hist_spec=spec)
            print(f"{world:>6} {n:>12} {ag:>14,} {hi:>12,} {ag / hi:>20.2f}")


if __name__ == "__main__":
    main()
