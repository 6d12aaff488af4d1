"""The only owner of megatron state: model build from specs, vocab-parallel log-probs, the Learner."""
from megatron_rl.trainer.learner import Learner, LossContext

__all__ = ["Learner", "LossContext"]
