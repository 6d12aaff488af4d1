"""tools/plot_ratios.py on a synthetic run directory: the newest dumped step by default, clear errors otherwise."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import plot_ratios  # noqa: E402


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "calibration").mkdir(parents=True)
    g = np.random.default_rng(0)
    for step in (0, 5):
        for rank in range(2):
            n = 300
            hp = np.exp(g.normal(0, 0.2, n))
            np.savez(run / "calibration" / f"step_{step:06d}.rank{rank}.npz", ratio=hp * np.exp(g.normal(0, 0.1, n)),
                     ratio_hp=hp, adv=g.normal(0, 1, n), minibatch=np.ones(n, dtype=np.int64))
    rows = [{"step": s, "calib/solve_lower": 0.7, "calib/solve_upper": 1.3, "calib/lower": 0.75, "calib/upper": 1.25,
             "calib/alpha_target": 0.05, "calib/alpha_achieved": 0.05} for s in range(6)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "config.yaml").write_text("algo:\n  policy_loss: {eps_low: 0.2, eps_high: 0.28}\n")
    return run


def test_plots_the_newest_dumped_step(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert plot_ratios.dumped_steps(run) == [0, 5]
    assert plot_ratios.eps_of(run) == (0.2, 0.28)
    assert plot_ratios.main([str(run)]) == 0
    png = run / "calibration" / "step_000005.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = tmp_path / "s0.png"
    assert plot_ratios.main([str(run), "--step", "0", "--out", str(out)]) == 0 and out.exists()


def test_missing_dumps_are_reported(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert plot_ratios.main([str(run), "--step", "3"]) == 2
    assert "no dumps of step 3; dumped steps: [0, 5]" in capsys.readouterr().err
    assert plot_ratios.main([str(tmp_path)]) == 2
    assert "tracking.dump_ratios=true" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="step 7"):
        plot_ratios.load_step(run, 7)
