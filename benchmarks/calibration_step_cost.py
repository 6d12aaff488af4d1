"""What each calibration costs per RL step of the deep miniature, measured side by side: whole steps (rollout, log-probs,
every update, weight sync) of a frontier study's arms, interleaved round by round so the machine's load hits them alike.

    python benchmarks/calibration_step_cost.py [examples/studies/deep_addtrace_frontier.yaml]
        [--arms fp8_tensorwise fp8_tensorwise_calib_targeted fp8_tensorwise_calib_decision hp_learner_fp8_rollout hp]
        [--steps 12] [--skip 2] [--rounds 3] [--seed 60]

Each round runs every arm (rotated order) as a short `megatron-rl train` from the study's shared warm start (made
first when missing) in a scratch directory, one CPU thread per process like the study's runs. Per arm it prints the
median over rounds of each run's median per step (steps from --skip on: the first steps warm caches) of:
wall seconds (time/step), learner wall seconds (time/logprobs + time/train: where calibration's forwards run), the
trainer process's CPU seconds (cpu/step: learner, weight export and the rollout client; the engines are processes
of their own) and the learner's CPU seconds (cpu/logprobs + cpu/train), and the whole run's CPU seconds with its
engines (getrusage of the finished run: start-up included, the same for every arm), each as a ratio to the first
arm (vanilla FP8 by default), plus the load average before and after. Ratios, not seconds, are the result, CPU
ratios first: wall time moves with the box's load, a single-threaded process's CPU time much less.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
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


MEASURES = ("cpu_step_s", "cpu_learner_s", "run_cpu_s", "step_s", "learner_s")
"""What each run reports (see the module docstring), in the order printed."""


def step_times(metrics: Path, skip: int) -> dict[str, float]:
    """Median wall and CPU seconds per step, whole and learner, over the steps from `skip` on."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", -1) >= skip and isinstance(r.get("time/step"), (int, float))]
    if not rows:
        raise RuntimeError(f"{metrics}: no step at or after {skip} logged a time/step")
    return {"step_s": statistics.median(r["time/step"] for r in rows),
            "learner_s": statistics.median(r.get("time/logprobs", 0.0) + r.get("time/train", 0.0) for r in rows),
            "cpu_step_s": statistics.median(r.get("cpu/step", math.nan) for r in rows),
            "cpu_learner_s": statistics.median(r.get("cpu/logprobs", 0.0) + r.get("cpu/train", 0.0) for r in rows)}


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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
                t0, cpu0 = time.perf_counter(), children_cpu_s()
                proc = subprocess.run(cmd, env=child_env(study, arm), capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{arm} round {rnd} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
                times[arm].append({**step_times(run_dir / "metrics.jsonl", args.skip), "run_cpu_s": children_cpu_s() - cpu0})
                t = times[arm][-1]
                print(f"round {rnd + 1}/{args.rounds} {arm}: cpu {t['cpu_step_s']:.3f} s/step (learner "
                      f"{t['cpu_learner_s']:.3f}), run cpu {t['run_cpu_s']:.0f} s; wall {t['step_s']:.3f} s/step "
                      f"(learner {t['learner_s']:.3f}), run {time.perf_counter() - t0:.0f} s", flush=True)
    load_after = os.getloadavg()
    base = args.arms[0]
    med = {a: {k: statistics.median(t[k] for t in times[a]) for k in MEASURES} for a in args.arms}
    # ratio per round first (the runs of a round saw the same load), then the median over rounds
    ratio = {a: {k: statistics.median(t[k] / b[k] for t, b in zip(times[a], times[base])) for k in MEASURES}
             for a in args.arms}
    print(f"\n{args.spec}: {args.rounds} interleaved rounds of {args.steps} steps (median of steps >= {args.skip}), "
          f"seed {args.seed}, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"seconds (x {base}, the median of the rounds' ratios)")
    heads = {"cpu_step_s": "CPU s/step", "cpu_learner_s": "learner CPU s", "run_cpu_s": "run CPU s (+engines)",
             "step_s": "wall s/step", "learner_s": "learner wall s"}
    print(f"{'arm':>34} " + " ".join(f"{heads[k]:>22}" for k in MEASURES))
    for a in args.arms:
        print(f"{a:>34} " + " ".join(f"{med[a][k]:>12.3f} ({ratio[a][k]:5.3f}x)".rjust(22) for k in MEASURES))
    if any(not math.isfinite(ratio[a][k]) for a in args.arms for k in MEASURES):
        raise SystemExit("a ratio is not finite")


if __name__ == "__main__":
    main()
