"""Analytic step time and per-step communication of an RL step (learner FLOPs at a stated MFU, rollout from a
stated or bandwidth-derived decode throughput, weight sync and calibration bytes).

These are planning estimates with every assumption on the table, not predictions: the CLI prints
the MFU, decode throughput and link bandwidths it used so a measured run can be compared line by line
(tools/scaling_report.py puts the two side by side).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_rl.models.presets import Architecture
from megatron_rl.plan.memory import BF16, layer_linear_params


def forward_flops_per_token(arch: Architecture, context: float) -> float:
    """Forward FLOPs per token: 2 N + 2 L n_ctx d_attn (Kaplan et al. 2020, "Scaling Laws for Neural Language
    Models", Table 1), N = GEMM weights of all layers + the output layer V h, d_attn = a d, n_ctx = mean attended
    context (S / 2 under a causal mask)."""
    n = arch.num_layers * layer_linear_params(arch) + arch.vocab_size * arch.hidden_size
    return 2.0 * n + 2.0 * arch.num_layers * context * arch.num_attention_heads * arch.head_dim


@dataclass
class LearnerFlops:
    """FLOPs of the learner's work in one RL step."""

    train: float
    """ppo_epochs x 3 x forward (forward + backward = 3 forwards, Kaplan's C = 6 N per token)."""
    forward_only: float
    """Old log-probs (1 forward) + KL reference forward when on."""
    shadow: float
    """High-precision forwards per step (`high_precision_forwards`): those of a clip decided on high-precision ratios on
    every step (strength=decision or algo.policy_loss.clip_decision=high_precision: every answer; strength=targeted:
    x targeted_fraction), else the calibration shadow's, x shadow_fraction / calibrate_every (amortised over its events)."""

    @property
    def total(self) -> float:
        """All learner FLOPs per step."""
        return self.train + self.forward_only + self.shadow


def high_precision_forwards(num_minibatches: int, ppo_epochs: int) -> float:
    """Step batches of high-precision forwards a step with a shadow (or a high-precision clip decision) runs: pi_old on
    every row an off-policy update trains on (all but the first mini-batch's with one epoch: phases/batching.py
    on_policy_only_rows) and the current policy on each off-policy update's rows, U - 1 updates of 1 / num_minibatches
    each (U = num_minibatches x ppo_epochs). 2 mini-batches, 1 epoch: 0.5 + 0.5 = 1."""
    updates = num_minibatches * ppo_epochs
    on_policy_only = 1 / num_minibatches if ppo_epochs == 1 and num_minibatches >= 2 else 0.0
    return (1 - on_policy_only) + (updates - 1) / num_minibatches


def learner_flops(arch: Architecture, tokens: float, context: float, *, ppo_epochs: int, kl: bool,
                  calibrating: bool, calibrate_every: int, shadow_fraction: float, num_minibatches: int,
                  decision_share: float = 0.0) -> LearnerFlops:
    """Learner FLOPs per step for `tokens` trained tokens (see LearnerFlops for each term). `decision_share` (> 0):
    that share of the answers has its clip decided on high-precision ratios on every step
    (AlgoConfig.every_step_hp_share; no calibration event adds a shadow of its own then)."""
    fwd = forward_flops_per_token(arch, context) * tokens
    share = high_precision_forwards(num_minibatches, ppo_epochs)
    shadow = 0.0
    if decision_share > 0:
        shadow = fwd * share * decision_share
    elif calibrating:
        shadow = fwd * share * shadow_fraction / calibrate_every
    return LearnerFlops(train=3 * fwd * ppo_epochs, forward_only=fwd * (2 if kl else 1), shadow=shadow)


def decode_tokens_per_s(weight_bytes_per_gpu: int, kv_bytes_per_token: int, batch: int, mean_context: float,
                        hbm_bytes_per_s: float, bandwidth_efficiency: float) -> float:
    """Decode throughput of one replica when memory-bound (Pope et al. 2022, "Efficiently Scaling Transformer
    Inference", sec. 2): each decode iteration streams the weights and the batch's KV cache once, so
    tokens/s = B / ((W + B x ctx x kv) / (HBM bandwidth x efficiency)), all per engine GPU."""
    per_iteration = (weight_bytes_per_gpu + batch * mean_context * kv_bytes_per_token) / (hbm_bytes_per_s * bandwidth_efficiency)
    return batch / per_iteration


def weight_sync_bytes(arch: Architecture, fp8: bool) -> int:
    """Bytes pushed per weight sync: the served checkpoint (GEMM weights 1 byte + block scales under FP8, else BF16;
    the rest BF16), see memory.served_weight_bytes."""
    from megatron_rl.plan.memory import served_weight_bytes

    return served_weight_bytes(arch, fp8)


def calibration_step_bytes(backend: str, *, world_size: int, tokens_per_rank: int, solves: int,
                           max_samples_per_rank: int, hist_bins: int, hist_log_min: float, hist_log_max: float) -> int:
    """Bytes one rank receives for Calibrated Clipping in a calibration step: `solves` x algo.calibration's
    calibration_bytes (ring all-gather of (ratio, advantage, weight) float64 rows, or all-reduce of the histogram)
    + reference_bytes (all-reduce of 5 float64 for the targets)."""
    from megatron_rl.algo.calibration import calibration_bytes, reference_bytes
    from megatron_rl.algo.ratio_stats import HistSpec

    spec = HistSpec(bins=hist_bins, log_min=hist_log_min, log_max=hist_log_max)
    per_solve = calibration_bytes(backend, world_size=world_size, tokens_per_rank=tokens_per_rank,
                                  max_samples_per_rank=max_samples_per_rank, hist_spec=spec)
    return solves * per_solve + reference_bytes(world_size)


@dataclass
class StepTime:
    """Seconds per RL step, by phase."""

    rollout: float
    """Prefill + decode of the step's samples on the engines."""
    learner: float
    """Learner FLOPs / (GPUs x peak x MFU) (/ the FP8 speed-up on FP8 passes)."""
    weight_sync: float
    """Weight-sync bytes / the sender's network bandwidth."""
    overlapped: bool
    """rollout.overlap=one_step_off: rollout runs beside training."""

    @property
    def total(self) -> float:
        """Step time: rollout + learner + sync, or max(rollout, learner) + sync when overlapped."""
        work = max(self.rollout, self.learner) if self.overlapped else self.rollout + self.learner
        return work + self.weight_sync


def learner_seconds(flops: LearnerFlops, gpus: int, peak_flops: float, mfu: float, fp8_speedup: float,
                    high_precision_share: float = 0.0) -> float:
    """(train + forward_only) / fp8_speedup + shadow (the shadow pass is high precision), over gpus x peak x MFU;
    `high_precision_share` of the FP8 passes' FLOPs (layers kept in high precision,
    precision.first_last_layers_high_precision) runs without the speed-up."""
    if gpus <= 0:
        return math.inf
    fp8_passes = (flops.train + flops.forward_only) * ((1 - high_precision_share) / fp8_speedup + high_precision_share)
    return (fp8_passes + flops.shadow) / (gpus * peak_flops * mfu)


def rollout_seconds(*, prompts: int, samples: int, prompt_tokens: int, response_tokens: float, replicas: int,
                    engine_gpus: int, prefill_flops_per_token: float, peak_flops: float, mfu: float,
                    decode_tps: float) -> float:
    """Prefill once per prompt (the n samples share the cached prefix) at MFU + decode of each replica's share
    of response tokens at `decode_tps` per replica (the tail of a step, where the batch thins out, is ignored)."""
    if replicas <= 0 or engine_gpus <= 0 or decode_tps <= 0:
        return math.inf
    prefill = prompts * prompt_tokens * prefill_flops_per_token / (engine_gpus * peak_flops * mfu)
    decode = samples * response_tokens / replicas / decode_tps
    return prefill + decode


def sync_seconds(payload_bytes: int, network_bytes_per_s: float, engines_present: bool) -> float:
    """payload / bandwidth: a pipelined broadcast (NCCL) or file transfer is bounded by the sender's link."""
    return payload_bytes / network_bytes_per_s if engines_present else 0.0


def bytes_per_token_bf16(arch: Architecture) -> int:
    """BF16 bytes of one token's hidden state (h x 2), e.g. for pipeline send/recv sizing."""
    return arch.hidden_size * BF16


def overlapped(rollout_cfg) -> bool:
    """True when the rollout config asks for one-step-off overlap (a field the rollout-topology work adds)."""
    return str(getattr(rollout_cfg, "overlap", "none")) == "one_step_off"


def optional_override(value: Optional[float], derived: float) -> float:
    """A user-stated number when given, else the derived one."""
    return derived if value is None else float(value)
