"""Training-health phase: which steps may reach the engines and the checkpoints, and when the run stops.

After a step's updates every rank calls `HealthGuard.check` (a collective):

1. skipped updates: the Learner already skipped, on every rank, each optimizer update whose loss or
   gradient norm was non-finite on any rank (Learner.train_step);
2. the updated policy (train.health.check_updated_policy): one no-grad forward of the new weights
   on one micro-batch per DP rank; non-finite log-probs or entropy mean the weights are broken
   even if every update looked finite (e.g. lr=1e20 leaves finite weights that overflow);
3. divergence signals (train.health.max_entropy_frac, entropy_jump, max_kl_ref, reward_drop),
   judged on the controller, which holds the reward metrics, and broadcast.

A step with (1) or (2) is unhealthy: its weights are not synced to the engines (they keep serving
the last healthy version) and not checkpointed. `max_consecutive_skips` unhealthy steps in a row,
or a tripped divergence signal, stop the run (TrainingHealthError, one line) before that step's
weights are synced or saved, so the newest checkpoint is the last one whose step passed every check.
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
    """The run stopped itself: too many unhealthy steps in a row, or a divergence signal tripped."""


@dataclass
class Verdict:
    """What the loop may do with this step's weights."""

    ok: bool
    """Sync the weights to the engines and allow a checkpoint (healthy and not stopping)."""
    stop: Optional[str] = None
    """Why the run stops now (None: it goes on)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """health/* metrics of the step."""


class HealthGuard:
    """Counts unhealthy steps and judges divergence signals; its state is checkpointed with the RL state."""

    def __init__(self, cfg: HealthConfig, vocab_size: int, updates_per_step: int) -> None:
        """`updates_per_step` optimizer updates make one RL step (ppo_epochs * num_minibatches)."""
        self.cfg = cfg
        self.max_entropy = math.log(vocab_size)
        self.updates_per_step = updates_per_step
        self.skipped_steps = 0
        self.consecutive = 0
        self.entropies: list[float] = []
        self.rewards: list[float] = []
        self.best_reward = -math.inf

    # ------------------------------------------------------------------ checks
    def probe(self, learner, batch: TrainBatch, micro_batch_size: int) -> dict[str, float]:
        """Entropy and non-finite fraction of the updated policy's tokens on one micro-batch per DP rank (collective).

        The probed rows are the batch's first DP x micro_batch_size rows, the same set under any layout
        with the same global micro-batch, so the metric matches a single-process run.
        """
        vpp = learner.parallel_cfg.virtual_pipeline_model_parallel_size
        rows = micro_batch_size * (state.pp_size() if vpp else 1)  # the interleaved schedule needs PP micro-batches
        shard = dp_shard(batch.select(slice(0, rows * state.dp_size())), state.dp_rank(), state.dp_size())
        lp, ent = learner.forward_logprobs(shard, micro_batch_size)
        mask = shard.loss_mask > 0
        finite = torch.isfinite(lp) & torch.isfinite(ent)
        good = mask & finite
        local = torch.stack([torch.where(good, ent, torch.zeros_like(ent)).double().sum(), good.double().sum(),
                             (mask & ~finite).double().sum()])
        ent_sum, n_good, n_bad = all_gather_dp_rows(local[None]).sum(dim=0).tolist()
        return {"health/probe_entropy": ent_sum / n_good if n_good else math.nan,
                "health/probe_nonfinite_frac": n_bad / max(n_good + n_bad, 1.0)}

    def check(self, learner, batch: TrainBatch, micro_batch_size: int, metrics: dict[str, float], step: int,
              checkpoint_root: str) -> Verdict:
        """This step's verdict, identical on every rank (collective: the probe forward and one broadcast)."""
        skipped_updates = round(float(metrics.get("learner/update_skipped", 0.0)) * self.updates_per_step)
        probe = self.probe(learner, batch, micro_batch_size) if self.cfg.check_updated_policy else {}
        healthy = skipped_updates == 0 and not probe.get("health/probe_nonfinite_frac", 0.0) > 0
        decision = self._decide(healthy, {**metrics, **probe}, step, checkpoint_root) if state.is_controller() else None
        stop, health_metrics = broadcast_from_controller(decision)
        return Verdict(ok=healthy and stop is None, stop=stop,
                       metrics={**probe, **health_metrics, "health/skipped_updates": float(skipped_updates)})

    def _decide(self, healthy: bool, metrics: dict[str, float], step: int, checkpoint_root: str) -> tuple[Optional[str], dict]:
        """(stop message or None, counters): the controller's judgement, broadcast by `check`."""
        c = self.cfg
        self.consecutive = 0 if healthy else self.consecutive + 1
        self.skipped_steps += 0 if healthy else 1
        reasons = []
        if self.consecutive >= c.max_consecutive_skips:
            reasons.append(f"{self.consecutive} consecutive steps had non-finite losses, gradients or weights "
                           f"(train.health.max_consecutive_skips={c.max_consecutive_skips}); lower optim.lr or check the data")
        entropy = metrics.get("health/probe_entropy", metrics.get("entropy_old", math.nan))
        frac = entropy / self.max_entropy if self.max_entropy > 0 else math.nan
        if healthy and math.isfinite(entropy):
            if c.max_entropy_frac is not None and frac > c.max_entropy_frac:
                reasons.append(f"policy entropy {entropy:.3g} nats is {frac:.0%} of a uniform policy's ln(vocab)="
                               f"{self.max_entropy:.3g} (train.health.max_entropy_frac={c.max_entropy_frac}): the policy "
                               "collapsed; lower optim.lr")
            recent = self.entropies[-c.window:]
            if c.entropy_jump is not None and recent and entropy > c.entropy_jump * (sum(recent) / len(recent)):
                reasons.append(f"policy entropy jumped to {entropy:.3g} nats, over {c.entropy_jump}x the mean "
                               f"{sum(recent) / len(recent):.3g} of the previous {len(recent)} steps (train.health.entropy_jump)")
            self.entropies = (self.entropies + [entropy])[-c.window:]
        kl = metrics.get("kl_ref", math.nan)
        if c.max_kl_ref is not None and math.isfinite(kl) and kl > c.max_kl_ref:
            reasons.append(f"KL to the reference policy {kl:.3g} exceeds train.health.max_kl_ref={c.max_kl_ref}")
        reward = metrics.get("reward/mean", math.nan)
        if c.reward_drop is not None and math.isfinite(reward):
            self.rewards = (self.rewards + [reward])[-c.window:]
            if len(self.rewards) == c.window:
                mean = sum(self.rewards) / c.window
                self.best_reward = max(self.best_reward, mean)
                if self.best_reward - mean > c.reward_drop:
                    reasons.append(f"train reward collapsed: mean {mean:.3g} over the last {c.window} steps, down from "
                                   f"{self.best_reward:.3g} (train.health.reward_drop={c.reward_drop})")
        stop = None
        if reasons:
            from megatron_rl.trainer.checkpoint import latest_checkpoint

            newest = latest_checkpoint(checkpoint_root)
            stop = (f"training stopped at step {step}: {'; '.join(reasons)}. This step's weights were neither synced nor "
                    f"saved; newest checkpoint: {newest or 'none'}")
        return stop, {"health/step_skipped": 0.0 if healthy else 1.0, "health/skipped_steps": float(self.skipped_steps),
                      "health/consecutive_skips": float(self.consecutive), "health/entropy_frac": frac}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Counters and signal histories (checkpointed, so a resumed run judges exactly as an uninterrupted one)."""
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive, "entropies": list(self.entropies),
                "rewards": list(self.rewards), "best_reward": self.best_reward}

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()` output."""
        self.skipped_steps, self.consecutive = int(sd["skipped_steps"]), int(sd["consecutive"])
        self.entropies, self.rewards = list(sd["entropies"]), list(sd["rewards"])
        self.best_reward = float(sd["best_reward"])
