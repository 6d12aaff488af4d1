"""Training-health phase: which steps may reach the engines and the checkpoints, and when the run stops.

After a step's updates every rank calls `HealthGuard.check` (a collective):

1. skipped updates: the Learner already skipped, on every rank, each optimizer update whose loss or
   gradient norm was non-finite on any rank (Learner.train_step);
2. the updated policy (train.health.check_updated_policy): one no-grad forward of the new weights
   on one micro-batch per DP rank; non-finite log-probs or entropy mean the weights are broken
   even if every update looked finite (e.g. lr=1e20 leaves finite weights that overflow);
3. divergence and collapse signals (train.health.max_entropy_frac: toward uniform;
   collapse_step_entropy_frac and collapse_reward: toward a deterministic policy; optional
   entropy_jump, max_kl_ref, reward_drop), judged on the controller, which holds the reward
   metrics, and broadcast.

A step with (1) or (2) is unhealthy: its weights are not synced to the engines (they keep serving
the last healthy version) and not checkpointed. `max_consecutive_skips` unhealthy steps in a row,
or a tripped signal, stop the run (TrainingHealthError, one line).

Every signal judges the weights that produced its evidence (weight version v = the weights after
step v-1, held by checkpoint step_<v-1>): the probe judges this step's new weights (version step+1,
never synced or saved when condemned); the pre-update entropy and the KL judge the learner's
weights at the step's start (version step); rewards judge the weights that generated the step's
samples (`rollout/weight_version`: version step, or step-1 under rollout.overlap=one_step_off).
The verdict names the oldest condemned version (`Verdict.condemned`); phases/rollback.py then sets
aside every checkpoint holding it or a later one and puts engines that outlive the run back on the
newest healthy weights, so the newest checkpoint left holds weights whose own rollouts passed.
`vouched_version` is the newest version whose rollouts passed every check: the checkpoint holding
it is kept by retention however many newer ones are saved (runtime.save).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_rl.config.train import HealthConfig
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import all_gather_dp_rows, broadcast_from_controller
from megatron_rl.phases.batching import dp_shard
from megatron_rl.types import TrainBatch


class TrainingHealthError(RuntimeError):
    """The run stopped itself: too many unhealthy steps in a row, or a divergence or collapse signal tripped."""


@dataclass
class Verdict:
    """What the loop may do with this step's weights."""

    ok: bool
    """Sync the weights to the engines and allow a checkpoint (healthy and not stopping)."""
    stop: Optional[str] = None
    """Why the run stops now (None: it goes on)."""
    condemned: Optional[int] = None
    """With `stop`: the oldest weight version the tripped signals condemn (step+1: only this step's new weights)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """health/* metrics of the step."""


def probe_rows(learner, micro_batch_size: int) -> int:
    """Rows of the step batch the probe forwards: the first DP x micro_batch_size (x PP under VPP), the same set
    under any layout with the same global micro-batch."""
    vpp = learner.parallel_cfg.virtual_pipeline_model_parallel_size
    return micro_batch_size * (state.pp_size() if vpp else 1) * state.dp_size()  # interleaving needs PP micro-batches


class HealthGuard:
    """Counts unhealthy steps and judges the signals; its state is checkpointed with the RL state."""

    def __init__(self, cfg: HealthConfig, vocab_size: int, updates_per_step: int, rollout_lag: int = 0) -> None:
        """`updates_per_step` optimizer updates make one RL step (ppo_epochs * num_minibatches); `rollout_lag` is
        how many versions the step's samples trail the learner (1 under one_step_off) when the engines report none."""
        self.cfg = cfg
        self.max_entropy = math.log(vocab_size)
        self.updates_per_step = updates_per_step
        self.rollout_lag = rollout_lag
        self.skipped_steps = 0
        self.consecutive = 0
        self.entropies: list[float] = []
        self.rewards: list[float] = []
        self.best_reward = -math.inf
        self.peak_reward = -math.inf
        self.peak_entropy = -math.inf
        self.vouched_version = 0

    # ------------------------------------------------------------------ checks
    def probe(self, learner, batch: TrainBatch, micro_batch_size: int) -> dict[str, float]:
        """Entropy and non-finite fraction of the updated policy's tokens on the probe rows (collective)."""
        shard = dp_shard(batch.select(slice(0, probe_rows(learner, micro_batch_size))), state.dp_rank(), state.dp_size())
        lp, ent = learner.forward_logprobs(shard, micro_batch_size)
        mask = shard.loss_mask > 0
        finite = torch.isfinite(lp) & torch.isfinite(ent)
        good = mask & finite
        local = torch.stack([torch.where(good, ent, torch.zeros_like(ent)).double().sum(), good.double().sum(),
                             (mask & ~finite).double().sum()])
        ent_sum, n_good, n_bad = all_gather_dp_rows(local[None]).sum(dim=0).tolist()
        return {"health/probe_entropy": ent_sum / n_good if n_good else math.nan,
                "health/probe_nonfinite_frac": n_bad / max(n_good + n_bad, 1.0)}

    def check(self, learner, batch: TrainBatch, micro_batch_size: int, metrics: dict[str, float], step: int) -> Verdict:
        """This step's verdict, identical on every rank (collective: the probe forward and one broadcast)."""
        skipped_updates = round(float(metrics.get("learner/update_skipped", 0.0)) * self.updates_per_step)
        probe = self.probe(learner, batch, micro_batch_size) if self.cfg.check_updated_policy else {}
        healthy = skipped_updates == 0 and not probe.get("health/probe_nonfinite_frac", 0.0) > 0
        decision = self._decide(healthy, {**metrics, **probe}, step) if state.is_controller() else None
        stop, condemned, health_metrics = broadcast_from_controller(decision)
        return Verdict(ok=healthy and stop is None, stop=stop, condemned=condemned,
                       metrics={**probe, **health_metrics, "health/skipped_updates": float(skipped_updates)})

    def rollout_version(self, metrics: dict[str, float], step: int) -> int:
        """Weight version that generated the step's samples: the engines' report, else the step less the lag."""
        version = metrics.get("rollout/weight_version", math.nan)
        return int(version) if math.isfinite(version) else max(step - self.rollout_lag, 0)

    def _decide(self, healthy: bool, metrics: dict[str, float], step: int) -> tuple[Optional[str], Optional[int], dict]:
        """(stop message or None, oldest condemned version, counters): the controller's judgement, broadcast by `check`."""
        c = self.cfg
        self.consecutive = 0 if healthy else self.consecutive + 1
        self.skipped_steps += 0 if healthy else 1
        probed = "health/probe_entropy" in metrics
        new, learner, rollout = step + 1, step, self.rollout_version(metrics, step)
        reasons: list[tuple[str, int]] = []  # (why, the weight version its evidence judges)
        if self.consecutive >= c.max_consecutive_skips:
            reasons.append((f"{self.consecutive} consecutive steps had non-finite losses, gradients or weights "
                            f"(train.health.max_consecutive_skips={c.max_consecutive_skips}); lower optim.lr or check the data", new))
        entropy = metrics.get("health/probe_entropy", metrics.get("entropy_old", math.nan))
        judged = new if probed else learner
        frac = entropy / self.max_entropy if self.max_entropy > 0 else math.nan
        if healthy and math.isfinite(entropy):
            if c.max_entropy_frac is not None and frac > c.max_entropy_frac:
                reasons.append((f"policy entropy {entropy:.3g} nats is {frac:.0%} of a uniform policy's ln(vocab)="
                                f"{self.max_entropy:.3g} (train.health.max_entropy_frac={c.max_entropy_frac}): the policy "
                                "collapsed toward uniform; lower optim.lr", judged))
            before = metrics.get("health/probe_entropy_before", math.nan)
            if c.collapse_step_entropy_frac is not None and probed and before > 0 and entropy < c.collapse_step_entropy_frac * before:
                reasons.append((f"policy entropy fell from {before:.3g} to {entropy:.3g} nats on the same tokens in one step, "
                                f"below train.health.collapse_step_entropy_frac={c.collapse_step_entropy_frac} of it: the "
                                "policy collapsed toward a deterministic one; lower optim.lr", new))
            recent = self.entropies[-c.window:]
            if c.entropy_jump is not None and recent and entropy > c.entropy_jump * (sum(recent) / len(recent)):
                reasons.append((f"policy entropy jumped to {entropy:.3g} nats, over {c.entropy_jump}x the mean "
                                f"{sum(recent) / len(recent):.3g} of the previous {len(recent)} steps (train.health.entropy_jump)",
                                judged))
            self.entropies = (self.entropies + [entropy])[-c.window:]
        kl = metrics.get("kl_ref", math.nan)
        if c.max_kl_ref is not None and math.isfinite(kl) and kl > c.max_kl_ref:
            reasons.append((f"KL to the reference policy {kl:.3g} exceeds train.health.max_kl_ref={c.max_kl_ref}", learner))
        reward = metrics.get("reward/mean", math.nan)
        sampled_entropy = metrics.get("entropy_old", math.nan)  # the learner's weights at the step's start, on its samples
        if (c.collapse_reward is not None and math.isfinite(reward) and reward <= c.collapse_reward < self.peak_reward
                and sampled_entropy < c.collapse_entropy_frac * self.peak_entropy):
            reasons.append((f"train reward fell to {reward:.3g} (<= train.health.collapse_reward={c.collapse_reward}; it "
                            f"was {self.peak_reward:.3g}) with policy entropy {sampled_entropy:.3g} nats, below "
                            f"train.health.collapse_entropy_frac={c.collapse_entropy_frac} of the run's highest "
                            f"{self.peak_entropy:.3g}: the policy collapsed onto wrong answers; lower optim.lr",
                            min(rollout, learner)))
        if math.isfinite(reward):
            self.peak_reward = max(self.peak_reward, reward)
        if math.isfinite(sampled_entropy):
            self.peak_entropy = max(self.peak_entropy, sampled_entropy)
        if c.reward_drop is not None and math.isfinite(reward):
            self.rewards = (self.rewards + [reward])[-c.window:]
            if len(self.rewards) == c.window:
                mean = sum(self.rewards) / c.window
                self.best_reward = max(self.best_reward, mean)
                if self.best_reward - mean > c.reward_drop:
                    reasons.append((f"train reward collapsed: mean {mean:.3g} over the last {c.window} steps, down from "
                                    f"{self.best_reward:.3g} (train.health.reward_drop={c.reward_drop})", rollout))
        stop, condemned = None, None
        if reasons:
            condemned = min(version for _, version in reasons)
            stop = f"training stopped at step {step}: {'; '.join(why for why, _ in reasons)}"
        else:
            self.vouched_version = max(self.vouched_version, rollout)
        return stop, condemned, {"health/step_skipped": 0.0 if healthy else 1.0,
                                 "health/skipped_steps": float(self.skipped_steps),
                                 "health/consecutive_skips": float(self.consecutive), "health/entropy_frac": frac}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Counters and signal histories (checkpointed, so a resumed run judges exactly as an uninterrupted one)."""
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive, "entropies": list(self.entropies),
                "rewards": list(self.rewards), "best_reward": self.best_reward, "peak_reward": self.peak_reward,
                "peak_entropy": self.peak_entropy, "vouched_version": self.vouched_version}

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()` output."""
        self.skipped_steps, self.consecutive = int(sd["skipped_steps"]), int(sd["consecutive"])
        self.entropies, self.rewards = list(sd["entropies"]), list(sd["rewards"])
        self.best_reward = float(sd["best_reward"])
        self.peak_reward = float(sd.get("peak_reward", -math.inf))  # absent in checkpoints of older versions
        self.peak_entropy = float(sd.get("peak_entropy", -math.inf))
        self.vouched_version = int(sd.get("vouched_version", 0))
