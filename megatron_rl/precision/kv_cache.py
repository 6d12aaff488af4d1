"""FP8 KV-cache emulation for the embedded engine: SGLang's ``--kv-cache-dtype fp8_e4m3``, on an HF DynamicCache.

What SGLang does (mem_cache/memory_pool.py ``set_kv_buffer`` and layers/quantization/kv_cache.py):
each attention layer has one per-tensor ``k_scale`` and ``v_scale``; they come from the checkpoint
when it carries them and are 1.0 otherwise (the exported rollout checkpoints never carry them, so
SGLang serving them uses 1.0). K and V are stored as ``(x / scale).to(float8_e4m3fn)`` and the
attention kernels read them back multiplied by the scale.

The emulation applies exactly that to every K and V entering the cache, in prefill and decode, and
lets attention read the dequantized values (fp32 ``q * scale``) — so the attention of a request
sees FP8 K/V for all its tokens, as with SGLang's paged attention paths. Values beyond +-448 * scale
saturate here; SGLang casts without clamping, so only such outliers (possible with the default scale
1.0) may differ. transformers' own FP8 cache calibrates its scale on the first prompt and returns that prompt's K/V unquantized,
which is not SGLang's behaviour, hence this small layer class.
"""
from __future__ import annotations

from typing import Literal

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


def _fp8_layer_class():
    from transformers.cache_utils import DynamicLayer

    class Fp8KVCacheLayer(DynamicLayer):
        """A DynamicLayer whose stored K/V went through an E4M3 cache with fixed per-tensor scales."""

        def __init__(self, k_scale: float = DEFAULT_KV_SCALE, v_scale: float = DEFAULT_KV_SCALE, **kwargs):
            super().__init__(**kwargs)
            self.k_scale, self.v_scale = float(k_scale), float(v_scale)

        def update(self, key_states, value_states, *args, **kwargs):
            """Quantize the new K/V as SGLang's set_kv_buffer does, append, return the whole (dequantized) cache."""
            return super().update(fake_quantize_kv(key_states, self.k_scale),
                                  fake_quantize_kv(value_states, self.v_scale), *args, **kwargs)

    return Fp8KVCacheLayer


def new_kv_cache(config, kv_cache_dtype: KvCacheDtype = "auto"):
    """An empty HF DynamicCache for `config`; with fp8_e4m3 every full-attention layer stores FP8 K/V (scales 1.0)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers
        cache = DynamicCache()
    if kv_cache_dtype == "auto":
        return cache
    layer_cls = _fp8_layer_class()
    if not cache.layers:
        num = int(getattr(config.get_text_config(decoder=True), "num_hidden_layers"))
        cache.layers = [layer_cls() for _ in range(num)]
        cache.layer_class_to_replicate = None
        return cache
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(f"kv_cache_dtype=fp8_e4m3 is emulated for full-attention layers only; layer {i} uses "
                             f"{type(layer).__name__}")
    cache.layers = [layer_cls() for _ in cache.layers]
    return cache
