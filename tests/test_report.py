"""What a user sees of a run: progress (a bar on a terminal, plain lines elsewhere), the summary and its plots,
tools/compare_runs.py, and a rerun of a finished run (a notice, nothing started, nothing rewritten)."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.tracking import plots, report
from megatron_rl.tracking.report import Progress, summary_rows, write_run_report

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml"


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal of `columns` columns (0: what `script` and some CI runners report)."""

    def __init__(self, columns: int) -> None:
        super().__init__()
        self.columns = columns

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 1


@pytest.fixture
def terminal_size(monkeypatch):
    """Make os.get_terminal_size answer with the fake terminal's width."""
    def use(stream: FakeTerminal) -> FakeTerminal:
        monkeypatch.setattr(report.os, "get_terminal_size", lambda fd: os.terminal_size((stream.columns, 24)))
        return stream
    return use


def rows_of(n: int, calibrate_every: int = 3) -> list[dict]:
    """Synthetic metrics rows: dense metrics every step, shadow (hp/) metrics on calibration steps only."""
    rows = []
    for s in range(n):
        row = {"step": s, "reward/mean": s / n, "accuracy/train": 0.5 + s / (2 * n), "entropy": 1.0 - s / (2 * n),
               "clipfrac_lower_neg": 0.01 * s, "clipfrac_upper_pos": 0.002 * s, "clipfrac": 0.012 * s,
               "calib/lower": 0.8 - 0.001 * s, "calib/upper": 1.2 + 0.001 * s, "time/step": 1.0,
               "offpolicy/clipfrac_lower_neg": 0.02 * s, "offpolicy/clipfrac_upper_pos": 0.004 * s}
        on = s % calibrate_every == 0
        row["hp/clipfrac_lower_neg"] = 0.009 * s if on else None
        row["hp/clipfrac_upper_pos"] = 0.003 * s if on else None
        row["calib/alpha_achieved"] = 0.1 * s if on else None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- progress
def test_plain_lines_without_a_tty():
    stream = io.StringIO()
    bar = Progress(20, stream=stream, line_every_s=1e9)
    for s in range(20):
        bar.update({"reward/mean": s / 20, "calib/lower": 0.8})
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "RL: 20 steps"
    steps = [line.split("step ")[1].split("/")[0] for line in lines[1:]]
    assert steps == [str(k) for k in range(2, 21, 2)]  # every 10%
    assert "(100%)" in lines[-1] and "rew=0.95" in lines[-1] and "L=0.8" in lines[-1]


def test_plain_lines_every_n_seconds_and_on_resume():
    stream = io.StringIO()
    bar = Progress(1000, initial=500, stream=stream, line_every_s=0.0)
    for _ in range(3):
        bar.update({"reward/mean": 1.0})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "RL: resuming at step 500/1000"
    assert [line.split(" (")[0] for line in lines[1:]] == ["RL: step 501/1000", "RL: step 502/1000", "RL: step 503/1000"]


def test_zero_column_terminal_falls_back_to_lines(terminal_size):
    stream = terminal_size(FakeTerminal(columns=0))
    bar = Progress(10, stream=stream, line_every_s=1e9)
    assert bar.bar is None
    for _ in range(10):
        bar.update({"reward/mean": 0.5})
    bar.close()
    assert stream.getvalue().splitlines()[-1].startswith("RL: step 10/10 (100%) rew=0.5")


def test_terminal_bar_shows_the_latest_metrics_every_step(terminal_size):
    stream = terminal_size(FakeTerminal(columns=120))
    bar = Progress(30, desc="SFT warm start", keys=(("loss", "loss"),), stream=stream)
    assert bar.bar is not None
    for s in range(30):
        bar.update({"loss": 3.0 - 0.1 * s})
        assert bar.bar.postfix == f"loss={3.0 - 0.1 * s:.3g}"
    bar.close()
    assert "loss=0.1" in stream.getvalue() and "30/30" in stream.getvalue()


def test_disabled_progress_prints_nothing():
    stream = io.StringIO()
    bar = Progress(5, enabled=False, stream=stream)
    bar.update({"reward/mean": 1.0})
    bar.close()
    assert stream.getvalue() == ""


