"""The KL reference policy: a snapshot of the initial shards, swapped in for a forward and back out bit-exactly."""
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.phases.logprobs import ReferencePolicy
from megatron_rl.trainer.learner import Learner
from megatron_rl.types import TrainBatch

VOCAB = 40


def _batch(b=4, s=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (b, s + 1), generator=g)
    mask = torch.ones(b, s)
    return TrainBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], loss_mask=mask, advantages=torch.zeros(b, s),
                      rollout_logprobs=torch.zeros(b, s), token_weight=mask / mask.sum())


def test_reference_logprobs_are_the_initial_policy_and_live_weights_survive():
    learner = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(lr=1e-2), PrecisionConfig(),
                      vocab_size=VOCAB, seed=3)
    batch = _batch()
    initial_lp, _ = learner.forward_logprobs(batch, 4)
    reference = ReferencePolicy(learner)
    for _ in range(3):
        learner.train_step(batch, lambda lp, ent, mb, ctx: (-(mb.token_weight * lp).sum(), {}), 4)
    trained = learner.gather_full_state_dict()
    trained_lp, _ = learner.forward_logprobs(batch, 4)
    assert (trained_lp - initial_lp).abs().max() > 1e-3  # the policy really moved

    ref_lp = reference.logprobs(learner, batch, 4)
    torch.testing.assert_close(ref_lp, initial_lp, atol=0, rtol=0)
    after = learner.gather_full_state_dict()
    assert all(torch.equal(after[k], trained[k]) for k in trained)  # live weights restored bit for bit
    torch.testing.assert_close(learner.forward_logprobs(batch, 4)[0], trained_lp, atol=0, rtol=0)
