"""Delayed-scaling FP8 state (amax histories and scales) travels with the checkpoint, as TE's _extra_state does,
so a resumed FP8 run quantizes its next step exactly like the uninterrupted one."""
import warnings

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


@pytest.fixture(scope="module", autouse=True)
def _world():
    torch.set_num_threads(1)
    yield
    state.destroy_distributed()


def _learner(seed: int) -> Learner:
    return Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(lr=1e-2),
                   PrecisionConfig(recipe="delayed", amax_history_len=4, amax_compute_algo="max"),
                   vocab_size=VOCAB, seed=seed)


def _batch(seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    mask = torch.ones(B, S)
    return TrainBatch(ids[:, :-1], ids[:, 1:], mask, torch.zeros(B, S), torch.zeros(B, S), token_weight=mask / mask.sum())


def _nll(lp, ent, mb, ctx):
    return -(mb.token_weight * lp).sum(), {}


def _fp8_states(learner: Learner) -> dict:
    return {name: m.get_extra_state() for chunk in learner.model for name, m in chunk.named_modules()
            if hasattr(m, "fp8_quant")}


def test_delayed_scaling_state_is_checkpointed(tmp_path):
    a = _learner(seed=3)
    for k in range(3):  # fill the amax histories
        a.train_step(_batch(k), _nll, 2)
    saved = _fp8_states(a)
    assert saved and all(s for s in saved.values()), "delayed recipe should carry per-module state"
    path = ckpt.save_checkpoint(a, str(tmp_path), step=3, rl_state={"step": 3})
    ref = a.train_step(_batch(3), _nll, 2)

    b = _learner(seed=99)  # fresh histories: its next step would quantize differently
    assert _fp8_states(b) != saved
    ckpt.load_checkpoint(b, path)
    assert _fp8_states(b) == saved
    assert b.train_step(_batch(3), _nll, 2) == ref
