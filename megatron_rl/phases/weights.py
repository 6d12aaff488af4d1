"""Weight-sync phase: Megatron shards -> full HF-named tensors -> (FP8 rollout format) -> engines.

Trainer and rollout quantize from identical bits: the HF tensors are exactly the learner's
parameters (gathered, then renamed), and FP8 rollout weights are quantized from those.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.models import hf_mapping


def export_hf_state_dict(learner) -> Optional[dict[str, torch.Tensor]]:
    """HF-named full weights on global rank 0 (None on other ranks); collective over the learner ranks."""
    full = learner.gather_full_state_dict()
    if full is None:
        return None
    return hf_mapping.to_hf(full, learner.arch)


def rollout_payload(hf_sd: dict[str, torch.Tensor], precision: PrecisionConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and config.json updates pushed to engines under the precision policy's rollout format."""
    from megatron_rl.precision.rollout_formats import rollout_format

    fmt = rollout_format(precision)
    return fmt.quantize_state_dict(hf_sd), fmt.config_updates()


def sync_weights(learner, transport, precision: PrecisionConfig, weight_version: int) -> dict[str, float]:
    """Push the learner's current weights to every engine as `weight_version`; returns metrics."""
    import time

    start = time.perf_counter()
    hf_sd = export_hf_state_dict(learner)
    if hf_sd is None:
        return {}
    tensors, config_updates = rollout_payload(hf_sd, precision)
    transport.push(tensors, weight_version, config_updates)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"sync/bytes": float(nbytes), "sync/time_s": time.perf_counter() - start}
