"""rollout.placement=colocated and rollout.overlap=one_step_off: config rules, the loop's mechanics (phases/overlap.py,
phases/placement.py) and two tiny end-to-end runs.

- colocated: the engine's own event log shows release before each step's training and resume + update before
  the next rollout; after the run the engine serves exactly the learner's final weights (rollout format).
- one_step_off: step t+1's batch is generated (weights of version t) while step t trains; the in-flight batch is
  checkpointed, so a run resumed from step t's checkpoint repeats the uninterrupted run's metrics bit for bit.

Run: pytest -q tests/test_overlap_placement.py  (the two runs are marked slow)
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from pydantic import ValidationError

from megatron_rl.config import load_config
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.phases.overlap import RolloutSchedule
from megatron_rl.phases.placement import EngineMemory
from megatron_rl.tracking import Timers
from rl_runs import CONFIG, comparable, read_rows, tiny_overrides, train, warm_start

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ config
def test_colocated_defaults_to_the_tensor_transport_and_refuses_others():
    assert load_config(CONFIG, ["rollout.placement=colocated"]).rollout.weight_sync.transport == "tensor"
    assert load_config(CONFIG, []).rollout.weight_sync.transport == "disk"
    for transport in ("disk", "distributed"):
        with pytest.raises(Exception, match=rf"rollout.weight_sync.transport={transport} is not supported with "
                                            r"rollout.placement=colocated"):
            load_config(CONFIG, ["rollout.placement=colocated", f"rollout.weight_sync.transport={transport}"])
    assert RolloutConfig(placement="colocated", weight_sync={"transport": "tensor", "bucket_mb": 8}).weight_sync.bucket_mb == 8


def test_incompatible_combinations_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="rollout.overlap=one_step_off .* rollout.placement=colocated"):
        RolloutConfig(placement="colocated", overlap="one_step_off")
    with pytest.raises(ValidationError, match="rollout.mem_fraction_static must be set when rollout.placement=colocated"):
        RolloutConfig(placement="colocated", engine="sglang")
    with pytest.raises(Exception, match="rollout.overlap"):
        load_config(CONFIG, ["rollout.overlap=two_steps_off"])
    # colocated engines elsewhere cannot open the learner's handles
    with pytest.raises(ValidationError, match="transport=tensor .* elsewhere"):
        RolloutConfig(placement="colocated", engine="external", urls=["http://10.0.0.7:30000"])
    assert RolloutConfig(overlap="one_step_off").overlap == "one_step_off"


def test_embedded_colocated_engines_keep_a_weights_backup():
    """The launcher starts colocated embedded engines with --enable-weights-cpu-backup (an unhealthy step is not synced)."""
    from megatron_rl.rollout.launcher import plan_from_config

    for placement, expected in (("colocated", True), ("disaggregated", False)):
        plan = plan_from_config(RolloutConfig(placement=placement, num_engines=2), "/m", precision=PrecisionConfig())
        assert [("--enable-weights-cpu-backup" in p.argv) for p in plan.engines] == [expected, expected]


# ------------------------------------------------------------------------------------------------ mechanics
def _producer(log: list, gate: threading.Event | None = None, version_of=lambda step: step):
    def produce(step: int, timers: Timers):
        with timers("rollout"):
            log.append(("start", step, threading.current_thread().name))
            if gate is not None:
                assert gate.wait(30)
            log.append(("end", step))
        return f"batch{step}", {"rollout/weight_version": float(version_of(step))}, []
    return produce


def test_none_generates_each_batch_when_its_step_starts():
    log = []
    sched = RolloutSchedule("none", _producer(log))
    batch, metrics, _ = sched.batch(3, Timers())
    sched.prefetch(4, 10)
    assert batch == "batch3" and metrics["rollout/staleness"] == 0.0
    assert sched.settle(Timers()) == {} and sched.state_dict() == {} and log == [("start", 3, "MainThread"), ("end", 3)]
    sched.close()


def test_one_step_off_generates_the_next_batch_while_this_step_trains():
    log, gate = [], threading.Event()
    sched = RolloutSchedule("one_step_off", _producer(log, gate, version_of=lambda step: step - 1))
    gate.set()
    first, metrics, _ = sched.batch(0, Timers())  # nothing generated ahead yet: now, on this thread
    assert first == "batch0" and log[0][2] == "MainThread"
    gate.clear()
    sched.prefetch(1, 3)
    deadline = time.monotonic() + 30
    while len(log) < 3 and time.monotonic() < deadline:  # step 1's generation started in the background...
        time.sleep(0.01)
    assert log[2][:2] == ("start", 1) and log[2][2].startswith("rollout-ahead")
    assert log[-1] != ("end", 1)  # ...and is still running while this step "trains"
    timers = Timers()
    gate.set()
    extra = sched.settle(timers)  # waits for it
    assert log[-1] == ("end", 1) and "time/rollout_wait" in timers.pop() and "overlap/rollout_s" in extra
    state = sched.state_dict()
    assert state == {"pending_rollout": (1, ("batch1", {"rollout/weight_version": 0.0}, []))}
    batch, metrics, _ = sched.batch(1, Timers())
    assert batch == "batch1" and metrics["rollout/staleness"] == 1.0 and len(log) == 4  # not generated again
    sched.prefetch(3, 3)  # past the last step: nothing starts
    assert sched.settle(Timers()) == {}
    sched.close()
    # a checkpoint's pending batch is what a resumed run trains its first step on
    resumed = RolloutSchedule("one_step_off", _producer(log), pending=state["pending_rollout"])
    assert resumed.batch(1, Timers())[0] == "batch1" and len(log) == 4
    resumed.close()


def test_off_the_controller_the_schedule_is_inert():
    sched = RolloutSchedule("one_step_off", _producer([]), enabled=False)
    assert sched.batch(0, Timers()) == (None, {}, [])
    sched.prefetch(1, 5)
    assert sched.settle(Timers()) == {}


def test_engine_memory_only_acts_for_colocated_engines_on_the_controller():
    calls = []

    class Transport:
        def release_memory(self, tags):
            calls.append(("release", tags))

        def resume_memory(self, tags):
            calls.append(("resume", tags))

    for placement, controller in (("disaggregated", True), ("colocated", False)):
        memory = EngineMemory(Transport(), placement, is_controller=controller)
        memory.release(Timers())
        memory.resume(Timers())
    assert calls == []
    memory, timers = EngineMemory(Transport(), "colocated"), Timers()
    memory.release(timers)
    memory.resume(timers)
    assert calls == [("release", None), ("resume", None)]
    assert {"time/release_memory", "time/resume_memory"} <= set(timers.pop())


# ------------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    return warm_start(tmp_path_factory)


def _compress(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        name = e["event"] + ("" if e["event"] in ("generate", "release", "resume", "session_begin", "session_end")
                             else f"@{e['weight_version']}")
        if not (out and out[-1] == name == "generate"):
            out.append(name)
    return out


def _train_to_files(run_dir, overrides) -> list[dict]:
    """`train` with output to files: the shared-memory manager of the tensor transport (torch_shm_manager) lives as long
    as this process's engine maps its segments and would hold pipes open after the trainer exits."""
    import subprocess

    from rl_runs import cli_env, train_command

    log = run_dir.parent / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(train_command(run_dir, overrides), env=cli_env(), stdout=out, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=600) == 0, log.read_text()[-6000:]
    return read_rows(run_dir)


