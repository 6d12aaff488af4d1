"""Reward and advantage phases: score samples, shape rewards (DAPO), collect the step's groups, compute advantages.

DAPO dynamic sampling (`algo.dapo.dynamic_sampling`): groups whose n rewards all agree carry no
GRPO signal, so they are dropped from the step and more prompts are generated, round after round,
until `train.prompts_per_step` groups with reward spread are collected (surplus groups of the last
round are dropped too, as DAPO and verl align the batch). After `algo.dapo.max_gen_batches`
rounds that do not fill the step the run stops with a DynamicSamplingError naming that field, as
DAPO's reference implementation and verl's DAPO trainer do (a step with fewer groups would change
the batch geometry every later phase relies on).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.algo.dapo import dynamic_sampling_keep, overlong_penalty
from megatron_rl.config.algo import AlgoConfig, DapoConfig
from megatron_rl.reward import RewardFn
from megatron_rl.types import RolloutBatch


class DynamicSamplingError(RuntimeError):
    """DAPO dynamic sampling could not fill the step within algo.dapo.max_gen_batches generation rounds."""


def score(batch: RolloutBatch, reward_fn: RewardFn, algo: AlgoConfig, max_new_tokens: int,
          is_malformed: Optional[Callable[[str], bool]] = None) -> dict[str, float]:
    """Fill sample.reward / sample.correct in place (with DAPO overlong shaping when on); returns metrics.

    With `is_malformed` (the task's format check, data/tasks.malformed_checker) `malformed/train` is the
    fraction of the round's completions that do not parse in the task's format.
    """
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
    out = {
        "reward/mean": float(raw.mean()) if len(raw) else float("nan"),
        "reward/shaped_mean": sum(s.reward for s in batch.samples) / n,
        "accuracy/train": sum(s.correct for s in batch.samples) / n,
    }
    if is_malformed is not None:
        out["malformed/train"] = sum(is_malformed(s.response_text) for s in batch.samples) / n
    return out


class GroupCollector:
    """The step's prompt groups over one or more generation rounds (several only under DAPO dynamic sampling).

        collector = GroupCollector(prompts_per_step, cfg.algo.dapo)
        while collector.needs_more():
            collector.add(scored_rollout_batch, its_metrics)
        batch, metrics = collector.result()

    Rollout and reward metrics describe every generated sample of the step (the policy as sampled);
    `dapo/gen_batches` counts generation rounds and `dapo/filtered_frac` the fraction of generated
    groups dropped for having no reward spread.
    """

    def __init__(self, groups_per_step: int, dapo: DapoConfig) -> None:
        """Collect `groups_per_step` groups; filter and refill when `dapo.dynamic_sampling`."""
        self.target, self.dapo = groups_per_step, dapo
        self.rounds = 0
        """Generation rounds so far."""
        self.kept: list = []
        self.n_per_prompt = 0
        self.generated_groups = 0
        self.generated_samples = 0
        self.no_spread_groups = 0
        self._totals: dict[str, float] = {}
        self._mean_sums: dict[str, float] = {}

    def needs_more(self) -> bool:
        """Whether another generation round is needed; DynamicSamplingError when the round cap is reached."""
        if self.rounds == 0:
            return True
        if not self.dapo.dynamic_sampling or len(self.kept) >= self.target:
            return False
        cap = self.dapo.max_gen_batches
        if cap and self.rounds >= cap:
            raise DynamicSamplingError(
                f"algo.dapo.max_gen_batches={cap}: {self.rounds} generation rounds of {self.target} prompts gave only "
                f"{len(self.kept)} of the {self.target} groups with reward spread the step needs (every sample of the "
                f"others got the same reward); raise algo.dapo.max_gen_batches (0 = no limit) or use prompts the policy "
                "solves only sometimes")
        return True

    def add(self, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """Add one scored generation round and its rollout/reward metrics."""
        n = batch.n_per_prompt
        self.rounds += 1
        self.n_per_prompt = n
        groups = [batch.samples[i:i + n] for i in range(0, len(batch.samples), n)]
        rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float64)  # device-ok: host-side rewards
        spread = dynamic_sampling_keep(rewards, n) if n > 1 else torch.zeros(len(groups), dtype=torch.bool)  # device-ok: host-side
        self.generated_groups += len(groups)
        self.no_spread_groups += int((~spread).sum())
        keep = spread if self.dapo.dynamic_sampling else torch.ones_like(spread)
        self.kept += [g for g, k in zip(groups, keep.tolist()) if k]
        for key, value in {**batch.stats, **metrics}.items():
            if key.endswith("time_s"):  # wall time adds up over rounds
                self._totals[key] = self._totals.get(key, 0.0) + value
            elif key == "rollout/weight_version":  # the oldest weights any sample came from
                self._totals[key] = min(self._totals.get(key, value), value)
            elif key != "rollout/tokens_per_s":  # per-sample means, weighted by the round's samples
                self._mean_sums[key] = self._mean_sums.get(key, 0.0) + len(batch.samples) * value
        self.generated_samples += len(batch.samples)

    def result(self) -> tuple[RolloutBatch, dict[str, float]]:
        """(the step's RolloutBatch of exactly `groups_per_step` groups, prompt-major, group ids renumbered; metrics)."""
        samples = []
        for gid, group in enumerate(self.kept[: self.target]):
            for s in group:
                s.group_id = gid
                samples.append(s)
        metrics = {k: v / max(self.generated_samples, 1) for k, v in self._mean_sums.items()}
        metrics.update(self._totals)
        if "rollout/time_s" in metrics and "rollout/response_len_mean" in metrics:
            tokens = metrics["rollout/response_len_mean"] * self.generated_samples
            metrics["rollout/tokens_per_s"] = tokens / max(metrics["rollout/time_s"], 1e-9)
        metrics["groups/no_spread_frac"] = self.no_spread_groups / max(self.generated_groups, 1)
        if self.dapo.dynamic_sampling:
            metrics["dapo/gen_batches"] = float(self.rounds)
            metrics["dapo/filtered_frac"] = self.no_spread_groups / max(self.generated_groups, 1)
        return RolloutBatch(samples=samples, n_per_prompt=self.n_per_prompt), metrics


def advantages(batch: RolloutBatch, algo: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample advantages of the step's groups."""
    rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)  # device-ok: host-side rewards
    a = algo.advantage
    adv = compute_advantages(rewards, batch.n_per_prompt, a.estimator, std_eps=a.std_eps, unbiased_std=a.unbiased_std)
    return adv, {"adv/abs_mean": float(adv.abs().mean()), "adv/zero_frac": float((adv == 0).float().mean())}
