"""The log-probs phase and StepCalibration do exactly what the CalibrationPlan names (a recording fake learner,
world of one): shadow forwards only on the shadow rows (their cost falls with shadow_fraction), the per_minibatch
pre-pass on off-policy updates only, the on-policy first update never feeding a solve."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algo.losses import log_ratio
from megatron_rl.algo.calibration import CalibrationTargets
from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.config import load_config
from megatron_rl.parallel import state
from megatron_rl.phases import batching, logprobs
from megatron_rl.phases.calibrate import StepCalibration
from megatron_rl.precision import high_precision_active
from megatron_rl.types import TrainBatch


class RecordingLearner:
    """forward_logprobs returns a fixed function of each row's tokens (different in high precision) and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, list[int]]] = []

    def forward_logprobs(self, batch: TrainBatch, micro_batch_size: int):
        assert batch.batch_size % micro_batch_size == 0, "forwards run whole micro-batches"
        hp = high_precision_active()
        self.calls.append((hp, batch.sample_index.tolist()))
        lp = -(batch.input_ids.float() % 7) / 10 - (0.01 if hp else 0.0)
        return lp, torch.zeros_like(lp)


@pytest.fixture
def world_of_one(monkeypatch):
    for name, value in (("dp_rank", 0), ("dp_size", 1), ("cp_rank", 0), ("cp_size", 1), ("tp_rank", 0), ("pp_size", 1)):
        monkeypatch.setattr(state, name, lambda value=value: value)
    monkeypatch.setattr(state, "is_last_stage", lambda: True)
    monkeypatch.setattr(state, "dp_group", lambda: None)
    monkeypatch.setattr(state, "dp_cp_group", lambda: None)


def _batch(rows: int = 16, seq: int = 10) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (rows, seq), generator=g)
    mask = (torch.arange(seq)[None] >= 3).float().expand(rows, seq).contiguous()
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq) * mask
    return TrainBatch(ids, ids, mask, adv, torch.zeros(rows, seq), sample_index=torch.arange(rows))