# ---------------------------------------------------------------------------- summary and plots
def test_summary_says_final_for_last_values_and_names_the_plots(tmp_path):
    rows = rows_of(10)
    text = write_run_report(tmp_path, rows, 0.5, 0.75, wall_s=12.0)
    pairs = dict(line.split(": ", 1) for line in text.splitlines())
    assert (tmp_path / "summary.txt").read_text() == text + "\n"
    assert "(last)" not in text
    # "final" is the last logged value: row 9 for L/H, row 9 too for alpha (logged on rows 0, 3, 6, 9)
    assert pairs["calibrated L / H (final)"] == f"{0.8 - 0.009:.4g} / {1.2 + 0.009:.4g}"
    assert pairs["alpha target / achieved (final)"] == f"n/a / {0.9:.4g}"
    # first / last 20% of 10 steps: rows 0-1 and 8-9
    assert pairs["train reward (mean of first 20% -> mean of last 20% of steps)"] == f"{0.05:.4g} -> {0.85:.4g}"
    names = ["reward.png", "entropy.png", "clipfrac.png", "bounds.png"]
    assert pairs["plots"] == f"{tmp_path / 'plots'}/{{reward,entropy,clipfrac,bounds}}.png"
    for name in names:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_wall_time_names_the_sessions():
    one = dict(summary_rows(rows_of(5), 0.5, 0.5, wall_s=3.0))
    two = dict(summary_rows(rows_of(5), 0.5, 0.5, wall_s=997.04, sessions=2))
    assert one["wall time (s)"] == "3.0"
    assert two["wall time (s)"].startswith("997.0 (summed over 2 sessions")


def test_summary_shows_the_distortion_a_decision_run_measured():
    """strength=decision logs the pooled low/high-precision clip ratio of its shadow tokens: the summary shows the last
    one, right after the calibrated bounds row, and a run without it has no such row."""
    rows = rows_of(6)
    for s, row in enumerate(rows):
        row["calib/gate_ratio"], row["calib/gate_hp_tokens"] = (float("nan"), 0.0) if s < 2 else (1.1 + 0.1 * s, 10.0 * s)
    labels = [label for label, _ in summary_rows(rows, 0.5, 0.5, wall_s=1.0)]
    gate = labels.index("distortion: low/high-precision clip fraction below 1 - eps_low on the shadow's tokens, pooled (final)")
    assert labels[gate - 1].startswith("calibrated L / H")
    assert dict(summary_rows(rows, 0.5, 0.5, wall_s=1.0))[labels[gate]].startswith(f"{1.6:.4g}x on 50 shadow-clipped")
    assert not any(label.startswith("distortion") for label, _ in summary_rows(rows_of(6), 0.5, 0.5, wall_s=1.0))


def test_sparse_metrics_are_markers_dense_are_lines():
    rows = rows_of(9)
    steps, values, sparse = plots.metric_series(rows, "hp/clipfrac_lower_neg")
    assert steps == [0, 3, 6] and sparse
    assert not plots.metric_series(rows, "entropy")[2]
    fig = plots._new_figure(4, 3)
    ax = fig.add_subplot()
    assert plots._draw(ax, rows, "hp/clipfrac_lower_neg", "shadow")
    assert plots._draw(ax, rows, "entropy", "entropy")
    assert not plots._draw(ax, rows, "calib/rho_target", "never logged")
    sparse_line, dense_line = ax.lines
    assert sparse_line.get_marker() == "o" and list(sparse_line.get_xdata()) == [0, 3, 6]
    assert dense_line.get_marker() in ("None", None, "") and len(dense_line.get_xdata()) == 9


def test_clipfrac_figure_draws_the_run_over_the_shadows_updates():
    """The shadow counts off-policy updates only; the run's curves beside it must count the same updates."""
    keys = [key for key, _ in plots.RUN_FIGURES["clipfrac"][2]]
    assert {k.split("/")[0] for k in keys} == {"offpolicy", "hp"}
    assert {k.split("/", 1)[1] for k in keys if k.startswith("hp/")} == \
        {k.split("/", 1)[1] for k in keys if k.startswith("offpolicy/")}


