"""`megatron-rl study`: spec validation, per-run metric definitions, statistics over seeds, the token-dump
reader and the report (RESULTS.md + PNGs) on synthetic run directories, and one end-to-end smoke study."""
from __future__ import annotations

import json
import math
import pickle
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_rl.study import StudyError, load_study
from megatron_rl.study import plots, results
from megatron_rl.study.runner import WARM_START_RECORD, _check_warm_start_config, check_existing_runs, config_record, write_report

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "examples" / "configs" / "tiny_grpo.yaml"


def _spec(tmp_path: Path, **fields) -> Path:
    spec = {"base": str(BASE), "output_dir": str(tmp_path / "study"), "steps": 10, "seeds": [1, 2],
            "arms": [{"name": "hp", "overrides": {}}, {"name": "fp8", "overrides": {"precision.recipe": "blockwise"}}]}
    spec.update(fields)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_example_spec_loads_and_every_run_config_validates():
    study = load_study(REPO / "examples" / "studies" / "tiny_precision.yaml")
    assert study.base == (REPO / "examples" / "configs" / "tiny_grpo.yaml").resolve()
    runs = study.runs()
    assert len(runs) == len(study.spec.arms) * len(study.spec.seeds)
    warm = study.warm_overrides()
    assert warm == [f'data.train_file="{study.warm_dir}/data/train.jsonl"', f'data.tokenizer_dir="{study.warm_dir}/data/tokenizer"',
                    f'data.eval_file="{study.warm_dir}/data/eval.jsonl"', f'model.init_checkpoint="{study.warm_dir}/sft/hf"']
    for arm, seed in runs:
        cfg = study.run_config(arm, seed, warm)
        assert cfg.train.steps == study.spec.steps and cfg.train.seed == seed == cfg.precision.fp4_seed
        assert cfg.run_dir == str(study.run_dir(arm, seed)) and cfg.model.init_checkpoint == f"{study.warm_dir}/sft/hf"
        assert cfg.checkpoint.save_every == study.spec.checkpoint_every and cfg.checkpoint.resume


@pytest.mark.parametrize("fields,match", [
    ({"arms": [{"name": "a", "overrides": {"data.task": "x"}}]}, r"arms\[0\] \(a\).*data.task.*warm start"),
    ({"arms": [{"name": "a"}, {"name": "a"}]}, "distinct"),
    ({"arms": [{"name": "a b"}]}, "arm name"),
    ({"arms": []}, "arms"),
    ({"reference_arm": "nope"}, "reference_arm"),
    ({"overrides": {"train.seed": 3}}, "set by the study runner"),
    ({"arms": [{"name": "a", "overrides": {"train.steps": 3}}]}, "set by the study runner"),
    ({"seeds": [1, 1]}, "distinct"),
    ({"stesp": 3}, "stesp: unknown key"),
])
def test_spec_errors_name_the_field(tmp_path, fields, match):
    with pytest.raises(StudyError, match=match):
        load_study(_spec(tmp_path, **fields))


def test_bad_arm_value_fails_at_load_naming_arm_seed_and_key(tmp_path):
    with pytest.raises(StudyError, match=r"(?s)arm 'x' seed 1.*precision.recipe"):
        load_study(_spec(tmp_path, arms=[{"name": "x", "overrides": {"precision.recipe": "fp3"}}]))
    with pytest.raises(StudyError, match=r"(?s)warm start.*sft.steps"):
        load_study(_spec(tmp_path, overrides={"sft.steps": "many"}))
    with pytest.raises(StudyError, match="base config not found"):
        load_study(_spec(tmp_path, base="missing.yaml"))


def test_run_values_follow_their_definitions():
    rows = [{"step": s, "entropy": e, "clipfrac_lower_neg": c} for s, (e, c) in
            enumerate(zip([1.0, 2.0, 5.0, 3.0, 4.0], [0.1, None, 0.3, 0.2, 0.4]))]
    rows[1]["hp/clipfrac_lower_neg"] = 0.05
    rows[3]["hp/clipfrac_lower_neg"] = 0.15
    for r in rows:
        r["calib/alpha_target"] = 0.5 if r["step"] in (1, 3) else 9.0  # held value between calibrations
    by = {m.label: m for m in results.METRICS}
    v = lambda label, tail=0.4: results.run_value(rows, by[label], tail, {"eval_after": 0.25})  # noqa: E731
    assert v("clipfrac_lower_neg") == pytest.approx((0.1 + 0.3 + 0.2 + 0.4) / 4)       # finite steps only
    assert v("entropy (last)") == pytest.approx((3.0 + 4.0) / 2)                         # last 40% = 2 steps
    assert v("entropy (max)") == 5.0
    assert v("clipfrac_lower_neg, high precision (shadow)") == pytest.approx(0.1)        # sparse: its own steps
    assert v("alpha target") == 0.5                                                      # calibration steps only
    window = results.run_value(rows, by["clipfrac_lower_neg (from step N)"], 0.4, {}, from_step=2)
    assert window == pytest.approx((0.3 + 0.2 + 0.4) / 3)                                # steps 2.. only
    assert v("held-out accuracy after RL") == 0.25 and math.isnan(v("held-out accuracy before RL"))
    assert math.isnan(v("reward (mean)"))
    s = results.SeedStats([0.1, 0.3, math.nan])
    assert s.mean == pytest.approx(0.2) and s.std == pytest.approx(statistics.stdev([0.1, 0.3]))
    assert s.cell() == "0.2 ± 0.1414 [0.1, 0.3]" and results.SeedStats([math.nan]).cell() == "n/a"


