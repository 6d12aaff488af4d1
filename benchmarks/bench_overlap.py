"""Step time of the tiny RL run, synchronous (rollout.overlap=none) vs one step off (one_step_off), side by side.

One SFT warm start is shared; then each round runs the tiny FP8 GRPO job (examples/configs/tiny_fp8_grpo.yaml,
one embedded engine, the real CLI in a subprocess) once per variant, variants alternating round by round so
drift of the shared machine's load hits both. A step's time is the loop's `time/step` (the main thread's
phases: under one_step_off the rollout of the next step runs beside them, and only the wait for it,
`time/rollout_wait`, counts); the first step of each run is left out (one_step_off generates it synchronously,
and it pays the warm-up). Prints, and writes to --results (with the command), the median step time per variant,
the ratio sync / one_step_off, and how much generation ran hidden beside training (overlap/rollout_s).

Run: OMP_NUM_THREADS=1 python benchmarks/bench_overlap.py [--steps 8 --rounds 2 --prompts 8]
(~4 minutes on 2 idle cores; the learner and the engine are separate processes, so overlap needs 2 cores).
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
CONFIG = ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml"
VARIANTS = {"sync": "none", "one_step_off": "one_step_off"}


def cli(*args: str) -> list[str]:
    """argv of `megatron-rl ...` with this interpreter."""
    return [sys.executable, "-m", "megatron_rl.cli", *args]


def env() -> dict[str, str]:
    """One torch thread per process (learner and engine each get a core of their own when the box is idle)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def warm_start(work: Path) -> list[str]:
    """SFT once; the overrides every benchmark run starts from."""
    if not (work / "sft" / "hf" / "model.safetensors").exists():
        subprocess.run(cli("sft", str(CONFIG), f"run_dir={work}", "sft.steps=200", "sft.eval_every=0", "sft.stop_accuracy=null",
                           "data.num_train_prompts=200", "data.num_eval_prompts=8"), env=env(), check=True,
                       capture_output=True, timeout=1200)
    return [f"model.init_checkpoint={work / 'sft' / 'hf'}", f"data.train_file={work / 'data' / 'train.jsonl'}",
            f"data.eval_file={work / 'data' / 'eval.jsonl'}", f"data.tokenizer_dir={work / 'data' / 'tokenizer'}",
            "data.num_train_prompts=200", "data.num_eval_prompts=8", "train.eval_max_prompts=8", "train.eval_every=0",
            "tracking.progress_bar=false", "tracking.plots=false", "checkpoint.save_every=0"]


def run_variant(work: Path, base: list[str], name: str, steps: int, prompts: int, round_: int) -> list[dict]:
    """One training run of a variant; its metrics rows."""
    run_dir = work / f"{name}_r{round_}"
    cmd = cli("train", str(CONFIG), f"run_dir={run_dir}", "checkpoint.resume=false", f"train.steps={steps}",
              f"train.prompts_per_step={prompts}", f"rollout.overlap={VARIANTS[name]}", *base)
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> int:
    """Measure, print and write the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (the first is left out)")
    p.add_argument("--rounds", type=int, default=2, help="runs per variant, alternating")
    p.add_argument("--prompts", type=int, default=8, help="train.prompts_per_step (x8 samples)")
    p.add_argument("--work-dir", default=None, help="where the warm start and runs go (default: a temporary directory)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "overlap" / "results.md"))
    args = p.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_overlap_"))
    base = warm_start(work)
    steps = {name: [] for name in VARIANTS}
    hidden, waits = [], []
    started = time.time()
    for r in range(args.rounds):
        for name in (VARIANTS if r % 2 == 0 else reversed(list(VARIANTS))):
            rows = run_variant(work, base, name, args.steps, args.prompts, r)
            steps[name] += [row["time/step"] for row in rows[1:]]
            if name == "one_step_off":
                hidden += [row["overlap/rollout_s"] for row in rows if "overlap/rollout_s" in row]
                waits += [row.get("time/rollout_wait", 0.0) for row in rows[1:]]
            print(f"round {r} {name}: median step {statistics.median(steps[name]):.3f} s", flush=True)
    med = {name: statistics.median(t) for name, t in steps.items()}
    lines = [
        "# rollout.overlap: sync vs one_step_off (tiny FP8 GRPO, CPU)",
        "",
        f"Command: `OMP_NUM_THREADS=1 python benchmarks/bench_overlap.py --steps {args.steps} --rounds {args.rounds} "
        f"--prompts {args.prompts}`",
        f"Measured {time.strftime('%Y-%m-%d', time.gmtime(started))}, load average at the end "
        f"{os.getloadavg()[0]:.1f} (shared 2-core box), {len(steps['sync'])} steps per variant.",
        "",
        "| variant | median step (s) | steps |",
        "|---|---|---|",
        *[f"| {name} | {med[name]:.3f} | {len(steps[name])} |" for name in VARIANTS],
        "",
        f"Step-time ratio sync / one_step_off: **{med['sync'] / med['one_step_off']:.2f}x**",
        f"(one_step_off: median generation running beside training {statistics.median(hidden):.3f} s per step, "
        f"median wait for it {statistics.median(waits):.3f} s).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    print(f"written: {args.results} (work dir {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
