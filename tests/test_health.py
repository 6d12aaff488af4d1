"""Health verdicts (phases/health.py) on constructed step metrics: which signal trips, which weight version its evidence
condemns, and which checkpoint retention keeps; checkpoints set aside by a stop are never loaded (trainer/checkpoint.py)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_rl.config.train import HealthConfig
from megatron_rl.phases.health import HealthGuard
from megatron_rl.trainer import checkpoint as ckpt


def _guard(lag: int = 0, **cfg) -> HealthGuard:
    return HealthGuard(HealthConfig(**cfg), vocab_size=64, updates_per_step=2, rollout_lag=lag)


def _step(entropy_before=0.5, entropy_after=0.45, reward=0.4, version=None, **extra) -> dict[str, float]:
    """A step's metrics: probe entropies before / after the updates, the rollout reward and version, pi_old's entropy."""
    m = {"health/probe_entropy_before": entropy_before, "health/probe_entropy": entropy_after, "reward/mean": reward,
         "entropy_old": entropy_before}
    if version is not None:
        m["rollout/weight_version"] = float(version)
    return {**m, **extra}


def test_collapse_toward_deterministic_condemns_only_the_new_weights():
    guard = _guard()
    assert guard._decide(True, _step(0.5, 0.2), step=0)[0] is None  # a big but plausible drop
    stop, condemned, _ = guard._decide(True, _step(0.5, 0.0002), step=1)
    assert stop.startswith("training stopped at step 1: policy entropy fell from 0.5 to 0.0002 nats")
    assert "train.health.collapse_step_entropy_frac=0.02" in stop and condemned == 2  # never synced nor saved
    assert _guard(collapse_step_entropy_frac=None)._decide(True, _step(0.5, 0.0002), step=1)[0] is None


def test_collapse_onto_wrong_answers_needs_a_reward_that_fell_and_an_entropy_that_fell():
    guard = _guard(collapse_step_entropy_frac=None)
    # reward 0 from the start (a task the model cannot do yet) is no collapse, however confident the policy
    assert guard._decide(True, _step(0.40, 0.40, reward=0.0, version=0), step=0)[0] is None
    assert guard._decide(True, _step(0.01, 0.01, reward=0.0, version=1), step=1)[0] is None
    assert guard._decide(True, _step(0.30, 0.30, reward=0.5, version=2), step=2)[0] is None
    assert guard._decide(True, _step(0.11, 0.11, reward=0.0, version=3), step=3)[0] is None  # entropy 0.275 of its peak
    assert guard._decide(True, _step(0.01, 0.01, reward=0.9, version=4), step=4)[0] is None  # sharp, and right
    stop, condemned, _ = guard._decide(True, _step(0.0665, 0.0007, reward=0.0, version=5), step=5)
    assert "train reward fell to 0 (<= train.health.collapse_reward=0.0; it was 0.9) with policy entropy 0.0665" in stop
    assert "collapse_entropy_frac=0.25 of the run's highest 0.4" in stop
    assert condemned == 5  # the weights that generated (and scored) the samples


@pytest.mark.parametrize("lag", [0, 1])
def test_reward_evidence_condemns_the_version_that_generated_the_rollouts(lag):
    """Sync: step s samples come from version s; one_step_off: from s-1 (engines' report, or the lag when absent)."""
    guard = _guard(lag, reward_drop=0.5, window=1)
    for step in range(4):
        assert guard._decide(True, _step(reward=1.0), step=step)[0] is None
    assert guard.vouched_version == 3 - lag
    stop, condemned, _ = guard._decide(True, _step(reward=0.0), step=4)
    assert "train.health.reward_drop=0.5" in stop and condemned == 4 - lag
    assert guard.vouched_version == 3 - lag  # a stop vouches for nothing
    reported = _guard(lag, reward_drop=0.5, window=1)
    reported._decide(True, _step(reward=1.0, version=0), step=0)
    assert reported._decide(True, _step(reward=0.0, version=1), step=3)[1] == 1  # the engines' report wins


def test_several_signals_condemn_the_oldest_version_any_of_them_judges():
    guard = _guard(reward_drop=0.5, window=1)
    guard._decide(True, _step(reward=1.0, version=4), step=4)
    stop, condemned, _ = guard._decide(True, _step(0.5, 0.0001, reward=0.0, version=5), step=5)
    assert "collapse_step_entropy_frac" in stop and "reward_drop" in stop and condemned == 5


def test_the_defaults_leave_healthy_looking_steps_alone():
    guard = _guard()
    for step, (before, after, reward) in enumerate([(0.45, 0.44, 0.3), (0.05, 0.018, 0.9), (0.03, 0.012, 1.0),
                                                     (0.3, 0.2, 0.0), (0.02, 0.02, 0.95)]):
        assert guard._decide(True, _step(before, after, reward), step=step)[0] is None
    assert math.isfinite(guard.peak_reward) and guard.vouched_version == 4


def test_guard_state_round_trips_and_reads_older_checkpoints():
    guard = _guard()
    guard._decide(True, _step(reward=0.7, version=0), step=0)
    fresh = _guard()
    fresh.load_state_dict(guard.state_dict())
    assert fresh.state_dict() == guard.state_dict()
    old = {k: v for k, v in guard.state_dict().items() if k not in ("peak_reward", "vouched_version")}
    fresh.load_state_dict(old)
    assert fresh.peak_reward == -math.inf and fresh.vouched_version == 0


def _fake_checkpoint(root: Path, step: int) -> None:
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / ckpt.COMPLETE_MARKER).write_text(f"{step}\n")


def test_rejected_checkpoints_are_renamed_never_loaded_and_retention_keeps_the_protected_one(tmp_path):
    for step in range(5):
        _fake_checkpoint(tmp_path, step)
    removed = ckpt.apply_retention(tmp_path, keep_last=2, protect=tmp_path / ckpt.step_dir_name(1))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 3, 4] and len(removed) == 2
    moved = ckpt.reject_checkpoints(tmp_path, 3, "training stopped at step 5: why")
    assert [Path(m).name for m in moved] == ["rejected_step_00000003", "rejected_step_00000004"]
    assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "step_00000001")
    assert (tmp_path / "rejected_step_00000004" / "REJECTED").read_text() == "training stopped at step 5: why\n"
    _fake_checkpoint(tmp_path, 3)  # the resumed run saves step 3 again, and a later stop rejects it again
    assert [Path(m).name for m in ckpt.reject_checkpoints(tmp_path, 2, "again")] == ["rejected_step_00000003.1"]
    assert ckpt.apply_retention(tmp_path, keep_last=1) == [] and (tmp_path / "rejected_step_00000003").is_dir()