def test_late_checkpoint_values_take_the_second_half_and_need_two_checkpoints():
    by = {m.label: m for m in results.METRICS}
    late, spread = by["held-out accuracy, high-precision engine, late checkpoints"], \
        by["held-out accuracy, high-precision engine, checkpoint-to-checkpoint std"]
    measured = {24: {"hp/greedy_accuracy": 0.1}, 49: {"hp/greedy_accuracy": 0.2}, 99: {"hp/greedy_accuracy": 0.9},
                149: {"hp/greedy_accuracy": 0.6, "hp/entropy": 0.5}, 199: {"hp/greedy_accuracy": 0.75}}
    value = lambda m, ms, steps=200: results.run_value([], m, 0.4, {}, measured_steps=ms, steps=steps)  # noqa: E731
    assert value(late, measured) == pytest.approx((0.9 + 0.6 + 0.75) / 3)       # 99, 149, 199: not 24 or 49
    assert value(spread, measured) == pytest.approx(statistics.stdev([0.9, 0.6, 0.75]))
    assert value(late, measured, steps=100) == pytest.approx((0.2 + 0.9 + 0.6 + 0.75) / 4)  # from 49 on
    assert math.isnan(value(late, {199: {"hp/greedy_accuracy": 0.75}}))           # the final checkpoint alone
    assert math.isnan(value(by["entropy, high-precision forward, late checkpoints"], measured))  # one late step has it
    assert math.isnan(value(late, {}))


def test_only_the_named_arms_and_seeds_run_and_unknown_ones_are_refused(tmp_path, monkeypatch):
    from megatron_rl.study import runner

    study = load_study(_spec(tmp_path))
    started = []
    monkeypatch.setattr(runner, "prepare_warm_start", lambda study, say: [])

    def fake_run(cmd, env, log):
        log.parent.mkdir(parents=True, exist_ok=True)
        started.append(cmd[cmd.index("train") + 1:])
        return 1, 0.0

    monkeypatch.setattr(runner, "_run_logged", fake_run)
    monkeypatch.setattr(runner, "write_report", lambda study: study.out / "RESULTS.md")
    assert runner.run_study(study, say=lambda m: None, only_arms=["fp8"]) == 2  # both fp8 seeds tried (and "failed")
    dirs = [next(o for o in cmd if o.startswith("run_dir=")) for cmd in started]
    assert dirs == [f'run_dir="{study.run_dir("fp8", s)}"' for s in (1, 2)]
    with pytest.raises(StudyError, match="--arms bf16: not arms of this study"):
        runner.run_study(study, say=lambda m: None, only_arms=["bf16", "fp8"])
    started.clear()
    assert runner.run_study(study, say=lambda m: None, only_seeds=[2]) == 2  # both arms of seed 2
    dirs = [next(o for o in cmd if o.startswith("run_dir=")) for cmd in started]
    assert dirs == [f'run_dir="{study.run_dir(a, 2)}"' for a in ("hp", "fp8")]
    with pytest.raises(StudyError, match="--seeds 7: not seeds of this study"):
        runner.run_study(study, say=lambda m: None, only_seeds=[7])


def test_report_dir_keeps_a_second_specs_report_apart(tmp_path):
    study = load_study(_spec(tmp_path, report_dir=str(tmp_path / "elsewhere")))
    _fake_run(study, "hp", 1, 0.5, dumps=False)
    out = write_report(study)
    assert out == tmp_path / "elsewhere" / "RESULTS.md" and (tmp_path / "elsewhere" / "curves.png").exists()
    assert not (study.out / "RESULTS.md").exists() and study.run_dir("hp", 1).is_relative_to(study.out)


def test_dose_report_groups_arms_by_k_and_calibration(tmp_path):
    from megatron_rl.study.dose import arm_dose, write_dose_report

    arms = [{"name": "hp", "overrides": {}},
            {"name": "fp8", "overrides": {"precision.recipe": "blockwise"}},
            {"name": "fp8_k4", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 4.0}},
            {"name": "fp8_calib", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True}},
            {"name": "fp8_calib_k4", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 4.0,
                                                   "algo.calibration.enabled": True, "algo.calibration.shadow_fraction": 1.0}},
            {"name": "fp8_calib_full", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True,
                                                     "algo.calibration.strength": "full"}},
            {"name": "fp8_calib_pool_k4", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True,
                                                        "algo.experimental.clip_error_scale": 4.0,
                                                        "algo.calibration.calibrate_every": 4,
                                                        "algo.calibration.shadow_fraction": 1.0,
                                                        "algo.calibration.upper": "fixed"}}]
    study = load_study(_spec(tmp_path, arms=arms))
    assert [arm_dose(a.overrides) for a in study.spec.arms] == [
        (None, "reference"), (1.0, "vanilla"), (4.0, "vanilla"), (1.0, "calibrated"), (4.0, "calibrated"),
        (1.0, "calibrated, strength=full"), (4.0, "calibrated, calibrate_every=4, upper=fixed")]
    for arm, k in (("hp", 0.5), ("fp8", 1.0), ("fp8_k4", 4.0), ("fp8_calib", 2.0)):
        for seed in (1, 2):
            _fake_run(study, arm, seed, k + seed, dumps=False)
    text = write_dose_report(study).read_text()
    assert ("| metric | hp (reference) | vanilla k=1 | vanilla k=4 | calibrated k=1 | calibrated k=4 "
            "| calibrated, calibrate_every=4, upper=fixed k=4 | calibrated, strength=full k=1 |") in text
    row = next(line for line in text.splitlines() if line.startswith("| clipfrac_lower_neg |")).split(" | ")
    # (4+1, 4+2) * 0.01; the default calibration at k = 1 keeps its own cell beside the full-strength arm (which, never
    # run, must not overwrite it); k4 calib and full never ran
    assert row[3] == "0.055 [0.05, 0.06]" and row[4] == "0.035 [0.03, 0.04]" and row[5:] == ["n/a", "n/a", "n/a |"], row
    assert (study.report_out / "dose.png").read_bytes()[:4] == b"\x89PNG"


