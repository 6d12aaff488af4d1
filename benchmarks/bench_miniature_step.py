"""RL step time of the deep miniature, this tree against an older commit, side by side in one run.

Targets of the step speed-up: the high-precision and FP8 steps each <= 0.5x the old ones, and the FP8
tensorwise step <= 1.5x the high-precision step. For every arm (hp, fp8_tensorwise, nvfp4 by default) it runs the
same short `megatron-rl train` of examples/studies/deep_addtrace_grpo.yaml (same warm start, seed and overrides)
once with this tree's code and once with the baseline commit's (a git worktree, imported first through
PYTHONPATH), interleaved arm by arm and round by round so that the box's load drifts evenly over both. It prints,
per arm: the median `time/step` over the steps after the first two, the run's time outside the steps (start-up,
engine launch and the two held-out greedy evaluations), and the new/old ratios; then FP8 tensorwise / hp per tree.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_miniature_step.py [--baseline 52507c3] [--new HEAD] [--steps 12] [--rounds 1]

With `--baseline none` only this tree runs and the arms are compared with each other instead (each arm's median
step over the first arm's, arms interleaved and their order reversed every other round), e.g. consistent scales
against vanilla FP8 tensorwise:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_miniature_step.py --baseline none \
        --spec examples/studies/deep_addtrace_consistent_scales.yaml --arms fp8_tensorwise fp8_tensorwise_consistent --rounds 2

The warm start is the study's own (outputs/studies/deep_addtrace_grpo/warm_start, or --spec's; made by its SFT when
absent).
Report the load average printed at the end with the ratios: the box is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "studies" / "deep_addtrace_grpo.yaml"
EVAL_PROMPTS = 200
"""Default held-out prompts of each of a run's two greedy evaluations (--eval-prompts; the old code sends one request per prompt)."""


def worktree(ref: str, where: Path) -> Path:
    """A detached git worktree of `ref` at `where` (reused when it already holds that commit)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True, text=True).stdout.strip()
    if (where / ".git").exists():
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        if head == sha:
            return where
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), sha], check=True)
    return where


def run_once(tree: Path, study, arm: str, seed: int, warm: list[str], steps: int, run_dir: Path,
             eval_prompts: int = EVAL_PROMPTS) -> dict:
    """One short training run of `arm` with the code in `tree`; its step times and wall time."""
    from megatron_rl.study.runner import child_env

    env = child_env(study, arm)
    env["PYTHONPATH"] = str(tree)
    overrides = [*study.run_overrides(arm, seed, warm), f"train.steps={steps}", "checkpoint.save_every=0",
                 f"train.eval_max_prompts={eval_prompts}",
                 "checkpoint.resume=false", f"run_dir={json.dumps(str(run_dir))}"]
    base = tree / "examples" / "configs" / study.base.name
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(base), *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{arm} in {tree} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [r["time/step"] for r in rows if "time/step" in r]
    phase_times = {k: [r[k] for r in rows if k in r] for k in ("time/logprobs", "time/train")}
    return {"step_times": step_times, "wall": wall, "phase_times": phase_times}


def reuse_or_make_warm_start(study, prepare) -> list[str]:
    """The study's warm-start overrides: its SFT export when present (whatever code version recorded it; a benchmark
    needs the weights, not the study's config check), else made by the study's own warm start."""
    warm = study.warm_overrides()
    init = [o for o in warm if o.startswith("model.init_checkpoint=")]
    if init and (Path(json.loads(init[0].split("=", 1)[1])) / "model.safetensors").exists():
        return warm
    return prepare(study)


def absolute_warm_start(study) -> list[str]:
    """The study's warm-start overrides with absolute paths (runs start in another working directory)."""
    from megatron_rl.study.runner import prepare_warm_start

    return [o if not o.startswith(("data.", "model.init_checkpoint")) else
            o.split("=", 1)[0] + "=" + json.dumps(str(Path(json.loads(o.split("=", 1)[1])).resolve()))
            for o in reuse_or_make_warm_start(study, prepare_warm_start)]


