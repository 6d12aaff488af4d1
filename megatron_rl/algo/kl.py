"""KL-to-reference estimators (k1, k2, k3) and the entropy bonus, per token."""
from __future__ import annotations

from typing import Callable

import torch

from megatron_rl.algo.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")

_LOG_CLAMP = 20.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = log pi_ref - log pi (unbiased, non-negative); d clamped so exp cannot overflow."""
    d = (ref_logprobs - logprobs).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    return torch.exp(d) - d - 1.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate by the registered `estimator`."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


def entropy_bonus(entropy: torch.Tensor, coef: torch.Tensor | float) -> torch.Tensor:
    """Per-token loss term -coef * entropy (adding it to the loss rewards entropy)."""
    return -torch.as_tensor(coef, dtype=entropy.dtype, device=entropy.device) * entropy