def test_kv_report_compares_k3_kl_seed_by_seed_with_the_reference(tmp_path):
    from megatron_rl.study.kv_report import write_kv_report

    arms = [{"name": "bf16_kv", "overrides": {}},
            {"name": "fp8_kv_unit", "overrides": {"precision.kv_cache_dtype": "fp8_e4m3", "precision.kv_cache_scales": "unit"}},
            {"name": "fp8_kv_recal", "overrides": {"precision.kv_cache_dtype": "fp8_e4m3",
                                                   "precision.kv_cache_scales": "recalibrate"}}]
    study = load_study(_spec(tmp_path, arms=arms, reference_arm="bf16_kv"))
    k3 = {"bf16_kv": (1e-3, 2e-3), "fp8_kv_unit": (5e-3, 4e-3), "fp8_kv_recal": (1.05e-3, 2.4e-3)}
    for arm, values in k3.items():
        for seed, v in zip((1, 2), values):
            _fake_run(study, arm, seed, 1.0, dumps=False)
            path = study.run_dir(arm, seed) / "metrics.jsonl"
            rows = [json.loads(ln) for ln in path.read_text().splitlines()]
            for r in rows:
                r.update({"mismatch_k3_kl": v, "time/step": 2.0})
                if arm == "fp8_kv_recal":
                    r["time/kv_cache_reduce"] = 0.02
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_kv_report([study], tmp_path / "KV.md").read_text()
    rows = {ln.split(" | ")[1]: ln.split(" | ") for ln in text.splitlines() if ln.startswith("| spec |")}
    assert rows["bf16_kv"][-2:] == ["reference", " |"]
    assert rows["fp8_kv_unit"][-2:] == ["3.5x [2, 5]", " |"]           # 5e-3 / 1e-3 and 4e-3 / 2e-3; no verdict (not recalibrated)
    assert rows["fp8_kv_recal"][-2:] == ["1.12x [1.05, 1.2]", "misses |"]  # seed 2 is 1.2x: the target holds in no case
    assert rows["fp8_kv_recal"][-3] == "0.01 [0.01, 0.01]" and rows["bf16_kv"][-3] == "n/a"


def test_dose_report_refuses_two_arms_in_one_cell(tmp_path):
    from megatron_rl.study.dose import write_dose_report

    arms = [{"name": "hp", "overrides": {}},
            {"name": "calib_a", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True}},
            {"name": "calib_b", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True,
                                              "algo.calibration.shadow_fraction": 1.0}}]
    study = load_study(_spec(tmp_path, arms=arms))
    with pytest.raises(StudyError, match="'calib_a' and 'calib_b' both are calibrated at k=1"):
        write_dose_report(study)


def test_a_shadow_fraction_other_than_the_default_is_a_variant_of_its_own(tmp_path, monkeypatch):
    from megatron_rl.study.dose import arm_dose, dose_table

    assert arm_dose({"precision.recipe": "blockwise", "algo.calibration.enabled": True,
                     "algo.calibration.shadow_fraction": 0.5}) == (1.0, "calibrated, shadow_fraction=0.5")
    # the committed dose specs hold the default and its shadow-0.5 variant at k = 1: one cell each
    monkeypatch.chdir(tmp_path)  # output_dir is relative to it: nothing ran there, every cell is n/a
    for name in ("deep_addtrace_dose.yaml", "deep_addtrace_dose_s456.yaml"):
        study = load_study(REPO / "examples" / "studies" / name)
        text, _ = dose_table(study)
        header = next(line for line in text.splitlines() if line.startswith("| metric |"))
        assert header.count(" | ") == sum(a.name != "hp" for a in study.spec.arms) + 1, header


def test_malformed_metrics_come_from_the_rows_and_the_final_state():
    rows = [{"step": s, "malformed/train": m} for s, m in enumerate([0.1, 0.6, 0.2, 0.3, 0.5])]
    by = {m.label: m for m in results.METRICS}
    evals = {"eval_after": 0.5, "eval_malformed_after": 0.125}
    assert results.run_value(rows, by["malformed (last)"], 0.4, evals) == pytest.approx(0.4)
    assert results.run_value(rows, by["malformed (max)"], 0.4, evals) == 0.6
    assert results.run_value(rows, by["held-out malformed after RL"], 0.4, evals) == 0.125
    assert math.isnan(results.run_value([{"step": 0}], by["malformed (last)"], 0.4, {}))  # tasks without a format


def test_mismatch_and_kv_scale_share_follow_their_definitions():
    by = {m.label: m for m in results.METRICS}
    rows = [{"step": 0, "mismatch_k3_kl": 1e-3, "time/step": 2.0, "time/kv_cache_reduce": 0.02},
            {"step": 1, "mismatch_k3_kl": 3e-3, "time/step": 3.0, "time/kv_cache_reduce": 0.08},
            {"step": 2, "time/step": 100.0}]  # a step without a measurement counts in neither sum
    assert results.run_value(rows, by["train-vs-rollout k3 KL"], 0.4, {}) == pytest.approx(2e-3)
    assert results.run_value(rows, by["KV-scale measurement, share of a step"], 0.4, {}) == pytest.approx(0.1 / 5.0)
    assert math.isnan(results.run_value([{"step": 0, "time/step": 2.0}], by["KV-scale measurement, share of a step"], 0.4, {}))
    kl = by["train-vs-rollout k3 KL"]
    assert results._relative(kl, results.SeedStats([2e-3]), results.SeedStats([1e-3])) == "2x"  # the 1.1x target reads off


