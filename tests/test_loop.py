"""The RL loop end to end through `megatron-rl train`: FP8 blockwise learner, FP8 blockwise rollouts from an
embedded engine subprocess, Calibrated Clipping every step; and the CLI's answers to bad input."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calibration_spec import check_run_dumps, load_dumps
from rl_runs import CONFIG, cli_env, tiny_overrides, train, warm_start

from megatron_rl.data.tokenizer import build_char_tokenizer

QUANTILES = ("q0.1", "q1", "q50", "q99", "q99.9")
# docs/CALIBRATED_CLIPPING.md section 4, split by when each is defined.
ALWAYS = ("clipfrac", "calib/lower", "calib/upper", "calib/alpha_target", "entropy",
          "tis_weight_mean", "tis_clipfrac", "mismatch_abs_dlogp", "mismatch_k3_kl", "token_mult_prob_error",
          "hp/clipfrac")
# Over all the step's tokens: a step with reward spread has both signs.
NEEDS_NEG = ("clipfrac_lower_neg", *(f"ratio_neg_{q}" for q in QUANTILES))
NEEDS_BOTH_SIGNS = ("clipfrac_upper_pos", *(f"ratio_pos_{q}" for q in QUANTILES))
# Shadow metrics and the solve cover only the shadow mini-batches (not the on-policy first one), which may hold one
# sign only (which one depends on the machine's rollouts): rho_target is inf (null) when the first solve saw no
# negative mass, alpha_achieved is null exactly when the solve had no negative tokens.
SHADOW_BY_SIGN = ("hp/clipfrac_lower_neg", "hp/clipfrac_upper_pos", "calib/rho_target", "calib/alpha_achieved",
                  "calib/rho_achieved")


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """The session's tiny warm start."""
    return warm_start(tmp_path_factory)


def _finite(row: dict, key: str) -> bool:
    return isinstance(row.get(key), (int, float)) and math.isfinite(row[key])


@pytest.mark.slow
def test_two_step_fp8_calibrated_run(warm, tmp_path):
    run_dir = tmp_path / "run"
    rows = train(run_dir, tiny_overrides(warm, "train.steps=2", "tracking.dump_ratios=true", "tracking.plots=true"))
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for key in ALWAYS + NEEDS_NEG + NEEDS_BOTH_SIGNS + SHADOW_BY_SIGN:
            assert key in r, f"step {r['step']}: metric {key} missing"
        for key in SHADOW_BY_SIGN[:2]:
            assert r[key] is None or 0.0 <= r[key] <= 1.0
        _, solved = load_dumps(run_dir, r["step"])
        assert (r["calib/alpha_achieved"] is not None) == bool((solved["adv"] < 0).any()), r["step"]
        # a group with reward spread has tokens of both advantage signs (GRPO centres each group),
        # so every section-4 metric is defined on such a step
        spread = r["groups/no_spread_frac"] < 1.0
        must = ALWAYS + ((NEEDS_NEG + NEEDS_BOTH_SIGNS) if spread else ())
        bad = [k for k in must if not _finite(r, k)]
        assert not bad, f"step {r['step']}: not finite: {bad}"
        # the engine served the weights pushed after the previous step (version 0 = the warm start)
        assert r["rollout/weight_version"] == r["step"]
        # consistency checks against independent quantities of the same step
        assert r["token_mult_prob_error"] >= math.exp(r["mismatch_abs_dlogp"]) - 1e-12  # Jensen
        assert r["mismatch_k3_kl"] >= 0.0
        assert 0.0 <= r["clipfrac"] <= 1.0 and 0.0 < r["tis_weight_mean"] <= 2.0
        if spread:
            # alpha is the pooled shadow fraction of A<0 tokens below 1 - eps_low: exactly hp/clipfrac_lower_neg
            if _finite(r, "hp/clipfrac_lower_neg"):
                assert r["calib/alpha_target"] == pytest.approx(r["hp/clipfrac_lower_neg"], abs=1e-9)
            for side in ("neg", "pos"):
                qs = [r[f"ratio_{side}_{q}"] for q in QUANTILES]
                assert qs == sorted(qs)
    assert any(r["groups/no_spread_frac"] < 1.0 for r in rows), "no step had reward spread: the test would prove little"
    # every step calibrates (calibrate_every=1): its unsmoothed solution is logged, and an independent
    # implementation of the spec recomputes it from the dumped tokens (FP8 learner, allgather backend)
    assert all("calib/solve_lower" in r and "calib/solve_upper_raw" in r for r in rows)
    assert check_run_dumps(run_dir, rows, ranks=1, eps_low=0.2, eps_high=0.2, quantile="next_tokens") == [0, 1]
    summary = (run_dir / "summary.txt").read_text()
    assert "calibrated L / H (final)" in summary and "steps" in summary
    plots = {p.name for p in (run_dir / "plots").glob("*.png")}
    assert plots == {"reward.png", "entropy.png", "clipfrac.png", "bounds.png"}
    assert f"plots: {run_dir / 'plots'}/{{" in summary
    # the same command again: one line saying the run is complete, nothing started, the summary left as it was
    before = (run_dir / "summary.txt").stat()
    proc, _ = _cli(["train", str(CONFIG), f"run_dir={run_dir}", *tiny_overrides(warm, "train.steps=2", "tracking.plots=true")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"run already complete: {run_dir} finished its 2 steps"), proc.stdout
    assert len(proc.stdout.splitlines()) == 1 and "Warning" not in proc.stderr
    after = (run_dir / "summary.txt").stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)


def _cli(args: list[str], timeout: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_cli_unknown_config_key_is_named(tmp_path):
    proc, _ = _cli(["train", str(CONFIG), f"run_dir={tmp_path / 'run'}", "train.bogus_key=3"])
    assert proc.returncode != 0
    assert "train.bogus_key" in proc.stderr and "unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_malformed_jsonl_names_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    good = '{"prompt": "1+2=", "answer": "3"}\n'
    data.write_text(good * 3 + '{"prompt": "2+2=", "answer": \n' + good)
    tokenizer = tmp_path / "tok"
    build_char_tokenizer(tokenizer)
    proc, _ = _cli(["train", str(CONFIG), f"run_dir={tmp_path / 'run'}", f"data.train_file={data}",
                    f"data.tokenizer_dir={tokenizer}", "data.num_train_prompts=16", "data.num_eval_prompts=0"])
    assert proc.returncode == 2
    assert f"{data}:4" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # found before any work: the run directory (config.yaml, SFT, checkpoints) was never created
    assert not (tmp_path / "run").exists()


def test_cli_missing_train_file_is_one_error_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc, _ = _cli(["train", str(CONFIG), f"run_dir={tmp_path / 'run'}", f"data.train_file={missing}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: data.train_file: file not found: {missing}", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr


def test_cli_unreachable_external_server_fails_fast(tmp_path):
    run_dir = tmp_path / "run"
    proc, elapsed = _cli(["train", str(CONFIG), f"run_dir={run_dir}", "rollout.engine=external",
                          "rollout.urls=[http://127.0.0.1:9]", "rollout.startup_timeout_s=2", "rollout.max_retries=1"],
                         timeout=120)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "http://127.0.0.1:9" in proc.stderr and "not healthy" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # checked before the warm start: the user does not wait for an SFT run that cannot be used
    assert not (run_dir / "sft").exists()
    assert elapsed < 60
