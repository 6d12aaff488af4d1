"""The dose-response instrument's ratio (experiment only; algo.experimental.clip_error_scale).

    r_k = r_hp * (r_lp / r_hp)^k,   i.e.   log r_k = log r_lp + (k - 1) * (log r_lp - log r_hp)

where r_lp is the importance ratio of the learner's (low-precision) forwards and r_hp that of the
high-precision shadow forwards of the same tokens and weights. The PPO loss takes r_k as its clip
*decision* only (`decision_ratio` of algo/losses.py): which tokens are clipped, hence get no gradient,
follows r_k; the loss and gradient of the tokens left active are the ordinary low-precision ones. So k
scales the low-precision error the clipping sees (k = 0: decide on the high-precision ratio) without
adding noise to any gradient. Written as the lp log-ratio plus a multiple of the error so that k = 1 gives
exactly the bits of the ordinary ratio. Pure tensor math; tests/algo/test_error_scale.py.
"""
from __future__ import annotations

import torch

from megatron_rl.algo.losses import log_ratio


def error_scaled_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, logprobs_hp: torch.Tensor,
                       old_logprobs_hp: torch.Tensor, scale: float | torch.Tensor,
                       log_ratio_clamp: float = 20.0) -> torch.Tensor:
    """[B, S] detached r_k (see module docstring); bitwise the ordinary ratio exp(log_ratio(logprobs, old)) at scale 1.
    `scale` is one k or a tensor broadcasting against [B, S] (a k per row: [B, 1])."""
    lr = log_ratio(logprobs.detach(), old_logprobs.detach(), log_ratio_clamp)
    lr_hp = log_ratio(logprobs_hp.detach(), old_logprobs_hp.detach(), log_ratio_clamp).to(lr.dtype)
    k_minus_1 = torch.as_tensor(scale, dtype=lr.dtype, device=lr.device) - 1.0
    # the same clamp as the loss's ratio, so an extreme k cannot overflow exp
    return torch.exp((lr + k_minus_1 * (lr - lr_hp)).clamp(-log_ratio_clamp, log_ratio_clamp))