def _fake_run(study, arm: str, seed: int, k: float, dumps: bool) -> None:
    """A finished 10-step run: metrics rising with k, shadow metrics every 5 steps, final checkpoint, config."""
    d = study.run_dir(arm, seed)
    (d / "checkpoints" / "step_00000009").mkdir(parents=True)
    (d / "checkpoints" / "step_00000009" / "rl_state.pkl").write_bytes(
        pickle.dumps({"step": 9, "eval_before": 0.2, "eval_after": 0.2 + k}))
    (d / "checkpoints" / "step_00000009" / "COMPLETE").write_text("9\n")
    rows = []
    for s in range(10):
        row = {"step": s, "clipfrac_lower_neg": k * 0.01, "clipfrac_upper_pos": 0.02, "entropy": 1.0 + k + 0.01 * s,
               "reward/mean": 0.5, "calib/lower": 0.8, "calib/upper": 1.2}
        if s % 5 == 0:
            row.update({"hp/clipfrac_lower_neg": 0.005, "calib/solve_lower": 0.7, "fp8/log_ratio_abs_err": 0.01 * k})
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.yaml").write_text(yaml.safe_dump({"algo": {"policy_loss": {"eps_low": 0.2, "eps_high": 0.28}}}))
    (d / results.ATTEMPTS_FILE).write_text(json.dumps({"wall_s": 12.0, "returncode": 0}) + "\n")
    if dumps:
        g = np.random.default_rng(seed)
        (d / "calibration").mkdir()
        for step in (0, 5):
            for rank in (0, 1):
                n = 50
                hp = np.exp(g.normal(0, 0.05, n))
                np.savez(d / "calibration" / f"step_{step:06d}.rank{rank}.npz", ratio=hp * np.exp(g.normal(0, 0.02 * k, n)),
                         ratio_hp=hp, adv=g.choice([-1.0, 1.0], n), minibatch=np.full(n, 1, dtype=np.int64))


