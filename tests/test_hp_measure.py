"""`megatron-rl hp-measure` / `megatron-rl study SPEC --hp-measure` (megatron_rl/study/hp_measure.py): step selection,
the fixed prompt set, refusal of mixed settings, the study report's hp columns, and end to end on two tiny runs (a
high-precision arm whose hp-measured greedy accuracy must equal its own evaluation exactly, and an FP8 arm whose
measurement must really be high precision)."""
from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from rl_runs import cli_env, tiny_overrides, train, warm_start
from test_study import _fake_run, _spec

from megatron_rl.study import hp_measure, load_study, results
from megatron_rl.study.runner import measure_study, write_report


def _checkpoints(run_dir: Path, steps) -> None:
    for s in steps:
        d = run_dir / "checkpoints" / f"step_{s:08d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "COMPLETE").write_text(f"{s}\n")


def test_step_selection():
    assert hp_measure.select_steps("final", [4, 9]) == [9]
    assert hp_measure.select_steps("all", [9, 4]) == [4, 9]
    # a 200-step run's checkpoints every 25 steps: the second half is 99..199, as the late report rows take it
    assert hp_measure.select_steps("late", list(range(199, 0, -25))) == [99, 124, 149, 174, 199]
    assert hp_measure.select_steps("late", [9]) == [9]
    assert hp_measure.select_steps("9, 4,4", [4, 9]) == [4, 9]
    with pytest.raises(ValueError, match=r"no checkpoint of step\(s\) \[5\]"):
        hp_measure.select_steps("4,5", [4, 9])
    with pytest.raises(ValueError, match="final, late, all, or comma-separated"):
        hp_measure.select_steps("last", [4, 9])
    with pytest.raises(ValueError, match="no complete checkpoint"):
        hp_measure.select_steps("final", [])


def test_prompt_set_is_fixed_by_its_seed_and_draws_without_replacement():
    rows = list(range(100))
    a, b, c = (hp_measure.prompt_subset(rows, 30, s) for s in (0, 0, 1))
    assert a == b and a != c and len(set(a)) == 30
    assert hp_measure.prompt_subset(rows[:5], 30, 0) == rows[:5]


def test_pending_skips_what_is_measured_and_refuses_other_settings(tmp_path):
    _checkpoints(tmp_path, (4, 9))
    settings = hp_measure.settings_record(16, 0, None)
    assert hp_measure.pending(tmp_path, "all", ("hp", "own"), settings) == [(4, "hp"), (4, "own"), (9, "hp"), (9, "own")]
    (tmp_path / hp_measure.HP_MEASURE_FILE).write_text(json.dumps(
        {"settings": settings, "steps": {"9": {"hp": {"greedy_accuracy": 0.5}}}}))
    assert hp_measure.pending(tmp_path, "final", ("hp",), settings) == []
    assert hp_measure.pending(tmp_path, "all", ("hp", "own"), settings) == [(4, "hp"), (4, "own"), (9, "own")]
    with pytest.raises(ValueError, match=r"other settings \(prompts: 16 -> 8\)"):
        hp_measure.pending(tmp_path, "final", ("hp",), hp_measure.settings_record(8, 0, None))
    with pytest.raises(ValueError, match=">= 1"):
        hp_measure.settings_record(0, 0, None)


def _measured(run_dir: Path, steps: dict) -> None:
    """A hp_measure.json holding {step: {view: {field: value}}}."""
    (run_dir / hp_measure.HP_MEASURE_FILE).write_text(json.dumps(
        {"settings": hp_measure.settings_record(64, 0, None), "steps": {str(k): v for k, v in steps.items()}}))