def test_metrics_never_logged_draw_no_empty_figure(tmp_path):
    rows = [{k: v for k, v in r.items() if not k.startswith(("calib/", "hp/", "clipfrac", "offpolicy/"))} for r in rows_of(6)]
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "bounds.png").write_bytes(b"stale")
    written = plots.plot_run(rows, tmp_path / "plots")
    assert [p.name for p in written] == ["reward.png", "entropy.png"]
    assert not (tmp_path / "plots" / "bounds.png").exists() and not (tmp_path / "plots" / "clipfrac.png").exists()


def test_compare_runs_table_and_plot(tmp_path):
    for name, scale in (("fp8", 1.0), ("bf16", 2.0)):
        run = tmp_path / name
        run.mkdir()
        rows = rows_of(10)
        for r in rows:
            r["entropy"] = scale * r["step"]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.png"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "compare_runs.py"), str(tmp_path / "fp8"),
                           str(tmp_path / "bf16"), "--keys", "entropy", "hp/clipfrac_lower_neg", "--plot", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split() == ["mean", "mean", "of", "last", "20%", "final"] * 2
    entropy = lines[3].split()
    # mean of steps 0..9, mean of the last 20% (steps 8, 9), final (step 9); bf16 is twice fp8
    assert entropy == ["entropy", "4.5", "8.5", "9", "9", "17", "18"]
    shadow = lines[4].split()  # logged on steps 0, 3, 6, 9: the last 20% holds step 9 only
    assert shadow[1:4] == [f"{0.009 * 4.5:.4g}", f"{0.009 * 9:.4g}", f"{0.009 * 9:.4g}"]
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_compare_runs_names_a_missing_metrics_file(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "compare_runs.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 2 and f"{tmp_path / 'nope' / 'metrics.jsonl'}" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- rerunning a finished run
def _fake_checkpoint(run_dir: Path, step: int) -> None:
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": step}))
    (ckpt / "COMPLETE").write_text(f"{step}\n")


def test_finished_run_is_reported_and_left_alone(tmp_path, capsys):
    from megatron_rl.config import load_config
    from megatron_rl.loop import run
    from megatron_rl.runtime import finished_run

    run_dir = tmp_path / "run"
    _fake_checkpoint(run_dir, 4)
    (run_dir / "summary.txt").write_text("wall time (s): 997.0\n")
    before = (run_dir / "summary.txt").stat()
    cfg = load_config(CONFIG, [f"run_dir={run_dir}", "train.steps=5"])
    out = run(cfg)  # no engine, no model: a real start would fail here (nothing is set up in run_dir)
    assert out["finished"]
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    assert printed[0].startswith(f"run already complete: {run_dir} finished its 5 steps (step_00000004)")
    assert str(run_dir / "summary.txt") in printed[0] and "checkpoint.resume=false" in printed[0]
    assert "run_dir=" in printed[0]
    after = (run_dir / "summary.txt").stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "summary.txt"]
    # more steps asked: not finished (it resumes); resume off: not finished (it starts over)
    assert finished_run(load_config(CONFIG, [f"run_dir={run_dir}", "train.steps=6"])) is None
    assert finished_run(load_config(CONFIG, [f"run_dir={run_dir}", "train.steps=5", "checkpoint.resume=false"])) is None
    assert finished_run(load_config(CONFIG, [f"run_dir={tmp_path / 'empty'}", "train.steps=5"])) is None


def test_session_wall_time_adds_earlier_sessions():
    from megatron_rl.runtime import RunSession

    session = RunSession(cfg=None, run_dir=Path("."), tokenizer=None, train_rows=[], eval_rows=[], reward_fn=None,
                         learner=None, clipper=None, hf_dir="", rl_state={"wall_s": 990.0, "sessions": 1})
    assert 990.0 <= session.wall_time() < 990.0 + 60 and session.sessions() == 2
    fresh = RunSession(cfg=None, run_dir=Path("."), tokenizer=None, train_rows=[], eval_rows=[], reward_fn=None,
                       learner=None, clipper=None, hf_dir="")
    assert 0.0 <= fresh.wall_time() < 60 and fresh.sessions() == 1
    assert not math.isnan(fresh.wall_time())