def test_report_on_synthetic_runs(tmp_path):
    study = load_study(_spec(tmp_path, reference_arm="hp"))
    for seed, k in ((1, 1.0), (2, 3.0)):
        _fake_run(study, "fp8", seed, k, dumps=True)
    _fake_run(study, "hp", 1, 0.5, dumps=False)      # hp seed 2 never ran
    (study.run_dir("hp", 1) / "sft").mkdir()          # as if it had trained its own warm start (warm_start: per_run)
    (study.run_dir("hp", 1) / "sft" / "warm_start.json").write_text(json.dumps({"steps": 730, "stopped_by": "stop_accuracy"}))
    out = write_report(study)
    text = out.read_text()
    assert "3 of 4 runs finished" in text
    assert "Over all 3 finished runs: warm start 20.0-20.0%, after RL 70.0-320.0% (spread 250.0 points), gain +50.0 " \
           "to +300.0 points." in text
    assert "| hp | 1 | done | 10 | 730 (stop_accuracy) | 20.0% -> 70.0% | +50.0 |" in text
    assert "| fp8 | 1 | done | 10 | shared | 20.0% -> 120.0% | +100.0 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| clipfrac_lower_neg |"))  # the results table
    assert row == f"| clipfrac_lower_neg | 0.005 ± 0 [0.005, 0.005] | {results.SeedStats([0.01, 0.03]).cell()} |"
    assert "| clipfrac_lower_neg | 4x |" in text                                         # (0.01+0.03)/2 / 0.005
    assert "held-out accuracy after RL" in text and "20.0% -> 220.0%" not in text
    assert "KV-scale measurement" not in text and "| train-vs-rollout k3 KL |" in text  # no run recalibrated KV scales
    assert "arm `hp`: no calibration token dumps" in text and "arm `fp8`: no" not in text
    assert "`hp` seed 2: missing" in text
    for png in ("curves.png", "bounds.png", "ratio_hist.png"):
        assert (study.out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text
    dump = plots.read_ratio_dumps(study.run_dir("fp8", 2))
    assert dump["ratio"].shape == (200,) and sorted(set(dump["step"].tolist())) == [0, 5]
    neg, pos = plots.log_ratio_error(dump)
    assert neg.size + pos.size == 200 and 0.02 < np.concatenate([neg, pos]).std() < 0.1
    assert plots.read_ratio_dumps(study.run_dir("hp", 1)) is None


def test_dump_reader_rejects_incomplete_files(tmp_path):
    (tmp_path / "calibration").mkdir()
    np.savez(tmp_path / "calibration" / "step_000001.rank0.npz", ratio=np.ones(3), adv=np.ones(3))
    with pytest.raises(ValueError, match="ratio_hp"):
        plots.read_ratio_dumps(tmp_path)


def test_changed_spec_never_mixes_with_existing_runs(tmp_path):
    study = load_study(_spec(tmp_path))
    cfg = study.run_config("fp8", 1, [])
    d = study.run_dir("fp8", 1)
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    check_existing_runs(study, [])  # same config: fine
    changed = load_study(_spec(tmp_path, arms=[{"name": "hp"}, {"name": "fp8", "overrides": {"precision.recipe": "tensorwise"}}]))
    with pytest.raises(StudyError, match="precision.recipe: 'blockwise' -> 'tensorwise'"):
        check_existing_runs(changed, [])


def test_fields_added_since_and_calibration_defaults_of_uncalibrated_runs_do_not_refuse_a_run(tmp_path):
    study = load_study(_spec(tmp_path))
    d = study.run_dir("fp8", 1)
    d.mkdir(parents=True)
    record = study.run_config("fp8", 1, []).model_dump(mode="json")
    del record["algo"]["experimental"]  # a run made before that section existed
    record["algo"]["calibration"]["calibrate_every"] = 7  # an old calibration default, calibration off
    (d / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    check_existing_runs(study, [])
    record["algo"]["calibration"]["enabled"] = True  # a calibrated run: its calibration settings count
    (d / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    with pytest.raises(StudyError, match=f"algo.calibration.calibrate_every: 7 -> {study.run_config('fp8', 1, []).algo.calibration.calibrate_every}"):
        check_existing_runs(study, [])
    record["algo"]["calibration"].update(enabled=False, calibrate_every=20)
    record["train"]["no_longer_a_field"] = 1
    (d / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    with pytest.raises(StudyError, match="train.no_longer_a_field: 1 -> '.no such field now.'"):
        check_existing_runs(study, [])


def test_a_run_made_before_a_behaviour_changing_field_is_refused(tmp_path):
    study = load_study(_spec(tmp_path))
    d = study.run_dir("fp8", 1)
    d.mkdir(parents=True)
    record = study.run_config("fp8", 1, []).model_dump(mode="json")
    del record["train"]["old_logprob_batches"]  # made before pi_old followed the update's micro-batches
    (d / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    with pytest.raises(StudyError, match="train.old_logprob_batches: 'rollout' .before the field existed. -> 'update'"):
        check_existing_runs(study, [])
    # the same record is reused where the spec asks for what it did
    rollout = load_study(_spec(tmp_path, overrides={"train.old_logprob_batches": "rollout"}))
    check_existing_runs(rollout, [])
    # a record holding removed calibration fields: reused where they are what the code now always does (or were read
    # only by a removed rule, which its strength shows), refused where they are not
    full = load_study(_spec(tmp_path, overrides={"algo.calibration.enabled": True, "algo.calibration.strength": "full"}))
    record = full.run_config("fp8", 1, []).model_dump(mode="json")
    record["algo"]["calibration"].update(lower_target="event_alpha", target_events=1, on_policy_bounds="open", seed=3,
                                         gate_opens_to="solved_bounds", excess_tolerance=1.0, hist_log_min=-4.0)
    (d / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    check_existing_runs(full, [])
    for field, value in (("on_policy_bounds", "held"), ("lower_target", "agreement"), ("target_events", 4)):
        (d / "config.yaml").write_text(yaml.safe_dump({**record, "algo": {**record["algo"], "calibration": {
            **record["algo"]["calibration"], field: value}}}, sort_keys=False))
        with pytest.raises(StudyError, match=f"algo.calibration.{field}: {value!r} -> '.no such field now.'"):
            check_existing_runs(full, [])
    record["algo"]["calibration"].update(strength="gated")
    (d / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    with pytest.raises(StudyError, match="algo.calibration.strength: 'gated' -> 'full'"):
        check_existing_runs(full, [])
    # a warm start (SFT) reads no such field: one recorded before it existed is still the same warm start
    cfg = study.warm_start_config()
    record = config_record(cfg)
    del record["train"]["old_logprob_batches"]
    study.warm_dir.mkdir(parents=True)
    (study.warm_dir / WARM_START_RECORD).write_text(yaml.safe_dump(record, sort_keys=False))
    _check_warm_start_config(study, cfg)


@pytest.mark.slow
def test_smoke_study_runs_resumes_and_skips(tmp_path):
    """2 arms x 1 seed x 2 steps from one SFT (both FP4 recipes end to end); a run killed after step 0 resumes;
    finished runs are skipped."""
    spec = _spec(tmp_path, steps=2, seeds=[1], checkpoint_every=1,
                 overrides={"sft.steps": 60, "sft.eval_every": 0, "sft.stop_accuracy": None, "data.num_train_prompts": 200,
                            "data.num_eval_prompts": 8,
                            "train.eval_max_prompts": 8, "train.prompts_per_step": 4, "rollout.n_samples_per_prompt": 4,
                            "train.micro_batch_size": 4},
                 arms=[{"name": "mxfp4", "overrides": {"precision.recipe": "mxfp4"}},
                       {"name": "nvfp4_calib", "overrides": {
                           "precision.recipe": "nvfp4", "algo.calibration.enabled": True, "algo.calibration.strength": "full",
                           "algo.calibration.calibrate_every": 1}}])
    cmd = [sys.executable, str(REPO / "tools" / "experiment.py"), str(spec)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    study = load_study(spec)
    text = (study.out / "RESULTS.md").read_text()
    assert "2 of 2 runs finished" in text and "| mxfp4 | nvfp4_calib |" in text
    assert (study.out / "curves.png").exists()
    rows = {arm: results.read_rows(study.run_dir(arm, 1)) for arm in ("mxfp4", "nvfp4_calib")}
    assert all(len(r) == 2 for r in rows.values())
    # The FP4 shadow's ratio error is measured on every step. Since pi_old is forwarded in the update's own micro-batches,
    # a step whose advantages are all 0 (60 SFT steps rarely solve a prompt) moves no weight: its error is a true 0.
    for r in rows["nvfp4_calib"]:
        err = r.get("fp8/log_ratio_abs_err")
        assert err is not None and math.isfinite(err) and err >= 0, r
        if r.get("adv/abs_mean", 0) > 0:
            assert err > 0, r

    # "kill" the FP4 run after step 0: drop its final checkpoint, keep the step-0 one
    run = study.run_dir("nvfp4_calib", 1)
    final = run / "checkpoints" / "step_00000001"
    assert (run / "checkpoints" / "step_00000000" / "COMPLETE").exists()
    import shutil

    shutil.rmtree(final)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "mxfp4 seed 1: finished, skipped" in second.stdout
    assert "nvfp4_calib seed 1: resuming at step 1" in second.stdout
    assert "warm start: reusing" in second.stdout
    assert (study.warm_dir / "sft.log").read_text().count("\n=== ") == 1      # one SFT for the whole study
    assert len(results.read_rows(run)) == 2 and final.exists()
    attempts = [json.loads(x) for x in (run / results.ATTEMPTS_FILE).read_text().splitlines()]
    assert [a["resumed_from_step"] for a in attempts] == [0, 1]


@pytest.mark.parametrize("spec", sorted((REPO / "examples" / "studies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_study_loads(spec):
    study = load_study(spec)
    assert study.runs()


def test_search_stages_reuse_the_earlier_stages_runs():
    """docs/results.md's search: each stage shares the previous stage's directory and leaves its runs' configs
    unchanged, so the runner skips them instead of refusing the directory."""
    stages = [load_study(REPO / "examples" / "studies" / name)
              for name in ("search1_screen.yaml", "search2_seeds.yaml", "search3_per_minibatch.yaml")]
    for earlier, later in zip(stages, stages[1:]):
        assert later.out == earlier.out
        warm_e, warm_l = earlier.warm_overrides(), later.warm_overrides()
        assert warm_e == warm_l
        for arm, seed in earlier.runs():
            assert (arm, seed) in later.runs()
            assert earlier.run_config(arm, seed, warm_e) == later.run_config(arm, seed, warm_l), (arm, seed)


def test_paired_summary_against_brute_force():
    from itertools import product

    from megatron_rl.study.dose import paired_summary

    diffs = [3.0, -1.0, 2.5, 4.0, -0.5, 1.5]
    st = paired_summary(diffs)
    d = np.array(diffs)
    assert (st["n"], st["above"], st["below"]) == (6, 4, 2)
    assert st["mean"] == pytest.approx(d.mean()) and st["sd"] == pytest.approx(d.std(ddof=1))
    assert st["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(6))
    # exact sign flips, counted independently: arrangements whose |mean| reaches the observed one
    hits = sum(abs(np.dot(s, d)) / 6 >= abs(d.mean()) - 1e-12 for s in product((-1, 1), repeat=6))
    assert st["p"] == pytest.approx(hits / 64)
    assert st["lo"] < d.mean() < st["hi"] and min(diffs) <= st["lo"] and st["hi"] <= max(diffs)
    # a difference of one sign on every seed: only the two all-same-sign arrangements reach it
    assert paired_summary([1.0, 2.0, 3.0, 4.0, 5.0])["p"] == pytest.approx(2 / 32)
    # Monte Carlo beyond 2^n > resamples: close to the exact value
    many = list(np.random.default_rng(3).normal(0.5, 2.0, 20))
    exact = np.mean([abs(np.dot(s, many)) / 20 >= abs(np.mean(many)) - 1e-12
                     for s in np.random.default_rng(4).choice((-1, 1), size=(200_000, 20))])
    assert paired_summary(many)["p"] == pytest.approx(exact, abs=0.02)
    one = paired_summary([2.0, float("nan")])
    assert one["n"] == 1 and one["mean"] == 2.0 and math.isnan(one["p"]) and math.isnan(one["lo"])


def test_dose_report_pairs_each_variant_with_vanilla_seed_by_seed(tmp_path):
    from megatron_rl.study.dose import write_dose_report

    arms = [{"name": "hp", "overrides": {}},
            {"name": "fp8", "overrides": {"precision.recipe": "blockwise"}},
            {"name": "fp8_calib", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True}},
            {"name": "fp8_k4", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 4.0}}]
    study = load_study(_spec(tmp_path, arms=arms, seeds=[1, 2, 3]))
    # eval_after = 0.2 + k: calib - vanilla = +0.10, -0.05, +0.20 by seed; hp ran seeds 1 and 2 only; fp8_k4 seed 3 only
    for arm, seed, k in (("fp8", 1, 0.5), ("fp8", 2, 0.6), ("fp8", 3, 0.4), ("fp8_calib", 1, 0.6), ("fp8_calib", 2, 0.55),
                         ("fp8_calib", 3, 0.6), ("hp", 1, 0.7), ("hp", 2, 0.7), ("fp8_k4", 3, 0.3)):
        _fake_run(study, arm, seed, k, dumps=False)
    text = write_dose_report(study).read_text()
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:-1]]
            for ln in text.splitlines() if ln.startswith("| ") and " - " in ln.split("|")[1]}
    calib = rows[("calibrated k=1 - vanilla", "held-out accuracy after RL (points)")]
    assert calib[0] == "3" and calib[1] == "+8.33" and calib[5] == "2 / 1" and calib[6] == "+10.00 -5.00 +20.00"
    # sign flips of (10, -5, 20): sums +-25 (as observed, all flipped) and +-35 (-5 flipped alone, or it alone kept)
    # reach |sum| 25; the other four (+-15, +-5) do not
    assert calib[4] == f"{4 / 8:.3f}"
    harm = rows[("vanilla k=1 - hp", "held-out accuracy after RL (points)")]
    assert harm[0] == "2" and harm[6] == "-20.00 -10.00" and harm[5] == "0 / 2"
    assert not any(pair.startswith("vanilla k=4") for pair, _ in rows)  # no reference seed beside its one seed


def test_dose_report_pairs_every_arm_with_the_perfect_clip_decision_at_k0(tmp_path):
    from megatron_rl.study.dose import write_dose_report

    arms = [{"name": "hp", "overrides": {}},
            {"name": "fp8", "overrides": {"precision.recipe": "blockwise"}},
            {"name": "fp8_k0", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 0.0}},
            {"name": "fp8_k8", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 8.0}},
            {"name": "fp8_calib_k8", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 8.0,
                                                   "algo.calibration.enabled": True, "algo.calibration.shadow_fraction": 1.0}}]
    study = load_study(_spec(tmp_path, arms=arms, seeds=[1, 2]))
    # eval_after = 0.2 + k
    for arm, seed, k in (("hp", 1, 0.7), ("hp", 2, 0.6), ("fp8", 1, 0.65), ("fp8", 2, 0.6), ("fp8_k0", 1, 0.7),
                         ("fp8_k0", 2, 0.65), ("fp8_k8", 1, 0.4), ("fp8_k8", 2, 0.5), ("fp8_calib_k8", 1, 0.5),
                         ("fp8_calib_k8", 2, 0.45)):
        _fake_run(study, arm, seed, k, dumps=False)
    text = write_dose_report(study).read_text()
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:-1]]
            for ln in text.splitlines() if ln.startswith("| ") and " - " in ln.split("|")[1]}
    metric = "held-out accuracy after RL (points)"
    assert rows[("vanilla k=1 - vanilla k=0", metric)][6] == "-5.00 -5.00"
    assert rows[("vanilla k=8 - vanilla k=0", metric)][6] == "-30.00 -15.00"
    assert rows[("calibrated k=8 - vanilla k=0", metric)][6] == "-20.00 -20.00"
    assert rows[("vanilla k=0 - hp", metric)][6] == "+0.00 +5.00"
    assert rows[("calibrated k=8 - vanilla", metric)][6] == "+10.00 -5.00"
    assert not any(pair.startswith("vanilla k=0 - vanilla") for pair, _ in rows)
    assert (study.report_out / "dose.png").read_bytes()[:4] == b"\x89PNG"


def test_dose_report_pairs_the_k_free_default_with_vanilla_at_every_k(tmp_path):
    """strength=decision trains the same at any k: one run per seed is
    paired with vanilla at k = 1 and at k = 8; a full-strength arm, whose bounds follow k, is not."""
    from megatron_rl.study.dose import write_dose_report

    arms = [{"name": "hp", "overrides": {}},
            {"name": "fp8", "overrides": {"precision.recipe": "blockwise"}},
            {"name": "fp8_k8", "overrides": {"precision.recipe": "blockwise", "algo.experimental.clip_error_scale": 8.0}},
            {"name": "fp8_default", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True,
                                                  "algo.calibration.strength": "decision"}},
            {"name": "fp8_full", "overrides": {"precision.recipe": "blockwise", "algo.calibration.enabled": True,
                                               "algo.calibration.strength": "full"}}]
    study = load_study(_spec(tmp_path, arms=arms, seeds=[1, 2]))
    # eval_after = 0.2 + k
    for arm, seed, k in (("hp", 1, 0.7), ("hp", 2, 0.6), ("fp8", 1, 0.65), ("fp8", 2, 0.6), ("fp8_k8", 1, 0.4),
                         ("fp8_k8", 2, 0.5), ("fp8_default", 1, 0.6), ("fp8_default", 2, 0.65), ("fp8_full", 1, 0.5),
                         ("fp8_full", 2, 0.45)):
        _fake_run(study, arm, seed, k, dumps=False)
    text = write_dose_report(study).read_text()
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:-1]]
            for ln in text.splitlines() if ln.startswith("| ") and " - " in ln.split("|")[1]}
    metric = "held-out accuracy after RL (points)"
    assert rows[("calibrated, strength=decision k=1 - vanilla", metric)][6] == "-5.00 +5.00"
    assert rows[("calibrated, strength=decision (any k) - vanilla k=8", metric)][6] == "+20.00 +15.00"
    assert not any("strength=full (any k)" in pair for pair, _ in rows)
    assert rows[("calibrated, strength=full k=1 - vanilla", metric)][6] == "-15.00 -15.00"


