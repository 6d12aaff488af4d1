"""Single-process checkpoints: exact round trip, bitwise-identical resumption, crash safety, retention.

The reference for resumption is the uninterrupted learner itself: it takes step 2 right after
saving, and a learner restored from the checkpoint must take the very same step 2 (loss, grad
norm, lr and weights bitwise equal).
Run: pytest -q tests/test_checkpoint.py
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.parallel import state
from megatron_rl.trainer import checkpoint as ckpt
from megatron_rl.trainer.learner import Learner
from megatron_rl.types import TrainBatch

warnings.filterwarnings("ignore", category=UserWarning)
VOCAB, B, S = 50, 4, 12


def make_learner(seed: int, distopt: bool = False, dtype: str = "fp32", total_steps: int = 10) -> Learner:
    """A world-1 tiny learner with a warm-up + cosine schedule (so the scheduler state matters)."""
    return Learner(
        ModelConfig(preset="tiny"), ParallelConfig(logprob_chunk_size=5, use_distributed_optimizer=distopt),
        OptimConfig(lr=1e-2, lr_warmup_steps=2, lr_decay_style="cosine", min_lr=1e-3, clip_grad=1.0, params_dtype=dtype),
        PrecisionConfig(), vocab_size=VOCAB, seed=seed, total_steps=total_steps,
    )


@pytest.fixture(scope="module", autouse=True)
def _world():
    """One process group for the module, torn down at the end."""
    torch.set_num_threads(1)
    yield
    state.destroy_distributed()


def make_batch(seed: int) -> TrainBatch:
    """A right-padded batch with masked prompts and a global token_weight."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    pos = torch.arange(S)[None]
    mask = ((pos >= 2) & (pos < torch.tensor([12, 9, 7, 11])[:, None])).float()
    adv = torch.randn(B, 1, generator=g) * mask
    return TrainBatch(ids, labels, mask, adv, torch.zeros(B, S), token_weight=mask / mask.sum())


def loss_fn(lp, ent, mb, ctx):
    """Sum-form policy-gradient loss with an entropy bonus."""
    return (mb.token_weight * (-mb.advantages * lp - 0.01 * ent)).sum(), {}


def weights(lrn: Learner) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a world-1 learner."""
    return lrn.gather_full_state_dict()


def adam_state(lrn: Learner) -> list[dict[str, torch.Tensor]]:
    """Adam moments and step of every main parameter, in optimizer order (cloned)."""
    out = []
    for opt in ckpt._inner_optimizers(lrn):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                st = opt.optimizer.state[p]
                out.append({k: torch.as_tensor(v).clone() for k, v in st.items()} | {"main": p.detach().clone()})
    return out


def assert_same_state(a, b):
    """Bitwise equality of two weight dicts or two adam_state lists."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_same_state(x, y)


@pytest.mark.parametrize("distopt,dtype", [(False, "fp32"), (True, "fp32"), (False, "bf16"), (True, "bf16")],
                         ids=["ddp", "distopt", "ddp_bf16", "distopt_bf16"])
def test_round_trip_and_bitwise_resumption(distopt, dtype, tmp_path):
    """Load after the weights moved on restores weights, Adam state (+ fp32 main params), schedule and RNG; step 2 then repeats bitwise."""
    a = make_learner(seed=3, distopt=distopt, dtype=dtype)
    a.train_step(make_batch(0), loss_fn, 2)
    random.seed(5)
    rl_state = {"step": 1, "cursor": 17, "weight_version": 1, "py_rng": random.getstate(), "t": torch.arange(3)}
    saved_w, saved_adam, saved_sched = weights(a), adam_state(a), a.scheduler.state_dict()
    path = ckpt.save_checkpoint(a, str(tmp_path), step=1, rl_state=rl_state)
    rng_after_save = torch.rand(4)
    ref = a.train_step(make_batch(1), loss_fn, 2)
    ref_w = weights(a)
    assert not torch.equal(ref_w["output_layer.weight"], saved_w["output_layer.weight"])

    got = ckpt.load_checkpoint(a, path)
    assert got["cursor"] == 17 and got["py_rng"] == rl_state["py_rng"] and torch.equal(got["t"], rl_state["t"])
    assert_same_state(weights(a), saved_w)
    assert_same_state(adam_state(a), saved_adam)
    assert a.scheduler.state_dict() == saved_sched and a.step_count == 1
    assert torch.equal(torch.rand(4), rng_after_save)
    again = a.train_step(make_batch(1), loss_fn, 2)
    assert again == ref
    assert_same_state(weights(a), ref_w)

    # A fresh learner with other initial weights and no optimizer state resumes identically too.
    b = make_learner(seed=99, distopt=distopt, dtype=dtype)
    assert not torch.equal(weights(b)["output_layer.weight"], saved_w["output_layer.weight"])
    ckpt.load_checkpoint(b, str(tmp_path))
    assert_same_state(adam_state(b), saved_adam)
    assert b.train_step(make_batch(1), loss_fn, 2) == ref
    assert_same_state(weights(b), ref_w)


