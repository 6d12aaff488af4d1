"""benchmarks/bench_calibration_step.py runs the loop's real training phase: one short round of it here, so that a
change to the loop's session or a renamed code path breaks the test instead of the benchmark (it did, silently)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_calibration_step_benchmark_runs_and_times_the_default_decisions_forwards_on_every_step():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_calibration_step.py"), "--reps", "1",
                           "--no-world2", "--rows", "16", "--micro-batch-size", "4", "--every", "5"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    inside = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"^\s*(\S+)\s+calib step\s+([\d.]+) ms .*other step\s+([\d.]+) ms", proc.stdout, re.M)}
    assert set(inside) == {"decision", "targeted", "per_step", "per_step@1", "per_calibration", "per_calibration@0.25",
                           "per_minibatch"}, proc.stdout
    # the default decides every step's clips on high-precision forwards: the clock must see them on an ordinary step
    # too, where the paper's per_calibration rule runs no forward at all
    assert inside["decision"][1] > 5 * inside["per_calibration"][1], proc.stdout
    # targeted forwards 1 of the 8 off-policy rows (round(0.1 x 8)): some of the decision's work, not all of it
    assert 0 < inside["targeted"][1] < 0.7 * inside["decision"][1], proc.stdout