def _assert_shared_runs_agree(spec: str, others: tuple[str, ...]) -> int:
    """Every (arm, seed) run `spec` shares with `others` (same directory and warm start) has the same config, or the
    runner would refuse the directory; returns how many are shared."""
    study = load_study(REPO / "examples" / "studies" / spec)
    warm = study.warm_overrides()
    shared = 0
    for name in others:
        other = load_study(REPO / "examples" / "studies" / name)
        assert other.out == study.out and other.warm_overrides() == warm
        for arm, seed in other.runs():
            if (arm, seed) in study.runs():
                shared += 1
                assert other.run_config(arm, seed, warm) == study.run_config(arm, seed, warm), (name, arm, seed)
    return shared


def test_the_many_seed_and_harm_specs_reuse_the_runs_they_share():
    """deep_addtrace_dose_seeds.yaml pairs seeds 1-6 of deep_addtrace_dose.yaml / _heldout.yaml with new seeds;
    calibration_harm_small.yaml shares calibration_tracking_heldout.yaml's runs."""
    # hp and the four dose-end arms on seeds 1-6
    assert _assert_shared_runs_agree("deep_addtrace_dose_seeds.yaml",
                                     ("deep_addtrace_dose.yaml", "deep_addtrace_dose_heldout.yaml")) == 5 * 6
    # hp and the two k = 4 arms on seeds 1-3
    assert _assert_shared_runs_agree("deep_addtrace_dose_k4_seeds.yaml", ("deep_addtrace_dose.yaml",)) == 3 * 3
    # hp, vanilla, the default and the high-precision clip decision (k = 0) on seeds 10-19
    assert _assert_shared_runs_agree("calibration_harm_small.yaml", ("calibration_tracking_heldout.yaml",)) == 4 * 10
    # hp and vanilla NVFP4 on seeds 1-3; its k = 0 arm also pairs with the FP8 k = 0 runs' hp
    assert _assert_shared_runs_agree("deep_addtrace_nvfp4_k0.yaml", ("deep_addtrace_grpo.yaml",)) == 2 * 3
    assert _assert_shared_runs_agree("deep_addtrace_nvfp4_k0.yaml", ("deep_addtrace_dose_seeds.yaml",)) == 12
    # hp and the clip decided on the high-precision ratio (k = 0) on seeds 1-9
    assert _assert_shared_runs_agree("deep_addtrace_dose_k4_seeds.yaml", ("deep_addtrace_dose_seeds.yaml",)) == 2 * 9