@pytest.mark.slow
def test_colocated_run_releases_before_training_and_serves_the_learners_weights(warm, tmp_path):
    """2 colocated steps against an engine in this process (so its event log and weights can be read afterwards)."""
    from megatron_rl.convert import iter_megatron_as_hf
    from megatron_rl.phases.weights import rollout_payload
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.trainer.checkpoint_reader import checkpoint_architecture
    from test_weight_receiver import post

    run = tmp_path / "run"
    cfg = load_config(CONFIG, ["precision.rollout_quantization=fp8-blockwise"])
    launch = tmp_path / "launch"
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint

    model = write_launch_checkpoint(str(warm / "sft" / "hf"), cfg.precision, str(launch))
    with ThreadedServer(model, str(warm / "data" / "tokenizer"), deterministic=True, weights_cpu_backup=True) as engine:
        rows = _train_to_files(run, tiny_overrides(warm, "train.steps=2", "train.eval_every=0", "rollout.engine=external",
                                                   f"rollout.urls=[{engine.url}]", "rollout.placement=colocated"))
        events = RolloutClient(engine.url).server_info_sync()[0]["events"]
        ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
        try:  # the reader gives this process a world of one for megatron's loader
            expected, _ = rollout_payload(dict(iter_megatron_as_hf(ckpt, checkpoint_architecture(ckpt))), cfg.precision)
        finally:
            from megatron_rl.parallel.state import destroy_distributed

            destroy_distributed()
        served = {}
        for name in expected:
            status, body = post(engine.url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
            assert status == 200, (name, body)
            served[name] = torch.tensor(body, dtype=torch.float64)
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0]
    assert all("time/release_memory" in r and "time/resume_memory" in r for r in rows)
    # eval before RL, then per step: rollout, release (training), resume, the new version (inside SGLang's
    # weight-update session), and eval after RL
    def sync(v: int) -> list[str]:
        return ["session_begin", f"update@{v}", "session_end"]

    assert _compress(events) == [*sync(0), "generate", "release", "resume", *sync(1), "generate", "release", "resume",
                                 *sync(2), "generate"]
    for name, tensor in expected.items():
        assert torch.equal(served[name].reshape(tensor.shape), tensor.double()), name


