"""A function-preserving rescaling of an HF warm start that moves its V (and so its FP8 KV cache entries) by a factor:
every layer's `v_proj` (weight and bias) times `factor`, its `o_proj` weight divided by it.

Attention output is softmax(q k^T) V: each head's output scales with its V, and `o_proj` is linear in the heads'
outputs, so o_proj(attn(V * f)) / f = o_proj(attn(V)): the same model in exact arithmetic (floating point changes the
last bits, as any rescaling by a factor other than a power of two does). K cannot be moved this way under Qwen3's
k-norm (it renormalises K per head), so V carries the test. At unit FP8 KV scales, V x 1000 saturates the cache
(|V| beyond 448; SGLang's unclamped cast makes it NaN on a GPU) and V x 1e-4 underflows it (below E4M3's smallest
subnormal 2^-9 every entry is 0); recalibrated scales follow either.

    python tools/rescale_kv_values.py WARM_HF_DIR OUT_DIR --factor 1000
"""
from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from typing import Mapping

import torch

_V = re.compile(r"^(.*\.self_attn)\.v_proj\.(weight|bias)$")
_O = re.compile(r"^(.*\.self_attn)\.o_proj\.weight$")


def _rescale(tensors: Mapping[str, torch.Tensor], factor: float, seen: dict[str, set]) -> dict[str, torch.Tensor]:
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor must be a finite number > 0, got {factor}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        v, o = _V.match(name), _O.match(name)
        if v:
            seen["v"].add(v.group(1))
            t = (t.double() * factor).to(t.dtype)
        elif o:
            seen["o"].add(o.group(1))
            t = (t.double() / factor).to(t.dtype)
        out[name] = t
    return out


def _check(seen: dict[str, set]) -> None:
    if not seen["v"] or seen["v"] != seen["o"]:
        raise ValueError("expected every attention layer to have both v_proj and o_proj weights "
                         f"(v_proj in {len(seen['v'])} layers, o_proj in {len(seen['o'])})")


def rescale_values(tensors: Mapping[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """A copy of an HF state dict with every layer's v_proj x `factor` and o_proj / `factor` (module docstring)."""
    seen: dict[str, set] = {"v": set(), "o": set()}
    out = _rescale(tensors, factor, seen)
    _check(seen)
    return out


def rescale_hf_dir(src: str, dst: str, factor: float) -> str:
    """Write the rescaled model of HF directory `src` (config, tokenizer and other files copied) to `dst`; returns dst."""
    from safetensors.torch import load_file, save_file

    from megatron_rl.precision.rollout_formats import checkpoint_format, read_config

    if checkpoint_format(read_config(src)) is not None:
        raise ValueError(f"{src} holds quantized weights; rescale the high-precision warm start")
    os.makedirs(dst, exist_ok=False)
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, Path(dst) / path.name)
    seen: dict[str, set] = {"v": set(), "o": set()}
    for path in sorted(Path(src).glob("*.safetensors")):  # shard by shard: a layer's v_proj and o_proj may part
        save_file(_rescale(load_file(str(path)), factor, seen), str(Path(dst) / path.name), metadata={"format": "pt"})
    _check(seen)
    return dst