def _cfg(*overrides: str):
    return load_config(None, ["algo.calibration.enabled=true", "algo.calibration.strength=full", "algo.calibration.calibrate_every=2", "train.num_minibatches=2",
                              "train.micro_batch_size=4", *overrides])


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_shadow_old_logprobs_run_on_the_shadow_rows_only(world_of_one, fraction):
    cfg = _cfg(f"algo.calibration.shadow_fraction={fraction}")
    batch = _batch()
    plan = CalibrationPlan.build(0, cfg.algo.calibration, cfg.train, batch.batch_size)
    learner = RecordingLearner()
    out, metrics = logprobs.old_logprobs(learner, batch, 4, plan=plan)
    hp_rows = [rows for hp, rows in learner.calls if hp]
    assert len(hp_rows) == 1 and set(hp_rows[0]) == set(plan.shadow_rows)  # padded with repeats of a shadow row
    assert len(hp_rows[0]) == -(-len(plan.shadow_rows) // 4) * 4
    assert len(plan.shadow_rows) == round(16 * fraction)
    want_hp = -(batch.input_ids.float() % 7) / 10 - 0.01
    chosen = torch.tensor([i in plan.shadow_rows for i in range(16)])
    assert torch.equal(out.old_logprobs_hp[chosen], want_hp[chosen]) and (out.old_logprobs_hp[~chosen] == 0).all()
    assert metrics["fp8/logprob_abs_err_mean"] == pytest.approx(0.01)
    # an ordinary step runs no shadow forward at all
    learner.calls.clear()
    logprobs.old_logprobs(learner, batch, 4, plan=CalibrationPlan.build(1, cfg.algo.calibration, cfg.train, 16))
    assert [hp for hp, _ in learner.calls] == [False]


@pytest.mark.parametrize("mode", ["per_calibration", "per_minibatch"])
def test_step_calibration_follows_the_plan(world_of_one, mode):
    cfg = _cfg(f"algo.calibration.bounds_update={mode}", "algo.calibration.shadow_fraction=0.5")
    clipper = CalibratedClipper(cfg.algo.calibration, eps_low=0.2, eps_high=0.2)
    clipper.targets = CalibrationTargets.of(0.1, 1.0)  # held from an earlier event
    batch = _batch()
    batch = batch.with_fields(old_logprobs=-(batch.input_ids.float() % 5) / 10)
    for step in (0, 1):
        plan = CalibrationPlan.build(step, cfg.algo.calibration, cfg.train, 16)
        learner = RecordingLearner()
        calib = StepCalibration(clipper, plan, cfg, "/nonexistent")
        taps = []
        for k, mb in enumerate(batching.minibatches(batch, 2, seed=step)):
            mb, bounds, tap = calib.before_update(learner, mb, 0, k)
            taps.append(tap)
        prepasses = [rows for hp, rows in learner.calls if not hp]
        assert step == 0 or not any(hp for hp, _ in learner.calls)  # shadow forwards on the event only
        # a pre-pass only before the off-policy update, only under per_minibatch, over the whole mini-batch
        assert [len(r) for r in prepasses] == ([8] if mode == "per_minibatch" else [])
        # only an event's off-policy update feeds the step's statistics
        assert taps[0] is None and (taps[1] is not None) == (step == 0)
        assert calib.finish()["calib/alpha_target"] == 0.1


class MovingLearner(RecordingLearner):
    """A RecordingLearner whose policy moves: every update shifts each token's log-prob by -shift * (token % 3) / 10."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 0.0

    def policy(self, batch: TrainBatch, hp: bool) -> torch.Tensor:
        """The log-probs of the current policy (FP8 adds a token-dependent offset high precision lacks)."""
        ids = batch.input_ids.float()
        return -(ids % 7) / 10 - self.shift * (ids % 3) / 10 - (0.0 if hp else 0.03 * torch.sin(ids * (1 + self.shift)))

    def forward_logprobs(self, batch: TrainBatch, micro_batch_size: int):
        super().forward_logprobs(batch, micro_batch_size)
        lp = self.policy(batch, high_precision_active())
        return lp, torch.zeros_like(lp)


def test_per_step_solves_every_step_from_the_training_forwards_alone(world_of_one):
    """per_step: an ordinary step runs no forward of its own (its statistics come from the loss of its off-policy
    updates), ends with a solve at the held targets, and the next step trains with that solve; the on-policy update
    trains at the open bounds [lower_min, upper_max]."""
    from megatron_rl.phases.loss import RLLoss

    cfg = _cfg("algo.calibration.calibrate_every=2", "algo.calibration.shadow_fraction=1", "algo.calibration.strength=full")  # partial shadows: test_shadow_rows_*
    assert cfg.algo.calibration.bounds_update == "per_step"
    clipper = CalibratedClipper(cfg.algo.calibration, eps_low=0.2, eps_high=0.2)
    batch = _batch(rows=32)
    learner = MovingLearner()
    held = []
    for step in (0, 1, 2):
        plan = CalibrationPlan.build(step, cfg.algo.calibration, cfg.train, batch.batch_size)
        step_batch, _ = logprobs.old_logprobs(learner, batch, 4, plan=plan)
        learner.calls.clear()
        calib = StepCalibration(clipper, plan, cfg, "/nonexistent")
        used = []
        for k, mb in enumerate(batching.minibatches(step_batch, 2, seed=step)):
            mb, bounds, tap = calib.before_update(learner, mb, 0, k)
            used.append(tuple(float(b) for b in bounds))
            mb = batching.with_token_weights(mb, "token-mean")
            lp = learner.policy(mb, hp=False)  # the training forward's log-probs (not a forward StepCalibration asked for)
            RLLoss(cfg.algo, bounds, tap, off_policy=plan.off_policy(0, k))(lp, torch.zeros_like(lp), mb, None)
            learner.shift += 1.5 + step  # the update moves the policy, further on every step
        # the event's shadow forward is the only forward StepCalibration runs; an ordinary step runs none
        assert [hp for hp, _ in learner.calls] == ([True] if plan.event else [])
        metrics = calib.finish()
        assert used[0] == (pytest.approx(0.05), pytest.approx(10.0))  # open on-policy update
        assert used[1] == (held[-1] if held else (pytest.approx(0.8), pytest.approx(1.2)))  # the previous step's solve
        assert "calib/solve_lower" in metrics  # every step solves
        assert 0 < clipper.targets.alpha < 1 and metrics["calib/alpha_target"] == clipper.targets.alpha
        held.append((pytest.approx(clipper.lower), pytest.approx(clipper.upper)))
    assert len({h[0].expected for h in held}) == 3, held  # three steps, three different solves
    assert sum(0.05 < h[0].expected < 0.8 for h in held) >= 2, held  # solved inside the guard rails


def test_the_on_policy_update_trains_open_under_full_and_at_the_vanilla_bounds_under_decision(world_of_one):
    """The step's first update (its high-precision ratio is exactly 1): strength=full trains it at [lower_min,
    upper_max], strength=decision keeps 1 -/+ eps like every other update."""
    for strength, want in (("decision", (0.8, 1.2)), ("full", (0.05, 10.0))):
        cfg = _cfg(f"algo.calibration.strength={strength}", "algo.calibration.shadow_fraction=1")
        clipper = CalibratedClipper(cfg.algo.calibration, eps_low=0.2, eps_high=0.2)
        batch = _batch(rows=32)
        plan = CalibrationPlan.build(0, cfg.algo.calibration, cfg.train, batch.batch_size)
        step_batch, _ = logprobs.old_logprobs(RecordingLearner(), batch, 4, plan=plan)
        calib = StepCalibration(clipper, plan, cfg, "/nonexistent")
        mb = next(iter(batching.minibatches(step_batch, 2, seed=0)))
        _, bounds, _ = calib.before_update(RecordingLearner(), mb, 0, 0)
        assert tuple(float(b) for b in bounds) == (pytest.approx(want[0]), pytest.approx(want[1]))


def test_the_high_precision_decision_forwards_pi_old_on_the_off_policy_rows_only(world_of_one):
    """A step whose clip is decided on high-precision ratios (strength=decision, the default) forwards high-precision
    pi_old on the rows an off-policy update trains on, not on the rows only the on-policy first update trains on
    (their ratio is 1 whatever they hold): a third fewer forwards at 2 mini-batches; the values on the forwarded rows
    are the full forward's, and without such rows (ppo_epochs > 1) every row is forwarded."""
    from megatron_rl.phases import error_scale

    cfg = load_config(None, ["precision.recipe=tensorwise", "algo.calibration.enabled=true", "train.num_minibatches=2",
                             "train.micro_batch_size=4"])
    batch = _batch()
    skip = batching.on_policy_only_rows(16, 2, 1, cfg.train.seed, 3)
    assert len(skip) == 8
    learner = RecordingLearner()
    out = error_scale.with_old_logprobs_hp(learner, batch, 4, cfg.algo, gate_open=True, on_policy_only_rows=skip)
    forwarded = [row for hp, rows in learner.calls if hp for row in rows]
    assert sorted(set(forwarded)) == [i for i in range(16) if i not in skip] and len(forwarded) == 8
    full_learner = RecordingLearner()
    full = error_scale.with_old_logprobs_hp(full_learner, batch, 4, cfg.algo, gate_open=True)
    assert sorted(row for _, rows in full_learner.calls for row in rows) == list(range(16))
    off = torch.tensor([i not in skip for i in range(16)])
    assert torch.equal(out.old_logprobs_hp[off], full.old_logprobs_hp[off]) and (out.old_logprobs_hp[~off] == 0).all()
    # the on-policy update reads those rows as its own current policy too: its high-precision ratio is exactly 1
    first = batching.minibatches(out, 2, batching.minibatch_seed(cfg.train.seed, 3, 0))[0]
    assert sorted(first.sample_index.tolist()) == sorted(skip)
    first = error_scale.with_logprobs_hp(learner, first, 4, cfg.algo, first_update=True, gate_open=True)
    assert torch.equal(first.logprobs_hp, first.old_logprobs_hp)
    # closed (no decision this step): nothing is forwarded
    learner.calls.clear()
    assert error_scale.with_old_logprobs_hp(learner, batch, 4, cfg.algo, gate_open=False, on_policy_only_rows=skip) is batch
    assert learner.calls == []


