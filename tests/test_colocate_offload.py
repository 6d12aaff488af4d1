"""rollout.colocate_offload on CPU: optimizer states and gradient buffers really leave (storages emptied) and come back
bit for bit: a few train steps with an offload / reload cycle between them give the same metrics and weights as
the same steps without it (megatron DDP and the distributed optimizer, FP32 and BF16 params). The engines' side of the
cycle (release / resume order, barrier, controller-only posts) runs through phases/placement.EngineMemory.

Run: pytest -q tests/test_colocate_offload.py
"""
from __future__ import annotations

import warnings

import pytest
import torch
from pydantic import ValidationError

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.parallel import state
from megatron_rl.phases.placement import EngineMemory
from megatron_rl.tracking import Timers
from megatron_rl.trainer.learner import Learner
from megatron_rl.trainer.offload import LearnerOffload, _ddp_buffers
from megatron_rl.types import TrainBatch

warnings.filterwarnings("ignore", category=UserWarning)
VOCAB, B, S, STEPS = 50, 4, 12, 3


@pytest.fixture(scope="module", autouse=True)
def _world():
    torch.set_num_threads(1)
    yield
    state.destroy_distributed()


def make_learner(distopt: bool, dtype: str) -> Learner:
    return Learner(ModelConfig(preset="tiny"), ParallelConfig(logprob_chunk_size=5, use_distributed_optimizer=distopt),
                   OptimConfig(lr=1e-2, lr_warmup_steps=1, lr_decay_style="cosine", min_lr=1e-3, clip_grad=1.0,
                               params_dtype=dtype), PrecisionConfig(), vocab_size=VOCAB, seed=11, total_steps=10)


def make_batch(seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = (torch.arange(S)[None] >= 2).float().expand(B, S).clone()
    adv = torch.randn(B, 1, generator=g) * mask
    return TrainBatch(ids, labels, mask, adv, torch.zeros(B, S), token_weight=mask / mask.sum())


def loss_fn(lp, ent, mb, ctx):
    return (mb.token_weight * (-mb.advantages * lp - 0.01 * ent)).sum(), {}


class Transport:
    """The controller's engine calls, recorded."""

    def __init__(self):
        self.calls = []

    def release_memory(self, tags):
        self.calls.append("release")

    def resume_memory(self, tags):
        self.calls.append("resume")


def run_steps(distopt: bool, dtype: str, offload: bool) -> tuple[list[dict], dict, list[str], list[int]]:
    """STEPS train steps in the loop's order (release, train, resume) -> metrics, weights, engine calls, bytes freed."""
    learner = make_learner(distopt, dtype)
    transport = Transport()
    memory = EngineMemory(transport, "colocated", is_controller=True, learner=learner, offload=offload)
    metrics, freed = [], []
    memory.resume(Timers())  # as the loop does before its first sync
    for step in range(STEPS):
        memory.release(Timers())
        metrics.append(learner.train_step(make_batch(step), loss_fn, micro_batch_size=2))
        memory.resume(Timers())
        if offload:
            freed.append(_check_offloaded(memory.offload))
    memory.release(Timers())  # optimizer states back in place before reading them
    opt_state = {f"{i}.{k}": v.clone() for i, s in enumerate(_opt_states(learner)) for k, v in s.items()
                 if isinstance(v, torch.Tensor)}
    weights = {n: p.detach().clone() for n, p in learner._local_params()}
    return metrics, {**weights, **opt_state}, transport.calls, freed


def _opt_states(learner) -> list[dict]:
    from megatron_rl.trainer.offload import _inner_optimizers

    return [s for inner in _inner_optimizers(learner.optimizer) for s in inner.state.values()]


def _check_offloaded(off: LearnerOffload) -> int:
    """While offloaded: optimizer states and grad buffers hold no memory; the weights do."""
    assert off.offloaded
    states = [v for s in _opt_states(off.learner) for v in s.values() if isinstance(v, torch.Tensor)]
    assert states and all(v.untyped_storage().nbytes() == 0 for v in states)
    buffers = [b for chunk in off.learner.model for b in _ddp_buffers(chunk)]
    assert buffers and all(b.grad_data.untyped_storage().nbytes() == 0 for b in buffers)
    assert all(p.untyped_storage().nbytes() > 0 for _, p in off.learner._local_params())
    return sum(h.numel() for _, h in off._host)


@pytest.mark.parametrize("distopt,dtype", [(False, "fp32"), (True, "bf16")], ids=["ddp_fp32", "distopt_bf16"])
def test_offload_leaves_every_number_unchanged(distopt, dtype):
    ref_metrics, ref_state, ref_calls, _ = run_steps(distopt, dtype, offload=False)
    metrics, state_, calls, freed = run_steps(distopt, dtype, offload=True)
    assert metrics == ref_metrics
    assert ref_state.keys() == state_.keys() and len(ref_state) > 0
    for name, ref in ref_state.items():
        assert ref.dtype == state_[name].dtype and torch.equal(ref, state_[name]), name
    # Adam's two fp32 moments per parameter (+ BF16's fp32 main params) were on the host between steps
    n = sum(p.numel() for _, p in make_learner(distopt, dtype)._local_params())
    per_param = 12 if dtype == "bf16" else 8
    assert all(per_param * n <= f < (per_param + 1) * n for f in freed), (freed, n)
    assert calls == ref_calls == ["release", "resume"] * STEPS + ["release"]


def test_learner_resident_brings_state_back_for_a_save_only_when_offloaded():
    learner = make_learner(False, "fp32")
    transport = Transport()
    memory = EngineMemory(transport, "colocated", learner=learner, offload=True)
    memory.release(Timers())
    learner.train_step(make_batch(0), loss_fn, micro_batch_size=2)
    memory.resume(Timers())
    with memory.learner_resident(Timers()):
        assert not memory.offload.offloaded
    assert memory.offload.offloaded and transport.calls == ["release", "resume", "release", "resume"]
    plain = EngineMemory(Transport(), "colocated", learner=learner, offload=False)
    with plain.learner_resident(Timers()):
        pass
    assert plain.transport.calls == []


def test_disaggregated_does_nothing_and_the_field_is_checked():
    learner = make_learner(False, "fp32")
    memory = EngineMemory(Transport(), "disaggregated", learner=learner, offload=True)
    memory.release(Timers())
    memory.resume(Timers())
    assert memory.offload is None and memory.transport.calls == []
    with pytest.raises(ValidationError, match="rollout.colocate_offload=true applies to rollout.placement=colocated"):
        RolloutConfig(colocate_offload=True)
    assert RolloutConfig(placement="colocated", colocate_offload=True).colocate_offload