def test_report_puts_hp_measured_rows_beside_the_arms_own_figures(tmp_path):
    study = load_study(_spec(tmp_path, reference_arm="hp"))
    for arm, seed, k in (("hp", 1, 0.5), ("hp", 2, 0.7), ("fp8", 1, 1.0), ("fp8", 2, 3.0)):
        _fake_run(study, arm, seed, k, dumps=False)
    text = write_report(study).read_text()
    assert "high-precision engine" not in text and "by checkpoint step" not in text  # nothing measured: no hp rows
    for arm, seed, acc, entropy in (("fp8", 1, 0.6, 0.30), ("fp8", 2, 0.8, 0.50), ("hp", 1, 0.9, 0.20)):
        _measured(study.run_dir(arm, seed), {
            4: {"hp": {"greedy_accuracy": acc - 0.1, "reward_mean": 0.1, "entropy": entropy}},
            9: {"hp": {"greedy_accuracy": acc, "reward_mean": 0.2, "entropy": entropy, "greedy_malformed": 0.0},
                "own": {"greedy_accuracy": 0.25, "reward_mean": 0.15, "logprob_gap": 0.02}}})
    text = write_report(study).read_text()
    lines = text.splitlines()
    row = lambda label: next(ln for ln in lines if ln.startswith(f"| {label} |"))  # noqa: E731  (first table)
    assert row("held-out accuracy after RL, high-precision engine") == \
        f"| held-out accuracy after RL, high-precision engine | 0.9 ± 0 [0.9, 0.9] | {results.SeedStats([0.6, 0.8]).cell()} |"
    assert row("entropy after RL, high-precision forward").endswith(f"| {results.SeedStats([0.3, 0.5]).cell()} |")
    assert row("sampled reward after RL, own engine (same prompts)") == \
        "| sampled reward after RL, own engine (same prompts) | 0.15 ± 0 [0.15, 0.15] | 0.15 ± 0 [0.15, 0.15] |"
    # beside the arm's own figure: the hp row follows the row it separates the policy from
    own_at = lines.index(row("held-out accuracy after RL"))
    assert lines[own_at + 1] == row("held-out accuracy after RL, high-precision engine")
    assert "| held-out accuracy after RL, high-precision engine | -0.2 |" in text   # relative to hp: 0.7 - 0.9
    assert "- **entropy after RL, high-precision forward** (`hp/entropy`)" in text
    by_step = text[text.index("## High-precision measurement by checkpoint step"):]
    assert "| 4 | 0.8 [0.8, 0.8] | 0.6 [0.5, 0.7] |" in by_step and "| 9 | 0.9 [0.9, 0.9] | 0.7 [0.6, 0.8] |" in by_step


def test_study_measures_finished_runs_only_and_skips_measured_ones(tmp_path, monkeypatch):
    from megatron_rl.study import runner

    study = load_study(_spec(tmp_path))
    _fake_run(study, "hp", 1, 0.5, dumps=False)
    _fake_run(study, "fp8", 1, 1.0, dumps=False)
    _measured(study.run_dir("fp8", 1), {9: {"hp": {"greedy_accuracy": 0.5}}})
    _fake_run(study, "fp8", 2, 1.0, dumps=False)
    (study.run_dir("fp8", 2) / hp_measure.HP_MEASURE_FILE).write_text(json.dumps(
        {"settings": hp_measure.settings_record(8, 0, None), "steps": {}}))  # measured with other settings
    started, said = [], []

    def fake_run(cmd, env, log):
        started.append((cmd[cmd.index("hp-measure") + 1:], env.get("OMP_NUM_THREADS")))
        return 0, 0.0

    monkeypatch.setattr(runner, "_run_logged", fake_run)
    assert measure_study(study, "final", ("hp",), 64, say=said.append) == 1  # fp8 seed 2: refused, counted
    assert started == [([str(study.run_dir("hp", 1)), "--steps", "final", "--prompts", "64"], "1")]
    assert any("hp seed 2: not finished" in s for s in said) and any("fp8 seed 1: measured, skipped" in s for s in said)
    assert any("fp8 seed 2" in s and "other settings" in s for s in said)


def _measure(run_dir: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "hp-measure", str(run_dir), *args], env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return hp_measure.read_measurements(run_dir)


ONE_PROMPT = 1.01 / 48
"""One held-out prompt of 48: two engine processes batch the same greedy requests differently, and a near-tie of two
tokens' logits may then break the other way on another CPU's kernels, so evaluations agree to one prompt, not bits."""


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """The session's tiny warm start."""
    return warm_start(tmp_path_factory)


