"""Reward and advantage phases: score samples, shape rewards (DAPO), filter groups, compute advantages."""
from __future__ import annotations

import torch

from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.algo.dapo import dynamic_sampling_keep, expand_group_mask, overlong_penalty
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.reward import RewardFn
from megatron_rl.types import RolloutBatch


def score(batch: RolloutBatch, reward_fn: RewardFn, algo: AlgoConfig, max_new_tokens: int) -> dict[str, float]:
    """Fill sample.reward / sample.correct in place (with DAPO overlong shaping when on); returns metrics."""
    for s in batch.samples:
        s.reward, s.correct = reward_fn(s.response_text, s.answer)
        s.reward = float(s.reward)
    raw = torch.tensor([s.reward for s in batch.samples], dtype=torch.float64)  # device-ok: host-side rewards
    d = algo.dapo
    if d.overlong_buffer > 0:
        lengths = torch.tensor([len(s.response_ids) for s in batch.samples], dtype=torch.float64)  # device-ok: host-side
        penalty = overlong_penalty(lengths, d.max_response_length or max_new_tokens, d.overlong_buffer, d.overlong_penalty_factor)
        for s, p in zip(batch.samples, penalty.tolist()):
            s.reward += p
    n = max(len(batch.samples), 1)
    return {
        "reward/mean": float(raw.mean()) if len(raw) else float("nan"),
        "reward/shaped_mean": sum(s.reward for s in batch.samples) / n,
        "accuracy/train": sum(s.correct for s in batch.samples) / n,
    }


def advantages(batch: RolloutBatch, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-sample advantages and a keep-mask (DAPO dynamic sampling zeroes groups with no reward spread)."""
    rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)  # device-ok: host-side rewards
    n = batch.n_per_prompt
    a = algo.advantage
    adv = compute_advantages(rewards, n, a.estimator, std_eps=a.std_eps, unbiased_std=a.unbiased_std)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    if algo.dapo.dynamic_sampling:
        keep = expand_group_mask(dynamic_sampling_keep(rewards, n), n)
    groups = rewards.view(-1, n)
    solved = (groups.std(dim=1) == 0).float().mean() if n > 1 else torch.tensor(1.0)  # device-ok: host-side metric
    return adv * keep, keep, {"adv/abs_mean": float(adv.abs().mean()), "groups/no_spread_frac": float(solved), "samples/kept_frac": float(keep.float().mean())}
