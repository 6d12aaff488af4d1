"""How close healthy runs come to the health guard's stop signals: replays train.health's defaults (phases/health.py)
over runs' metrics.jsonl and prints, per run, each signal's closest approach and its margin to the threshold.

    python tools/health_margins.py runs/tiny_fp8_grpo runs/tiny_grpo runs/studies/x/runs/*/seed*

A margin above 1 means the signal stayed clear by that factor (for collapse_step_entropy_frac: the smallest
after/before ratio of a step's probe entropy divided by the threshold; max_entropy_frac: the threshold divided by
the largest entropy / ln(vocab)). collapse_reward needs both a reward at the floor (after a step above it) and an
entropy below collapse_entropy_frac of the run's highest: both closest approaches are printed. Runs logged before the probe's
pre-update entropy existed (no health/probe_entropy_before) are measured against entropy_old, the pre-update
entropy of the whole batch rather than of the probe's rows (marked "~"). Exit status 1 when any signal fires.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_rl.config.train import HealthConfig
from megatron_rl.phases.health import HealthGuard
from megatron_rl.tracking import read_metrics


def _finite(row: dict, key: str) -> bool:
    return isinstance(row.get(key), (int, float)) and math.isfinite(row[key])


def margins(rows: list[dict], cfg: HealthConfig, vocab_size: int) -> dict:
    """Closest approach of each default signal over `rows`, and the stops a replay of the guard makes."""
    exact = any(_finite(r, "health/probe_entropy_before") for r in rows)
    before_key = "health/probe_entropy_before" if exact else "entropy_old"
    ratios = [(r["health/probe_entropy"] / r[before_key], r["step"]) for r in rows
              if _finite(r, "health/probe_entropy") and _finite(r, before_key) and r[before_key] > 0]
    guard, stops, reward_gap, entropy_ratio = HealthGuard(cfg, vocab_size, 1), [], math.inf, math.inf
    for r in rows:
        metrics = dict(r)
        if not exact and _finite(r, "entropy_old"):
            metrics["health/probe_entropy_before"] = r["entropy_old"]
        if cfg.collapse_reward is not None and guard.peak_reward > cfg.collapse_reward and _finite(r, "reward/mean"):
            reward_gap = min(reward_gap, r["reward/mean"] - cfg.collapse_reward)  # armed: a reward above the floor was seen
            if _finite(r, "entropy_old") and guard.peak_entropy > 0:
                entropy_ratio = min(entropy_ratio, r["entropy_old"] / guard.peak_entropy)
        stop, condemned, _ = guard._decide(r.get("health/step_skipped", 0.0) == 0.0, metrics, int(r["step"]))
        if stop:
            stops.append(f"condemns version {condemned}+: {stop}")
    fracs = [r["health/entropy_frac"] for r in rows if _finite(r, "health/entropy_frac")]
    ratio, at = min(ratios) if ratios else (math.nan, None)
    return {"steps": len(rows), "exact": exact, "ratio": ratio, "ratio_step": at,
            "max_entropy_frac": max(fracs) if fracs else math.nan, "reward_gap": reward_gap,
            "entropy_ratio": entropy_ratio, "stops": stops}  # a real run stops at the first


def main(argv=None) -> int:
    """Print each run's margins; 1 when any replayed signal fires."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories holding metrics.jsonl")
    p.add_argument("--vocab-size", type=int, default=64, help="embedding rows of the runs' model (ln of it is max entropy)")
    args = p.parse_args(argv)
    cfg = HealthConfig()
    print(f"defaults: collapse_step_entropy_frac={cfg.collapse_step_entropy_frac}; collapse_reward={cfg.collapse_reward} "
          f"with collapse_entropy_frac={cfg.collapse_entropy_frac}; max_entropy_frac={cfg.max_entropy_frac}")
    print(f"{'run':48} {'steps':>5} {'min H after/before':>18} {'margin':>7} {'max H/lnV':>9} {'margin':>7} "
          f"{'min reward-floor':>16} {'min H/max H':>11}  stops")
    fired = False
    for run in args.runs:
        rows = read_metrics(run / "metrics.jsonl")
        if not rows:
            print(f"{str(run):48} no metrics")
            continue
        m = margins(rows, cfg, args.vocab_size)
        fired |= bool(m["stops"])
        ratio = ("" if m["exact"] else "~") + f"{m['ratio']:.3f}"
        print(f"{str(run)[-48:]:48} {m['steps']:5d} {ratio:>12} "
              f"@{m['ratio_step']!s:>4} {m['ratio'] / cfg.collapse_step_entropy_frac:7.1f} {m['max_entropy_frac']:9.3f} "
              f"{cfg.max_entropy_frac / m['max_entropy_frac']:7.1f} {m['reward_gap']:16.3f} {m['entropy_ratio']:11.3f}  "
              f"{m['stops'][0][:200] if m['stops'] else 'none'}")
    return 1 if fired else 0


if __name__ == "__main__":
    sys.exit(main())
