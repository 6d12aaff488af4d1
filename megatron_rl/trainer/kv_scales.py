"""The learner's measurement of per-layer K/V amax as an FP8 KV cache would store them (precision/kv_scales.py has the
rule that turns them into scales).

Hook point: a forward pre-hook on every transformer layer's `self_attention.core_attention`. megatron-core 0.16.1's
`Attention.forward` (megatron/core/transformer/attention.py) calls
`self.core_attention(query, key, value, attention_mask, attn_mask_type=..., ...)` after
`get_query_key_value_tensors` (which applies `k_layernorm`, Qwen3's k-norm) and after `apply_rotary_pos_emb` on the
key (or `apply_fused_qkv_rotary_pos_emb`): the key and value it passes are what an engine's cache stores, shaped
[s, b, groups / TP, head_dim] (this rank's KV heads and, under CP, its sequence chunks). The same call reaches
`SDPACoreAttention` (local spec, trainer/spec.py) and `TEDotProductAttention` (TE spec,
megatron/core/extensions/transformer_engine.py, a `te.pytorch.DotProductAttention`), so the one hook serves CPU and
GPU learners. `checkpoint_core_attention` calls the module through `_checkpointed_attention_forward`, so its hooks
fire as well (only no-grad forwards record here).

Positions: only those an engine caches count, i.e. each sample's prompt and response tokens but the last (the
learner's input ids), never the right padding (`cached_positions`). The learner hands each micro-batch's positions
over before its forward (`Learner.kv_probe`).

Cost: per layer and micro-batch two reductions of |K| and |V| on the device (no host synchronisation), and one
all-reduce (MAX) of an [L, 2] tensor over every learner rank when the forward is done; K/V heads are TP-sharded,
rows DP-sharded, sequences CP-chunked and layers PP-staged, and the max over all ranks covers each.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist


def cached_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: positions up to each row's last loss-masked token (prompt and response; the padding is False)."""
    m = loss_mask > 0
    return m.flip(-1).cumsum(-1).flip(-1) > 0


class KvAmaxProbe:
    """Forward pre-hooks on the learner's core attention modules that record per-layer K/V amax while `recording()`."""

    def __init__(self, learner) -> None:
        """Hook every layer of `learner`'s model chunks (global layer index from megatron's 1-based layer_number)."""
        from megatron_rl.trainer.model import unwrap

        self.learner = learner
        self.num_layers = int(learner.config.num_layers)
        self.active = False
        self._positions: Optional[torch.Tensor] = None
        self._amax: Optional[torch.Tensor] = None
        self._handles = []
        for chunk in learner.model:
            for layer in unwrap(chunk).decoder.layers:
                index = int(layer.layer_number) - 1
                hook = self._hook(index)
                self._handles.append(layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True))
        learner.kv_probe = self

    def _hook(self, index: int):
        def pre_hook(module, args, kwargs):
            if not self.active:
                return None
            key = args[1] if len(args) > 1 else kwargs["key"]
            value = args[2] if len(args) > 2 else kwargs["value"]
            self._record(index, key, value)
            return None

        return pre_hook

    def set_positions(self, positions: Optional[torch.Tensor]) -> None:
        """[b, s] bool positions of the next micro-batch (this rank's CP layout) that count; None: all."""
        self._positions = positions

    def _record(self, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        with torch.no_grad():
            if self._amax is None:
                self._amax = torch.zeros(self.num_layers, 2, dtype=torch.float32, device=key.device)
            for j, x in enumerate((key, value)):
                per_token = x.detach().abs().amax(dim=tuple(range(2, x.dim()))).float()  # [s, b]
                if self._positions is not None:
                    keep = self._positions.to(per_token.device).t()
                    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
                self._amax[index, j] = torch.maximum(self._amax[index, j], per_token.amax())

    @contextmanager
    def recording(self) -> Iterator["KvAmaxProbe"]:
        """Record during the forwards inside (no-grad ones); `result()` afterwards."""
        self._amax, self.active = None, True
        try:
            yield self
        finally:
            self.active, self._positions = False, None

    def result(self) -> torch.Tensor:
        """[L, 2] float64 (K, V) amax of the last recording, max-reduced over every learner rank (collective)."""
        device = self.learner._comm_device()
        local = self._amax.to(device) if self._amax is not None else torch.zeros(self.num_layers, 2, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local.to(device="cpu", dtype=torch.float64)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(self.learner, "kv_probe", None) is self:
            self.learner.kv_probe = None
