"""What each calibration costs per RL step of the deep miniature, measured side by side: whole steps (rollout, log-probs,
every update, weight sync) of a frontier study's arms, interleaved round by round so the machine's load hits them alike.

    python benchmarks/calibration_step_cost.py [examples/studies/deep_addtrace_frontier.yaml]
        [--arms fp8_tensorwise fp8_tensorwise_calib_targeted fp8_tensorwise_calib_decision hp_learner_fp8_rollout hp]
        [--steps 12] [--skip 2] [--rounds 3] [--seed 60]

Each round runs every arm (rotated order) as a short `megatron-rl train` from the study's shared warm start (made
first when missing) in a scratch directory, one CPU thread per process like the study's runs. Per arm it prints the
median over rounds of each run's median wall seconds per step (steps from --skip on: the first steps warm caches),
of its learner seconds per step (time/logprobs + time/train: where calibration's forwards run) and its ratio to the
first arm (vanilla FP8 by default), plus the load average before and after. Ratios, not seconds, are the result:
absolute times move with the box's load, ratios between interleaved runs much less.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_ARMS = ("fp8_tensorwise", "fp8_tensorwise_calib_targeted", "fp8_tensorwise_calib_decision",
                "hp_learner_fp8_rollout", "hp")
"""Vanilla FP8 first (the ratios' denominator), then the calibrations, the peers' split and all high precision."""


def run_overrides(study, arm: str, seed: int, steps: int, run_dir: Path, warm: list[str]) -> list[str]:
    """The study run's overrides with this benchmark's steps, seed and scratch directory (no checkpoints on the way)."""
    out = study.run_overrides(arm, seed, warm)
    out = [o for o in out if not o.startswith(("train.steps=", "run_dir=", "checkpoint.save_every="))]
    return [*out, f"train.steps={steps}", f"checkpoint.save_every={steps}", f"run_dir={json.dumps(str(run_dir))}"]


def step_times(metrics: Path, skip: int) -> dict[str, float]:
    """Median wall seconds per step and learner seconds per step over the steps from `skip` on."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", -1) >= skip and isinstance(r.get("time/step"), (int, float))]
    if not rows:
        raise RuntimeError(f"{metrics}: no step at or after {skip} logged a time/step")
    return {"step_s": statistics.median(r["time/step"] for r in rows),
            "learner_s": statistics.median(r.get("time/logprobs", 0.0) + r.get("time/train", 0.0) for r in rows)}


def main() -> None:
    """Interleave the arms' short runs round by round; print medians and ratios to the first arm."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="examples/studies/deep_addtrace_frontier.yaml", help="frontier study spec")
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help="arms of the spec; the first is the denominator")
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of each run's median")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs every arm once)")
    ap.add_argument("--seed", type=int, default=60, help="seed of every run (the same prompts for every arm)")
    args = ap.parse_args()
    if args.skip >= args.steps:
        raise SystemExit(f"--skip {args.skip} must be below --steps {args.steps}")

    from megatron_rl.study import load_study
    from megatron_rl.study.runner import child_env, cli_command, prepare_warm_start

    study = load_study(ROOT / args.spec if not Path(args.spec).is_absolute() else Path(args.spec))
    unknown = [a for a in args.arms if a not in {x.name for x in study.spec.arms}]
    if unknown:
        raise SystemExit(f"{args.spec}: no arm named {', '.join(unknown)}")
    warm = prepare_warm_start(study)
    load_before = os.getloadavg()
    times: dict[str, list[dict[str, float]]] = {a: [] for a in args.arms}
    with tempfile.TemporaryDirectory(prefix="calib_step_cost_") as tmp:
        for rnd in range(args.rounds):
            order = args.arms[rnd % len(args.arms):] + args.arms[:rnd % len(args.arms)]
            for arm in order:
                run_dir = Path(tmp) / f"{arm}_r{rnd}"
                cmd = cli_command(study, "train", run_overrides(study, arm, args.seed, args.steps, run_dir, warm))
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=child_env(study, arm), capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{arm} round {rnd} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
                times[arm].append(step_times(run_dir / "metrics.jsonl", args.skip))
                print(f"round {rnd + 1}/{args.rounds} {arm}: {times[arm][-1]['step_s']:.3f} s/step "
                      f"(learner {times[arm][-1]['learner_s']:.3f}), run {time.perf_counter() - t0:.0f} s", flush=True)
    load_after = os.getloadavg()
    base = args.arms[0]
    med = {a: {k: statistics.median(t[k] for t in times[a]) for k in ("step_s", "learner_s")} for a in args.arms}
    # ratio per round first (the runs of a round saw the same load), then the median over rounds
    ratio = {a: {k: statistics.median(t[k] / b[k] for t, b in zip(times[a], times[base])) for k in ("step_s", "learner_s")}
             for a in args.arms}
    print(f"\n{args.spec}: {args.rounds} interleaved rounds of {args.steps} steps (median of steps >= {args.skip}), "
          f"seed {args.seed}, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"{'arm':>34} {'s/step':>8} {'x ' + base:>22} {'learner s':>10} {'learner x':>10}")
    for a in args.arms:
        print(f"{a:>34} {med[a]['step_s']:>8.3f} {ratio[a]['step_s']:>22.3f} {med[a]['learner_s']:>10.3f} "
              f"{ratio[a]['learner_s']:>10.3f}")
    if any(not math.isfinite(ratio[a]["step_s"]) for a in args.arms):
        raise SystemExit("a ratio is not finite")


if __name__ == "__main__":
    main()
