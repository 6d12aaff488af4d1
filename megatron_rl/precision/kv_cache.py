"""The embedded engine's KV cache: HF DynamicCache layers with preallocated buffers, and the FP8 emulation of
SGLang's ``--kv-cache-dtype fp8_e4m3`` on them.

What SGLang does (mem_cache/memory_pool.py ``set_kv_buffer`` and layers/quantization/kv_cache.py):
each attention layer has one per-tensor ``k_scale`` and ``v_scale``; they come from the checkpoint or a
weight update when it carries them and are 1.0 otherwise (precision/kv_scales.py: what the learner measures,
which names load, when they take effect). K and V are stored as ``(x / scale).to(float8_e4m3fn)`` and the
attention kernels read them back multiplied by the scale.

The emulation applies exactly that to every K and V entering the cache, in prefill and decode, and
lets attention read the dequantized values (fp32 ``q * scale``) — so the attention of a request
sees FP8 K/V for all its tokens, as with SGLang's paged attention paths. Values beyond +-448 * scale
saturate here; SGLang casts without clamping, so only such outliers (possible with the default scale
1.0) may differ. transformers' own FP8 cache calibrates its scale on the first prompt and returns that prompt's K/V unquantized,
which is not SGLang's behaviour, hence this small layer class.

What it does not emulate: Q. SGLang's FlashAttention-3 backend (layers/attention/flashattention_backend.py,
`forward_extend` / `forward_decode`: with kv_cache_dtype != "auto" and head_dim <= 256 it passes k_scale / v_scale as
k_descale / v_descale and casts `q = q.to(self.kv_cache_dtype)`, with no q scale) also rounds Q to E4M3 at scale 1.0;
flashinfer and triton keep Q in the model dtype. This cache matches the latter. Measured offline on the main job's warm
start (256 held-out sequences, KL against an fp32 cache): FP8 K/V 3.05e-3, Q alone 0.72e-3, both 3.51e-3, so on a
Hopper engine with FA3 expect about 15% more mismatch than the CPU runs show; no K/V scale reaches Q.
"""
from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from megatron_rl.precision.numerics import E4M3_MAX

