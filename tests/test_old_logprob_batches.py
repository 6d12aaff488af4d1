"""pi_old forwarded in the update's own micro-batches (train.old_logprob_batches=update): per-tensor current scaling
(FP8 tensorwise, NVFP4's global scale) then quantizes the same tensors in the pi_old forward and in the first update,
so the on-policy ratio is exactly 1; forwarded in rollout order the scales follow another batch composition and the
on-policy ratio carries quantization noise. Recipes whose scales do not depend on the batch (high precision, FP8
blockwise: 1x128 groups per token) give the same log-probs either way."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.phases import batching, logprobs
from megatron_rl.trainer.learner import Learner
from megatron_rl.types import TrainBatch

VOCAB = 50
MODEL = ModelConfig(preset="tiny", hidden_size=64, ffn_hidden_size=128, head_dim=16)
ROWS, MINIBATCHES, MICRO = 16, 4, 2


def _batch(seq: int = 20) -> TrainBatch:
    """Rows of different lengths, right-padded (the padding changes a micro-batch's activation amax too)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (ROWS, seq + 1), generator=g)
    lengths = torch.randint(6, seq, (ROWS,), generator=g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).float()
    ids[:, 1:][mask == 0] = 0
    adv = torch.randn(ROWS, 1, generator=g) * mask
    return TrainBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], loss_mask=mask, advantages=adv,
                      rollout_logprobs=torch.zeros(ROWS, seq), sample_index=torch.arange(ROWS))


def _first_update_logprobs(learner: Learner, minibatch: TrainBatch) -> torch.Tensor:
    """The log-probs the first update's loss sees (what pi_theta is in its ratio)."""
    seen = []

    def loss(lp, ent, mb, ctx):
        seen.append(lp.detach().clone())
        return -(mb.loss_mask * lp).sum() / mb.loss_mask.sum(), {}

    learner.train_step(minibatch, loss, MICRO)
    return torch.cat(seen)


@pytest.mark.parametrize("recipe", ["tensorwise", "nvfp4", "blockwise", "none"])
def test_on_policy_ratio_is_exactly_one_with_update_batches(recipe):
    cfg = load_config(None, [f"train.num_minibatches={MINIBATCHES}", f"train.micro_batch_size={MICRO}"])
    assert cfg.train.old_logprob_batches == "update"  # the default
    learner = Learner(MODEL, ParallelConfig(), OptimConfig(lr=1e-3), PrecisionConfig(recipe=recipe), vocab_size=VOCAB, seed=3)
    batch, step = _batch(), 5
    groups = batching.old_logprob_row_groups(ROWS, cfg.train, step)
    rollout_order = batching.old_logprob_row_groups(ROWS, cfg.train.model_copy(update={"old_logprob_batches": "rollout"}), step)
    assert rollout_order is None
    by_update, _ = logprobs.old_logprobs(learner, batch, MICRO, row_groups=groups)
    by_rollout, _ = logprobs.old_logprobs(learner, batch, MICRO, row_groups=rollout_order)
    # the groups are the first epoch's mini-batches, in the loop's order
    first = batching.minibatches(batch, MINIBATCHES, batching.minibatch_seed(cfg.train.seed, step, 0))[0]
    assert torch.equal(groups[0], first.sample_index)
    theta = _first_update_logprobs(learner, first)
    mask = first.loss_mask > 0
    assert torch.equal(theta[mask], by_update.old_logprobs[groups[0]][mask])  # bit for bit: log-ratio 0
    noise = (theta - by_rollout.old_logprobs[groups[0]])[mask].abs().max().item()
    if recipe in ("tensorwise", "nvfp4"):
        assert noise > 1e-4, noise  # another composition, other per-tensor scales
    else:
        assert noise == 0.0  # nothing in these recipes depends on which rows share a micro-batch


def test_row_groups_cover_every_row_once():
    cfg = load_config(None, ["train.num_minibatches=4", "train.micro_batch_size=2"])
    groups = batching.old_logprob_row_groups(16, cfg.train, 0)
    assert sorted(torch.cat(groups).tolist()) == list(range(16)) and len(groups) == 4
    with pytest.raises(ValueError, match="equal mini-batches"):
        batching.old_logprob_row_groups(18, cfg.train, 0)


def test_config_rejects_an_unknown_mode():
    with pytest.raises(Exception, match="train.old_logprob_batches"):
        load_config(None, ["train.old_logprob_batches=sorted"])