def test_summary_names_the_warm_start_and_the_cpu_kernels(tmp_path):
    import json

    from megatron_rl.config import load_config
    from megatron_rl.cpu_kernels import kernel_report
    from megatron_rl.warm_start import warm_start_summary

    cfg = load_config(None, [f"run_dir={tmp_path}", "sft.eval_every=10", "sft.stop_accuracy=0.5", "sft.eval_prompts=200"])
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "warm_start.json").write_text(json.dumps(
        {"steps": 730, "stopped_by": "stop_accuracy", "greedy_accuracy": 0.515, "stop_accuracy": 0.5, "max_steps": 1600}))
    where = warm_start_summary(cfg, tmp_path)
    assert where == "SFT 730 steps (reached sft.stop_accuracy=0.5), last check 51.5% greedy accuracy on 200 prompts it did not train on"
    context = [("warm start", where), ("CPU kernels (this run)", kernel_report())]
    pairs = dict(line.split(": ", 1) for line in write_run_report(tmp_path, rows_of(5), 0.5, 0.75, wall_s=1.0,
                                                                   plots=False, context=context).splitlines())
    assert pairs["warm start"] == where and pairs["CPU kernels (this run)"].startswith("ATen ")
    assert warm_start_summary(load_config(None, ["model.init_checkpoint=/ckpt"]), tmp_path) == "model.init_checkpoint=/ckpt"
    for reached_at, outcome in ((1900, "reached at step 1900, settling cut short"), (None, "not reached")):
        (tmp_path / "sft" / "warm_start.json").write_text(json.dumps(
            {"steps": 2000, "stopped_by": "steps", "greedy_accuracy": 0.6, "stop_accuracy": 0.5, "reached_at": reached_at,
             "settle_steps": 250, "max_steps": 2000}))
        assert warm_start_summary(cfg, tmp_path).startswith(f"SFT 2000 steps (all sft.steps; sft.stop_accuracy=0.5 {outcome})")


def test_summary_counts_the_steps_decided_on_high_precision_ratios():
    """strength=decision logs per step whether high-precision ratios decided its clips: the summary says on how many
    steps and from which, right after the calibrated bounds row; runs that do not log it have no such row."""
    rows = [{"step": s, "calib/hp_decision": float(s >= 3)} for s in range(6)]
    labels = [label for label, _ in summary_rows(rows, 0.5, 0.5, wall_s=1.0)]
    at = labels.index("clip decided on high-precision ratios (vanilla bounds)")
    assert labels[at - 1].startswith("calibrated L / H")
    assert dict(summary_rows(rows, 0.5, 0.5, wall_s=1.0))[labels[at]] == "3 of 6 steps, first at step 3"
    closed = [{**r, "calib/hp_decision": 0.0} for r in rows]
    assert dict(summary_rows(closed, 0.5, 0.5, wall_s=1.0))["clip decided on high-precision ratios (vanilla bounds)"] == "0 of 6 steps"
    plain = [{"step": s} for s in range(6)]
    assert not any(label.startswith("clip decided") for label, _ in summary_rows(plain, 0.5, 0.5, wall_s=1.0))
    # strength=targeted also says which share of the off-policy answers' tokens it decided so
    targeted = [{**r, "calib/targeted_token_share": 0.1 + 0.02 * r["step"]} for r in rows]
    labels = [label for label, _ in summary_rows(targeted, 0.5, 0.5, wall_s=1.0)]
    at = labels.index("off-policy answer tokens decided so (targeted, mean)")
    assert labels[at - 1] == "clip decided on high-precision ratios (vanilla bounds)"
    assert dict(summary_rows(targeted, 0.5, 0.5, wall_s=1.0))[labels[at]].startswith("0.15")
    assert "off-policy answer tokens decided so (targeted, mean)" not in dict(summary_rows(rows, 0.5, 0.5, wall_s=1.0))