def test_resume_with_more_steps_decays_over_the_new_total(tmp_path):
    """A finished run (lr at min_lr) resumed with a larger total continues the config's schedule from the saved step count."""
    done = make_learner(seed=3, total_steps=4)
    for i in range(4):
        done.train_step(make_batch(i), loss_fn, 2)
    lr_of = lambda lrn: lrn.scheduler.get_lr(lrn.optimizer.param_groups[0])
    assert lr_of(done) == pytest.approx(1e-3)  # the end of its decay: training on would not move the weights
    ckpt.save_checkpoint(done, str(tmp_path), step=4, rl_state={"step": 4})
    longer = make_learner(seed=3, total_steps=12)
    ckpt.load_checkpoint(longer, str(tmp_path))
    reference = make_learner(seed=3, total_steps=12)
    reference.scheduler.step(4)  # where an uninterrupted 12-step run's schedule is after 4 steps
    assert longer.scheduler.num_steps == 4 and longer.scheduler.lr_decay_steps == reference.scheduler.lr_decay_steps
    assert lr_of(longer) == pytest.approx(lr_of(reference)) and lr_of(longer) > 5e-3
    before = weights(longer)["output_layer.weight"].clone()
    longer.train_step(make_batch(4), loss_fn, 2)
    assert not torch.equal(weights(longer)["output_layer.weight"], before)


def test_checkpoint_layout_and_meta(tmp_path):
    """The directory holds the documented files and meta records step, layout and optimizer kind."""
    a = make_learner(seed=3)
    a.train_step(make_batch(0), loss_fn, 4)
    path = Path(ckpt.save_checkpoint(a, str(tmp_path), step=7, rl_state={"step": 7}))
    assert path.name == "step_00000007"
    for name in (ckpt.COMPLETE_MARKER, ckpt.META_FILE, ckpt.RL_STATE_FILE, f"{ckpt.RNG_DIR}/rank_00000.pkl", f"{ckpt.DIST_DIR}/metadata.json"):
        assert (path / name).is_file(), name
    meta = ckpt.checkpoint_meta(path)
    assert meta["step"] == 7 and meta["has_optimizer"] and meta["learner_step_count"] == 1
    assert meta["layout"]["tp"] == 1 and meta["layout"]["world_size"] == 1
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_save_before_any_step_loads_weights_only(tmp_path):
    """Without Adam state there is no optimizer section; loading still restores weights and the schedule."""
    a = make_learner(seed=3)
    w = weights(a)
    path = ckpt.save_checkpoint(a, str(tmp_path), step=0, rl_state={})
    assert not ckpt.checkpoint_meta(path)["has_optimizer"]
    b = make_learner(seed=4)
    ckpt.load_checkpoint(b, path)
    assert_same_state(weights(b), w)
    assert b.train_step(make_batch(0), loss_fn, 2) == a.train_step(make_batch(0), loss_fn, 2)


def test_crash_mid_save_is_never_returned(tmp_path, monkeypatch):
    """A save that dies after the shards are written leaves only a .tmp dir: ignored, then cleaned by the next save."""
    a = make_learner(seed=3)
    a.train_step(make_batch(0), loss_fn, 4)
    good = ckpt.save_checkpoint(a, str(tmp_path), step=1, rl_state={"step": 1})

    def crash(*args, **kwargs):
        """Stand-in for _publish: dies after every rank wrote its shards."""
        raise RuntimeError("simulated crash before COMPLETE")

    monkeypatch.setattr(ckpt, "_publish", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ckpt.save_checkpoint(a, str(tmp_path), step=2, rl_state={"step": 2})
    monkeypatch.undo()
    tmp = tmp_path / f"{ckpt.TMP_PREFIX}2"
    assert (tmp / ckpt.DIST_DIR / ".metadata").is_file(), "the shards were written before the crash"
    # A step directory that lost its marker (e.g. a partial copy) is not complete either.
    (tmp_path / "step_00000003").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == good
    with pytest.raises(FileNotFoundError):
        ckpt.load_checkpoint(a, str(tmp))
    assert ckpt.load_checkpoint(a, str(tmp_path))["step"] == 1

    with pytest.raises(Exception):
        ckpt.save_checkpoint(a, str(tmp_path), step=5, rl_state={"not picklable": lambda: 0})
    assert not (tmp_path / f"{ckpt.TMP_PREFIX}5").exists() and ckpt.latest_checkpoint(tmp_path) == good

    ckpt.save_checkpoint(a, str(tmp_path), step=4, rl_state={"step": 4})
    assert not tmp.exists()
    assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "step_00000004")


def test_retention_keeps_last_n(tmp_path):
    """keep_last=2 leaves the two newest complete checkpoints; re-saving a step replaces it."""
    a = make_learner(seed=3)
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(a, str(tmp_path), step=step, rl_state={"step": step}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    ckpt.save_checkpoint(a, str(tmp_path), step=4, rl_state={"step": 44}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert ckpt.load_checkpoint(a, ckpt.latest_checkpoint(tmp_path))["step"] == 44
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_optimizer_kind_mismatch_is_explicit(tmp_path):
    """DDP-optimizer state cannot go into a distributed optimizer: clear error, weights-only load works."""
    a = make_learner(seed=3)
    a.train_step(make_batch(0), loss_fn, 4)
    path = ckpt.save_checkpoint(a, str(tmp_path), step=1, rl_state={})
    b = make_learner(seed=4, distopt=True)
    with pytest.raises(ValueError, match="load_optimizer=False"):
        ckpt.load_checkpoint(b, path)
    ckpt.load_checkpoint(b, path, load_optimizer=False)
    assert_same_state(weights(b), weights(a))


def test_architecture_mismatch_is_explicit(tmp_path):
    """A checkpoint of another architecture is refused with the differing fields named."""
    a = make_learner(seed=3)
    path = ckpt.save_checkpoint(a, str(tmp_path), step=1, rl_state={})
    other = Learner(ModelConfig(preset="tiny", num_layers=4), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="num_layers"):
        ckpt.load_checkpoint(other, path)