def compare_arms(args) -> None:
    """--baseline none: the arms of --spec in this tree, interleaved; each arm's median step over the first arm's."""
    from megatron_rl.study import load_study

    os.chdir(ROOT)
    study = load_study(args.spec)
    warm = absolute_warm_start(study)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {arm: [] for arm in args.arms}
    phases: dict[str, dict[str, list[float]]] = {arm: {} for arm in args.arms}
    for rnd in range(args.rounds):
        for arm in (args.arms if rnd % 2 == 0 else list(reversed(args.arms))):
            out = run_once(ROOT, study, arm, args.seed, warm, args.steps, work / f"arm_{arm}_r{rnd}", args.eval_prompts)
            counted = out["step_times"][2:] or out["step_times"]
            times[arm] += counted
            for key, values in out["phase_times"].items():
                phases[arm].setdefault(key, []).extend(values[2:] or values)
            print(f"round {rnd} {arm:28s}: step {statistics.median(counted):.3f} s, run {out['wall']:.1f} s, "
                  f"load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    first = args.arms[0]
    keys = sorted({k for arm in args.arms for k in phases[arm]})
    print(f"\n{'arm':28s} {'step s':>8s} {'/' + first[:12]:>14s}   " + " ".join(f"{k[5:]:>10s}" for k in keys))
    for arm in args.arms:
        med = statistics.median(times[arm])
        cells = " ".join(f"{statistics.median(phases[arm][k]):10.3f}" if phases[arm].get(k) else f"{'':>10s}" for k in keys)
        print(f"{arm:28s} {med:8.3f} {med / statistics.median(times[first]):14.3f}   {cells}")
    print("(median over the steps after the first two of every round; phase columns: median seconds of time/<phase>)")
    print("load average:", " ".join(Path("/proc/loadavg").read_text().split()[:3]))


def main() -> None:
    """Parse flags, run every arm in both trees, print the table of medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="52507c3", help="git ref of the old code (default: before the speed-up)")
    ap.add_argument("--new", default=None, help="git ref of the new code (default: this working tree as it is)")
    ap.add_argument("--arms", nargs="+", default=["hp", "fp8_tensorwise", "nvfp4"], help="arms of the study spec")
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run (the first two are not counted)")
    ap.add_argument("--rounds", type=int, default=1, help="repeats of the whole comparison")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS, help="prompts of each greedy evaluation")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_miniature_step"))
    ap.add_argument("--spec", type=Path, default=SPEC, help="study spec whose arms, warm start and base config are run")
    args = ap.parse_args()
    if args.baseline == "none":
        return compare_arms(args)

    from megatron_rl.study import load_study

    os.chdir(ROOT)  # the spec's output_dir (and so the shared warm start) is relative to the repository root
    study = load_study(args.spec)
    warm = absolute_warm_start(study)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    trees = {"new": worktree(args.new, work / "new_tree") if args.new else ROOT,
             "old": worktree(args.baseline, work / "baseline_tree")}
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for arm in args.arms:
            for label in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                out = run_once(trees[label], study, arm, args.seed, warm, args.steps, work / f"{label}_{arm}_r{rnd}",
                               args.eval_prompts)
                results.setdefault((arm, label), []).append(out)
                counted = out["step_times"][2:] or out["step_times"]
                print(f"round {rnd} {arm:16s} {label}: step {statistics.median(counted):.3f} s, "
                      f"run {out['wall']:.1f} s", flush=True)

    def step_median(arm: str, label: str) -> float:
        return statistics.median(t for r in results[(arm, label)] for t in (r["step_times"][2:] or r["step_times"]))

    def outside(arm: str, label: str) -> float:
        return statistics.median(r["wall"] - sum(r["step_times"]) for r in results[(arm, label)])

    print(f"\n{'arm':16s} {'old step':>9s} {'new step':>9s} {'new/old':>8s}   {'old rest':>9s} {'new rest':>9s} {'new/old':>8s}")
    for arm in args.arms:
        so, sn, ro, rn = step_median(arm, "old"), step_median(arm, "new"), outside(arm, "old"), outside(arm, "new")
        print(f"{arm:16s} {so:9.3f} {sn:9.3f} {sn / so:8.2f}   {ro:9.1f} {rn:9.1f} {rn / ro:8.2f}")
    if "hp" in args.arms and "fp8_tensorwise" in args.arms:
        for label in ("old", "new"):
            print(f"fp8_tensorwise / hp step ({label}): {step_median('fp8_tensorwise', label) / step_median('hp', label):.2f}")
    print(f"(rest = run wall time outside the RL steps: start-up, engine launch, two greedy evaluations of "
          f"{args.eval_prompts} prompts)")
    print("load average:", " ".join(Path("/proc/loadavg").read_text().split()[:3]))


if __name__ == "__main__":
    main()