def test_frontier_groups_arms_into_settings_pairs_them_with_vanilla_and_plans_their_cost(tmp_path):
    """A frontier study: k-free settings (high-precision learner, decision) fill both k columns from one arm, k-dependent
    ones pair their k = 1 and k = 8 arms, each against vanilla FP8 seed by seed; the planned cost carries the setting's
    calibration (decision costs far more than 5% of vanilla's learner, targeted does not)."""
    from megatron_rl.study.frontier import plan_overrides, settings, write_frontier_report

    fp8 = {"precision.recipe": "blockwise"}
    cal = {**fp8, "algo.calibration.enabled": True}
    arms = [{"name": "hp", "overrides": {}},
            {"name": "split", "overrides": {"precision.rollout_quantization": "fp8-blockwise"}},
            {"name": "fp8", "overrides": fp8},
            {"name": "fp8_k8", "overrides": {**fp8, "algo.experimental.clip_error_scale": 8.0}},
            {"name": "decision", "overrides": {**cal, "algo.calibration.strength": "decision"}},
            {"name": "targeted", "overrides": {**cal, "algo.calibration.strength": "targeted"}},
            {"name": "targeted_k8", "overrides": {**cal, "algo.calibration.strength": "targeted",
                                                  "algo.experimental.clip_error_scale": 8.0}}]
    study = load_study(_spec(tmp_path, arms=arms, seeds=[1, 2], frontier=True))
    groups = {s.name: s for s in settings(study)}
    assert list(groups) == ["hp", "split", "fp8", "decision", "targeted"]
    assert groups["targeted"].arms == {1.0: "targeted", 8.0: "targeted_k8"} and not groups["targeted"].k_free
    assert groups["decision"].k_free and groups["hp"].k_free and groups["split"].k_free
    assert groups["decision"].arm_at(8.0) == "decision" and groups["fp8"].arm_at(8.0) == "fp8_k8"
    assert [s.name for s in groups.values() if s.vanilla] == ["fp8"]
    assert "algo.calibration.strength=targeted" in plan_overrides(groups["targeted"])
    assert "precision.recipe=none" in plan_overrides(groups["hp"])
    assert "precision.rollout_quantization=fp8-blockwise" in plan_overrides(groups["split"])
    # eval_after = 0.2 + k
    for arm, seed, k in (("hp", 1, 0.8), ("hp", 2, 0.8), ("split", 1, 0.7), ("split", 2, 0.75), ("fp8", 1, 0.6),
                         ("fp8", 2, 0.65), ("fp8_k8", 1, 0.3), ("fp8_k8", 2, 0.4), ("decision", 1, 0.7),
                         ("decision", 2, 0.7), ("targeted", 1, 0.6), ("targeted", 2, 0.7), ("targeted_k8", 1, 0.5)):
        _fake_run(study, arm, seed, k, dumps=False)
    out = write_frontier_report(study)
    text = out.read_text()
    assert (out.parent / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    k1, k8 = text.split("## Quality at k = 8")
    line = lambda part, name: next(ln for ln in part.splitlines() if ln.startswith(f"| `{name}` |"))
    cells = lambda part, name: [c.strip() for c in line(part, name).split("|")[1:-1]]
    assert line(k1, "fp8").endswith("| 50.0 | (vanilla) | 82.5 | (vanilla) |")  # reward/mean is 0.5 in every fake run
    assert cells(k1, "decision")[4:6] == ["90.0", "+7.5 [+5.0, +10.0], p 0.50"]
    assert cells(k8, "decision")[4:6] == ["90.0", "+35.0 [+30.0, +40.0], p 0.50"]  # one run, both k
    assert cells(k8, "targeted")[1] == "1"   # seed 2's k = 8 run is missing: one seed, paired on seed 1
    assert cells(k8, "targeted")[5] == "+20.0"
    cost = text.split("## Cost")[1]
    ratio = lambda name: [float(c) for c in cells(cost, name)[2::4][:2]]  # 8B and 32B x vanilla
    assert ratio("fp8") == [1.0, 1.0]
    assert all(r > 1.2 for r in ratio("decision")) and all(1.0 < r <= 1.05 for r in ratio("targeted"))
    assert all(r > 1.1 for r in ratio("hp")) and ratio("split") == ratio("hp")