@pytest.mark.slow
def test_hp_measure_of_an_hp_arm_and_an_fp8_arm(warm, tmp_path):
    """Two-step runs with a checkpoint and a held-out evaluation after every step (48 of the warm start's training
    prompts as the held-out set: its 8 held-out prompts would make accuracy too coarse to compare)."""
    extra = ("train.steps=2", "checkpoint.save_every=1", "train.eval_every=1", "algo.calibration.enabled=false",
             f"data.eval_file={warm / 'data' / 'train.jsonl'}", "train.eval_max_prompts=48")
    runs = {"hp": tmp_path / "hp", "fp8": tmp_path / "fp8"}
    rows = {"hp": train(runs["hp"], tiny_overrides(warm, *extra, "precision.recipe=none", "precision.rollout_quantization=none")),
            "fp8": train(runs["fp8"], tiny_overrides(warm, *extra))}  # blockwise FP8 learner, FP8 blockwise rollouts
    measured = {arm: _measure(run, "--steps", "all", "--prompts", "16", "--own") for arm, run in runs.items()}

    for arm in runs:
        assert sorted(measured[arm]["steps"]) == ["0", "1"]
        for r in rows[arm]:
            hp = measured[arm]["steps"][str(r["step"])]["hp"]
            # the measurement serves fp32 weights unquantized, and its engine's log-probs are the fp32 forward's
            assert hp["engine"]["served_dir_format"] == "none" and hp["engine"]["quantization_config"] is None
            assert hp["engine"]["kv_cache_dtype"] == "auto" and hp["engine"]["dtype"] == "float32"
            assert hp["logprob_gap"] < 1e-4 and hp["completion_tokens"] > 0 and 0 < hp["entropy"] < math.log(40)
            assert hp["prompts"] == 16 and hp["eval_prompts"] == 48 and 0 <= hp["reward_mean"] <= 1

    for r in rows["hp"]:  # same weights, same precision, same engine code: the run's own evaluation, to one prompt
        hp = measured["hp"]["steps"][str(r["step"])]
        assert hp["hp"]["greedy_accuracy"] == pytest.approx(r["accuracy/eval"], abs=ONE_PROMPT)
        assert hp["hp"]["greedy_malformed"] == pytest.approx(r["malformed/eval"], abs=ONE_PROMPT)
        assert hp["own"]["same_as"] == "hp"  # an hp arm's own engines already serve in high precision
    state = pickle.loads((runs["hp"] / "checkpoints" / "step_00000001" / "rl_state.pkl").read_bytes())
    assert measured["hp"]["steps"]["1"]["hp"]["greedy_accuracy"] == pytest.approx(state["eval_after"], abs=ONE_PROMPT)
    assert any(2 * ONE_PROMPT < r["accuracy/eval"] < 1 - 2 * ONE_PROMPT for r in rows["hp"])  # not a trivial 0 or 1

    for r in rows["fp8"]:
        views = measured["fp8"]["steps"][str(r["step"])]
        own, hp = views["own"], views["hp"]
        # the arm's own precision, rebuilt from the checkpoint, reproduces the run's own evaluation (to one prompt) ...
        assert own["engine"]["served_dir_format"] == "fp8-blockwise" and own["engine"]["quantization_config"]
        assert own["greedy_accuracy"] == pytest.approx(r["accuracy/eval"], abs=ONE_PROMPT)
        # ... and the hp view is not it: its engine agrees with the fp32 forward, the W8A8 engine does not
        assert own["logprob_gap"] > 100 * hp["logprob_gap"] and own["logprob_gap"] > 1e-3

    settings = hp_measure.settings_record(16, 0, None)
    assert hp_measure.pending(runs["fp8"], "all", ("hp", "own"), settings) == []  # a rerun measures nothing
    with pytest.raises(ValueError, match="other settings"):
        hp_measure.pending(runs["fp8"], "all", ("hp",), hp_measure.settings_record(64, 0, None))


def test_dose_table_adds_hp_rows_once_measured(tmp_path):
    from megatron_rl.study.dose import write_dose_report

    arms = [{"name": "hp", "overrides": {}}, {"name": "fp8_k4", "overrides": {
        "precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 4.0}}]
    study = load_study(_spec(tmp_path, arms=arms))
    for arm in ("hp", "fp8_k4"):
        _fake_run(study, arm, 1, 1.0, dumps=False)
    assert "high-precision" not in write_dose_report(study).read_text()
    _measured(study.run_dir("fp8_k4", 1), {9: {"hp": {"greedy_accuracy": 0.75, "reward_mean": 0.5, "entropy": 0.25}}})
    text = write_dose_report(study).read_text()
    assert "| held-out accuracy after RL, high-precision engine | n/a | 0.75 [0.75, 0.75] |" in text
    assert "| entropy after RL, high-precision forward | n/a | 0.25 [0.25, 0.25] |" in text
    assert "late checkpoints" not in text  # the final checkpoint alone has no late average
    steps = study.spec.steps
    _measured(study.run_dir("fp8_k4", 1), {steps // 2 - 2: {"hp": {"greedy_accuracy": 0.1}},  # first half: left out
                                           steps // 2 - 1: {"hp": {"greedy_accuracy": 0.5}},
                                           steps - 1: {"hp": {"greedy_accuracy": 0.75, "reward_mean": 0.5}}})
    text = write_dose_report(study).read_text()
    assert "| held-out accuracy, high-precision engine, late checkpoints | n/a | 0.625 [0.625, 0.625] |" in text
    assert "sampled reward, high-precision engine, late checkpoints" not in text  # one late checkpoint has it