def test_the_targeted_decision_forwards_and_decides_only_its_rows(world_of_one):
    """strength=targeted: the off-policy rows whose engine log-probs differ most from the learner's FP8 pi_old (the
    targeted_fraction of them, by the summed absolute gap over the answer) run the
    high-precision forwards, pi_old's and the current policy's, and only they are decided on the high-precision ratio;
    every other row's decision is its FP8 ratio bit for bit. With the instrument on every row is forwarded."""
    from megatron_rl.algo.clipper import make_clipper
    from megatron_rl.phases import error_scale

    cfg = load_config(None, ["precision.recipe=tensorwise", "algo.calibration.enabled=true",
                             "algo.calibration.strength=targeted", "algo.calibration.targeted_fraction=0.25",
                             "train.num_minibatches=2", "train.micro_batch_size=4"])
    clipper = make_clipper(cfg.algo)
    assert clipper.decides_on_high_precision() and clipper.targeted_fraction() == 0.25
    plan = CalibrationPlan.build(0, cfg.algo.calibration, cfg.train, 16)
    assert not plan.event and not plan.solves  # nothing measured or solved: the decision is all it does
    batch = _batch()
    skip = batching.on_policy_only_rows(16, 2, 1, cfg.train.seed, 3)
    old = RecordingLearner().forward_logprobs(batch, 4)[0]
    engine = old.clone()
    hot = [i for i in range(16) if i not in skip][:2]
    engine[hot, 5] -= 1.0
    engine[skip[0], 5] += 5.0  # the largest gap, but only the on-policy update trains it: never targeted
    batch = batch.with_fields(old_logprobs=old, rollout_logprobs=engine)
    batch = error_scale.with_targeted_rows(batch, clipper, True, skip)
    # round(0.25 * 8) = 2 rows, and the on-policy-only rows (their high-precision ratio is 1 without a forward)
    assert batch.hp_decision_rows.nonzero().flatten().tolist() == sorted([*hot, *skip])
    share = error_scale.targeted_metrics(batch, skip)["calib/targeted_token_share"]
    assert share == pytest.approx(2 / 8)
    assert error_scale.with_targeted_rows(batch.with_fields(hp_decision_rows=None), clipper, False, skip).hp_decision_rows is None
    learner = RecordingLearner()
    batch = error_scale.with_old_logprobs_hp(learner, batch, 4, cfg.algo, gate_open=True, on_policy_only_rows=skip)
    assert [row for hp, rows in learner.calls if hp for row in rows] == sorted(hot)  # 2 rows in a micro-batch of 2
    later = next(mb for mb in batching.minibatches(batch, 2, batching.minibatch_seed(cfg.train.seed, 3, 0))
                 if not set(mb.sample_index.tolist()) & set(skip))
    learner.calls.clear()
    later = error_scale.with_logprobs_hp(learner, later, 4, cfg.algo, first_update=False, gate_open=True)
    assert sorted(row for hp, rows in learner.calls if hp for row in set(rows)) == sorted(hot)
    # the update moved the policy: the FP8 log-probs differ from pi_old's
    lp = later.old_logprobs + 0.05 * torch.arange(later.batch_size)[:, None] * later.loss_mask
    r, sums = error_scale.clip_decision(lp, later, cfg.algo, None, gate_open=True)
    targeted = later.hp_decision_rows
    r_lp = torch.exp(log_ratio(lp, later.old_logprobs, 20.0))
    r_hp = torch.exp(log_ratio(later.logprobs_hp, later.old_logprobs_hp, 20.0))
    assert torch.equal(r[~targeted], r_lp[~targeted])
    assert torch.allclose(r[targeted], r_hp[targeted])
    assert not torch.allclose(r[targeted], r_lp[targeted])
    # the instrument needs every token's high-precision ratio: every off-policy row is forwarded
    k8 = load_config(None, ["precision.recipe=tensorwise", "algo.calibration.enabled=true", "algo.calibration.strength=targeted",
                            "algo.experimental.clip_error_scale=8", "train.num_minibatches=2", "train.micro_batch_size=4"])
    learner.calls.clear()
    error_scale.with_old_logprobs_hp(learner, batch.with_fields(old_logprobs_hp=None), 4, k8.algo, gate_open=True,
                                     on_policy_only_rows=skip)
    assert sorted(row for _, rows in learner.calls for row in rows) == [i for i in range(16) if i not in skip]