KvCacheDtype = Literal["auto", "fp8_e4m3"]
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""Values of precision.kv_cache_dtype (also SGLang's --kv-cache-dtype values)."""
DEFAULT_KV_SCALE = 1.0
"""SGLang's k_scale / v_scale when the checkpoint provides none."""


def fake_quantize_kv(x: torch.Tensor, scale: float = DEFAULT_KV_SCALE) -> torch.Tensor:
    """dequant(quant(x)) of K or V through an E4M3 cache with per-tensor `scale`, in x's dtype."""
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)
    q = torch.clamp(x.float() / s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def _layer_classes():
    """(preallocated layer, its FP8 variant): transformers' DynamicLayer with capacity reserved up front."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer that writes into buffers reserved for `capacity` positions instead of concatenating.

        DynamicLayer's torch.cat per layer per decoded token copies the whole cache every step (a fifth of the
        embedded engine's decode time at 64 positions); here each step writes its new positions in place and the
        returned K/V are views of the filled part. Grows by doubling when a request outlives the reservation."""

        def __init__(self, capacity: int = 0, **kwargs):
            super().__init__(**kwargs)
            self.capacity = max(int(capacity), 1)
            self._filled = 0
            self._kbuf = self._vbuf = None

        def _store(self, key_states, value_states):
            """(keys, values) as the cache stores them (overridden by the FP8 layer)."""
            return key_states, value_states

        def update(self, key_states, value_states, *args, **kwargs):
            """Write the new positions in place; return the views of every cached position."""
            key_states, value_states = self._store(key_states, value_states)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = key_states.shape[-2]
            if self._kbuf is None or self._filled + new > self._kbuf.shape[-2] or \
                    self._kbuf.shape[0] != key_states.shape[0]:
                self._grow(key_states, value_states, self._filled + new)
            end = self._filled + new
            self._kbuf[..., self._filled:end, :] = key_states
            self._vbuf[..., self._filled:end, :] = value_states
            self._filled = end
            self.keys, self.values = self._kbuf[..., :end, :], self._vbuf[..., :end, :]
            return self.keys, self.values

        def _grow(self, key_states, value_states, need: int) -> None:
            cap = max(self.capacity, need)
            if self._kbuf is not None:
                cap = max(cap, 2 * self._kbuf.shape[-2])
            kshape = (*key_states.shape[:-2], cap, key_states.shape[-1])
            vshape = (*value_states.shape[:-2], cap, value_states.shape[-1])
            kbuf = key_states.new_empty(kshape)
            vbuf = value_states.new_empty(vshape)
            if self._kbuf is not None and self._filled:
                kbuf[..., :self._filled, :] = self._kbuf[..., :self._filled, :]
                vbuf[..., :self._filled, :] = self._vbuf[..., :self._filled, :]
            self._kbuf, self._vbuf = kbuf, vbuf

        def get_seq_length(self) -> int:
            """Positions cached so far."""
            return self._filled if self.is_initialized else 0

        def batch_select_indices(self, indices) -> None:
            """Keep only the rows `indices` (finished requests leave the batch)."""
            if self._kbuf is not None:
                self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
                self.keys, self.values = self._kbuf[..., :self._filled, :], self._vbuf[..., :self._filled, :]

        def batch_repeat_interleave(self, repeats: int) -> None:
            """Repeat every row `repeats` times."""
            if self._kbuf is not None:
                self._kbuf = self._kbuf.repeat_interleave(repeats, dim=0)
                self._vbuf = self._vbuf.repeat_interleave(repeats, dim=0)
                self.keys, self.values = self._kbuf[..., :self._filled, :], self._vbuf[..., :self._filled, :]

        def crop(self, tokens_to_remove: int) -> None:
            """Forget the last `-tokens_to_remove` positions (HF's negative-count convention)."""
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative number of positions to remove")
            if tokens_to_remove and self._kbuf is not None:
                self._filled = max(self._filled + tokens_to_remove, 0)
                self.keys, self.values = self._kbuf[..., :self._filled, :], self._vbuf[..., :self._filled, :]

        def reset(self) -> None:
            """Drop every position (the buffers are freed)."""
            self._kbuf = self._vbuf = None
            self._filled = 0
            super().reset()

    class Fp8KVCacheLayer(PreallocatedLayer):
        """A preallocated layer whose stored K/V went through an E4M3 cache with fixed per-tensor scales."""

        def __init__(self, k_scale: float = DEFAULT_KV_SCALE, v_scale: float = DEFAULT_KV_SCALE, **kwargs):
            super().__init__(**kwargs)
            self.k_scale, self.v_scale = float(k_scale), float(v_scale)

        def _store(self, key_states, value_states):
            """Quantize the new K/V as SGLang's set_kv_buffer does."""
            return fake_quantize_kv(key_states, self.k_scale), fake_quantize_kv(value_states, self.v_scale)

    return PreallocatedLayer, Fp8KVCacheLayer


def new_kv_cache(config, kv_cache_dtype: KvCacheDtype = "auto", capacity: int = 0,
                 scales: Optional[Sequence[tuple[float, float]]] = None):
    """An empty HF DynamicCache for `config` whose full-attention layers reserve `capacity` positions up front;
    with fp8_e4m3 every such layer stores FP8 K/V with its (k_scale, v_scale) from `scales` (one pair per layer;
    None: SGLang's default 1.0)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers
        cache = DynamicCache()
    plain_cls, fp8_cls = _layer_classes()

    def make(i: int):
        if kv_cache_dtype == "auto":
            return plain_cls(capacity=capacity)
        k, v = scales[i] if scales is not None else (DEFAULT_KV_SCALE, DEFAULT_KV_SCALE)
        return fp8_cls(k_scale=k, v_scale=v, capacity=capacity)

    num = len(cache.layers) or int(getattr(config.get_text_config(decoder=True), "num_hidden_layers"))
    if scales is not None and len(scales) != num:
        raise ValueError(f"{len(scales)} K/V scale pairs for {num} attention layers")
    if not cache.layers:
        cache.layers = [make(i) for i in range(num)]
        cache.layer_class_to_replicate = None
        return cache
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            if kv_cache_dtype == "auto":
                return cache  # sliding-window layers keep transformers' own classes
            raise ValueError(f"kv_cache_dtype=fp8_e4m3 is emulated for full-attention layers only; layer {i} uses "
                             f"{type(layer).__name__}")
    cache.layers = [make(i) for i in range(num)]
    return cache