@pytest.mark.slow
def test_one_step_off_runs_ahead_and_resumes_with_its_in_flight_batch(warm, tmp_path):
    """3 steps one_step_off (checkpoint every step); drop the final checkpoint and rerun: step 2 trains again on the
    batch the checkpoint of step 1 holds (generated with version 1) and matches the uninterrupted run."""
    import shutil

    overrides = tiny_overrides(warm, "train.steps=3", "train.eval_every=0", "checkpoint.save_every=1",
                               "rollout.overlap=one_step_off", "tracking.log_samples=16")
    run = tmp_path / "run"
    reference = train(run, overrides)
    assert [r["rollout/weight_version"] for r in reference] == [0.0, 0.0, 1.0]
    assert [r["rollout/staleness"] for r in reference] == [0.0, 1.0, 1.0]
    assert "overlap/rollout_s" in reference[0] and "time/rollout" not in reference[1]
    # the lag reaches the rollout correction: engine log-probs vs the learner's recomputed pi_old
    assert reference[1]["mismatch_abs_dlogp"] > 0 and all(r["calib/solve_lower"] > 0 for r in reference)
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints][-2:] == ["step_00000001", "step_00000002"]
    shutil.rmtree(checkpoints[-1])
    resumed = train(run, overrides)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert comparable(resumed[2]) == comparable(reference[2])
    assert read_rows(run)[2]["samples"] == reference[2]["samples"]


# ------------------------------------------------------------------------------------------------ weighted statistics
def _tokens(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(0.2 * torch.randn(n, generator=g, dtype=torch.float64))
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ratio_hp = ratio * torch.exp(0.05 * torch.randn(n, generator=g, dtype=torch.float64))
    return ratio, adv, ratio_hp


def _summary(stats):
    fp8, t = stats.fp8, stats.targets
    return (round(t.alpha, 12), round(t.rho, 12), fp8.num_neg, fp8.num_pos, fp8.lower_quantile(0.1),
            round(fp8.neg_mass_from(0.9), 9), round(fp8.pos_mass_to(1.1), 9), fp8.smallest_upper(fp8.pos_mass_to(1.05)))


@pytest.mark.parametrize("backend", ["allgather", "histogram"])
def test_weighted_ratio_statistics_count_each_token_weight_times(backend):
    """one_step_off weighs calibration tokens by their rollout-correction weight: weight k == the token added k times,
    all-ones == unweighted, and weighted statistics refuse tokens without weights."""
    from megatron_rl.algo.calibration import RatioStats

    ratio, adv, ratio_hp = _tokens()
    reps = (torch.arange(ratio.numel()) % 3).to(torch.float64)  # weights 0, 1, 2
    weighted = RatioStats(backend, reference=True, weighted=True)
    weighted.add(ratio, adv, ratio_hp=ratio_hp, weight=reps)
    repeated = RatioStats(backend, reference=True)
    idx = torch.repeat_interleave(torch.arange(ratio.numel()), reps.long())
    repeated.add(ratio[idx], adv[idx], ratio_hp=ratio_hp[idx])
    assert _summary(weighted.reduce()) == _summary(repeated.reduce())
    ones = RatioStats(backend, reference=True, weighted=True)
    ones.add(ratio, adv, ratio_hp=ratio_hp, weight=torch.ones_like(ratio))
    plain = RatioStats(backend, reference=True)
    plain.add(ratio, adv, ratio_hp=ratio_hp)
    assert _summary(ones.reduce()) == _summary(plain.reduce())
    assert _summary(weighted.reduce()) != _summary(plain.reduce())
    with pytest.raises(ValueError, match="one weight per token"):
        weighted.add(ratio, adv, ratio_hp=ratio_hp)


def test_the_loss_adds_stale_tokens_with_their_correction_weight():
    """RLLoss's calibration tap passes the TIS weight of each token (what the loss multiplies it by) to weighted stats."""
    from megatron_rl.algo.calibration import RatioStats
    from megatron_rl.algo.calibration_plan import CalibrationPlan
    from megatron_rl.phases.loss import CalibrationTap, RLLoss, correction_weight
    from megatron_rl.types import TrainBatch

    # a rule that gathers ratio statistics (decision's per-step solve; the default targeted gathers none)
    cfg = load_config(CONFIG, ["rollout.overlap=one_step_off", "algo.calibration.strength=decision"])
    g = torch.Generator().manual_seed(1)
    B, S = 4, 6
    mask = torch.ones(B, S)
    old = -torch.rand(B, S, generator=g) - 0.1
    mb = TrainBatch(input_ids=torch.zeros(B, S, dtype=torch.long), labels=torch.zeros(B, S, dtype=torch.long),
                    loss_mask=mask, advantages=torch.randn(B, S, generator=g), old_logprobs=old,
                    rollout_logprobs=old - 0.5 * torch.rand(B, S, generator=g), token_weight=mask / mask.sum(),
                    sample_index=torch.arange(B))
    w = correction_weight(mb, cfg.algo)
    assert float((w - 1).abs().max()) > 0.05 and float(w.max()) <= cfg.algo.rollout_correction.tis_cap
    plan = CalibrationPlan.build(0, cfg.algo.calibration, cfg.train, B)
    calls = []

    class Recording(RatioStats):
        def add(self, ratio, adv, **kw):
            calls.append(kw["weight"])
            super().add(ratio, adv, **kw)

    stats = Recording("allgather", weighted=True)
    RLLoss(cfg.algo, tap=CalibrationTap(plan, stats, 1))(old + 0.01, torch.zeros(B, S), mb, None)
    assert torch.equal(calls[0], w[mask > 0].to(calls[0].dtype))
