"""HF-format FP8 checkpoints as SGLang/vLLM read them: writer, reader and dequantizer.

Layout (docs/FACTS.md): every quantized Linear of a transformer layer (q/k/v/o_proj,
gate/up/down_proj) stores ``weight`` as float8_e4m3fn [out, in] and ``weight_scale_inv`` as fp32
[ceil(out/128), ceil(in/128)]; embed_tokens, lm_head, norms and biases keep their dtype.
config.json gains ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (plus ``"scale_fmt":
"ue8m0"`` for power-of-two scales, as in DeepSeek-V3.1 releases).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping, Optional

import torch

from megatron_rl.precision.blockwise import ScaleFmt, dequantize_blockwise, quantize_blockwise

QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""HF module names whose weights are stored in FP8."""
_QUANT_RE = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(" + "|".join(QUANTIZED_PROJECTIONS) + r")\.weight$")
SCALE_SUFFIX = "_scale_inv"
"""Appended to a weight's name for its block scales (``...proj.weight_scale_inv``)."""
DEFAULT_SHARD_BYTES = 5 * 1024**3
"""Largest safetensors shard written before splitting (HF's default of 5 GB)."""


def is_quantized_weight(name: str) -> bool:
    """True for the HF weight names that an FP8 checkpoint stores in float8_e4m3fn."""
    return _QUANT_RE.search(name) is not None


def quantization_config(block: tuple[int, int] = (128, 128), scale_fmt: ScaleFmt = "fp32") -> dict:
    """The config.json quantization_config block of an FP8 blockwise checkpoint."""
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if scale_fmt == "ue8m0":
        qc["scale_fmt"] = "ue8m0"
    return qc


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], block: tuple[int, int] = (128, 128),
                        scale_fmt: ScaleFmt = "fp32") -> dict[str, torch.Tensor]:
    """HF-named tensors with each quantizable weight replaced by (FP8 weight, fp32 weight_scale_inv)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if is_quantized_weight(name):
            q, s = quantize_blockwise(t, block, scale_fmt)
            out[name] = q
            out[name + SCALE_SUFFIX] = s
        else:
            out[name] = t
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or numbered shards plus model.safetensors.index.json when too large."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    if total <= max_shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_fp8_checkpoint(state_dict: Mapping[str, torch.Tensor], hf_config: Mapping, out_dir: str | Path,
                        block: tuple[int, int] = (128, 128), scale_fmt: ScaleFmt = "fp32",
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write an HF FP8 checkpoint (safetensors + config.json with quantization_config) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(state_dict)
    if hf_config.get("tie_word_embeddings", False):
        # Tied lm_head shares storage with embed_tokens; HF checkpoints omit it.
        tensors.pop("lm_head.weight", None)
    _write_shards(quantize_state_dict(tensors, block, scale_fmt), out, max_shard_bytes)
    config = dict(hf_config)
    config["quantization_config"] = quantization_config(block, scale_fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def load_fp8_checkpoint(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(raw tensors as stored: FP8 weights + weight_scale_inv, config dict) of an HF checkpoint directory."""
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    config = json.loads((d / "config.json").read_text())
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(d / f)))
    return tensors, config


def weight_block_size(config: Mapping) -> Optional[tuple[int, int]]:
    """weight_block_size of an FP8 config.json (None when the checkpoint is not block-FP8)."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or "weight_block_size" not in qc:
        return None
    b = qc["weight_block_size"]
    return int(b[0]), int(b[1])


def dequantize_state_dict(tensors: Mapping[str, torch.Tensor], block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """High-precision HF state dict: FP8 weights times their block scales, scale entries dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        out[name] = dequantize_blockwise(t, scale, block, dtype) if scale is not None else t
    return out
