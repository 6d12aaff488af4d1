"""Rollout weight formats: how exported HF tensors are quantized for the engines, and how an engine reads them back.

One registry entry per `precision.rollout_quantization` value, each naming both sides of the contract:

| format        | checkpoint tensors per quantized Linear                      | config.json quant_method | SGLang flag              | activations (dynamic)          |
|---------------|---------------------------------------------------------------|--------------------------|--------------------------|--------------------------------|
| none          | ``weight`` as exported                                        | (none)                   | (none)                   | high precision                 |
| fp8-blockwise | ``weight`` e4m3 [out, in] + ``weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)] | ``fp8`` + ``weight_block_size`` | ``--quantization fp8``   | per token, 1 x 128 groups      |
| fp8-channel   | ``weight`` e4m3 [out, in] + ``weight_scale`` fp32 [out, 1]    | ``w8a8_fp8``             | ``--quantization w8a8_fp8`` | per token, one scale per row |

fp8-channel is SGLang's serialized W8A8-FP8 layout (``W8A8Fp8Config`` with a checkpoint whose
quant_method contains "w8a8_fp8": ``weight`` float8_e4m3fn and a ``ChannelQuantScaleParameter``
``weight_scale`` of shape [out, 1]; activations quantized per token at run time). Scales follow the
checkpoint convention (divide by scale = amax / 448; precision/blockwise.py). Quantized Linears are
the transformer layers' q/k/v/o and gate/up/down projections (hf_fp8.QUANTIZED_PROJECTIONS);
embeddings, lm_head, norms and biases stay high precision.

`RolloutFormat.quantize(name, tensor)` works one tensor at a time, so a streaming exporter can
quantize bucket by bucket; the engine side (`load_quantized_model`) reads the same bits back, so the
served weights are exactly what the trainer quantized.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from megatron_rl.precision.blockwise import ScaleFmt, quantize_blockwise, quantize_per_channel
from megatron_rl.precision.hf_fp8 import SCALE_SUFFIX, is_quantized_weight

CHANNEL_SCALE_SUFFIX = "_scale"
"""Appended to a weight's name for its per-channel scales in the w8a8_fp8 layout (``...proj.weight_scale``)."""
BLOCK = (128, 128)
"""Weight block of the fp8-blockwise format."""


@dataclass(frozen=True)
class RolloutFormat:
    """One rollout weight format: trainer-side quantizer + config.json entry + SGLang flag."""

    name: str
    """The precision.rollout_quantization value."""
    quantization_config: Optional[dict] = None
    """config.json quantization_config of checkpoints in this format (None: unquantized)."""
    sglang_quantization: Optional[str] = None
    """Value of SGLang's --quantization for engines serving this format (None: no flag)."""
    scale_suffix: str = ""
    """Suffix of a quantized weight's scale tensor name."""
    _quantize_weight: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = field(default=None, repr=False)

    def quantize(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one HF-named exported tensor: the tensor itself in its own dtype, or FP8 weight +
        scale quantized from its float32 values (bf16 converts exactly, so a bf16 learner quantizes the same bits)."""
        if self._quantize_weight is None or not is_quantized_weight(name):
            return {name: tensor}
        q, s = self._quantize_weight(tensor.float())
        return {name: q, name + self.scale_suffix: s}

    def quantize_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`quantize` over a whole HF state dict."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            out.update(self.quantize(name, tensor))
        return out

    def config_updates(self) -> dict:
        """config.json keys to set on checkpoints in this format."""
        return {"quantization_config": dict(self.quantization_config)} if self.quantization_config else {}

    @property
    def quantizes_weights(self) -> bool:
        """Whether the format stores FP8 weights (none does not, even when it declares K/V cache scales)."""
        return self._quantize_weight is not None

    def matches(self, config: Mapping) -> bool:
        """Whether an HF config.json already declares this format (its checkpoint serves as it is)."""
        current = checkpoint_format(config)
        return current == (self.name if self.quantizes_weights else None) and (
            config.get("quantization_config") or None) == self.quantization_config


def _none(precision) -> RolloutFormat:
    from megatron_rl.precision.kv_scales import KV_SCALES_ONLY_CONFIG

    # recalibrated K/V cache scales need a quant method that creates them: an Fp8Config that quantizes no linear
    return RolloutFormat("none", dict(KV_SCALES_ONLY_CONFIG) if precision.recalibrates_kv_scales else None)


def scale_fmt(precision) -> ScaleFmt:
    """The rollout weights' scale format: load_config has made precision.rollout_scale_fmt concrete for the engines'
    GPU; an `auto` left unresolved (a PrecisionConfig built in code) is fp32, the value on CPU engines."""
    fmt = precision.rollout_scale_fmt
    return "fp32" if fmt == "auto" else fmt


def _blockwise(precision) -> RolloutFormat:
    from megatron_rl.precision.hf_fp8 import quantization_config

    fmt = scale_fmt(precision)
    return RolloutFormat("fp8-blockwise", quantization_config(BLOCK, fmt), "fp8", SCALE_SUFFIX,
                         lambda w: quantize_blockwise(w, BLOCK, fmt))


def _channel(precision) -> RolloutFormat:
    fmt = scale_fmt(precision)
    # ue8m0 makes each row's scale a power of two; it is still stored as fp32, as w8a8_fp8 reads it
    return RolloutFormat("fp8-channel", {"quant_method": "w8a8_fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
                         "w8a8_fp8", CHANNEL_SCALE_SUFFIX, lambda w: quantize_per_channel(w, fmt))


ROLLOUT_FORMATS: dict[str, Callable[..., RolloutFormat]] = {
    "none": _none,
    "fp8-blockwise": _blockwise,
    "fp8-channel": _channel,
}
"""precision.rollout_quantization value -> factory of its RolloutFormat (given the PrecisionConfig)."""


def rollout_format(precision) -> RolloutFormat:
    """The RolloutFormat the precision policy's rollout_quantization names."""
    try:
        factory = ROLLOUT_FORMATS[precision.rollout_quantization]
    except KeyError:
        raise ValueError(f"precision.rollout_quantization={precision.rollout_quantization!r} has no rollout format; "
                         f"registered: {sorted(ROLLOUT_FORMATS)}") from None
    return factory(precision)


def checkpoint_format(config: Mapping) -> Optional[str]:
    """Which quantized rollout format an HF config.json declares ('fp8-blockwise', 'fp8-channel'), None when unquantized.

    Raises ValueError for a quantization_config this code cannot serve (so an engine never
    silently runs a checkpoint's FP8 bits as if they were plain weights).
    """
    from megatron_rl.precision.kv_scales import is_kv_scales_only

    qc = config.get("quantization_config") or {}
    if not qc or is_kv_scales_only(config):  # unquantized weights (perhaps carrying K/V cache scales)
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and qc.get("weight_block_size"):
        return "fp8-blockwise"
    if "w8a8_fp8" in method:
        return "fp8-channel"
    raise ValueError(f"quantization_config {qc!r} is not a rollout format served here "
                     "(block FP8 with weight_block_size, or w8a8_fp8 per-channel)")


def read_config(path: str) -> dict:
    """config.json of an HF checkpoint directory."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def load_quantized_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Build the architecture from config.json and load a quantized rollout checkpoint with W8A8 emulation (strict)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.precision import kv_scales
    from megatron_rl.precision.hf_fp8 import load_fp8_checkpoint, weight_block_size
    from megatron_rl.precision.w8a8 import apply_fp8_state_dict

    fmt = checkpoint_format(read_config(path))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    # The quantization is ours to emulate; transformers' own FP8 integrations need a GPU.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors, raw_config = load_fp8_checkpoint(path)
    scales = {n: tensors.pop(n) for n in list(tensors) if kv_scales.is_kv_scale_name(n)}
    if fmt == "fp8-blockwise":
        apply_fp8_state_dict(model, tensors, weight_block_size(raw_config))
    elif fmt == "fp8-channel":
        apply_fp8_state_dict(model, tensors, block=None, scale_suffix=CHANNEL_SCALE_SUFFIX)
    else:
        raise ValueError(f"{path} is not a quantized rollout checkpoint")
    if kv_scales.creates_kv_scales(raw_config):  # SGLang's Fp8Config gives every attention layer k/v scales
        kv_scales.attach_kv_scales(model)
    unknown = kv_scales.load_kv_scales(model, scales)
    if unknown:
        raise KeyError(f"FP8 checkpoint does not match the model: unexpected={unknown[:8]} (its quant method "
                       "creates no K/V cache scales under these names)")
    return model.eval()


def launch_source_files(hf_dir: str) -> list:
    """The files of `hf_dir` a launch checkpoint is built from (weights, JSON configs/indexes, tokenizer files)."""
    from pathlib import Path

    from megatron_rl.convert.safetensors_io import SIDE_FILE_PREFIXES

    return sorted(p for p in Path(hf_dir).iterdir() if p.is_file() and (
        p.name.endswith((".safetensors", ".json")) or p.name.startswith(SIDE_FILE_PREFIXES)))


def write_launch_checkpoint(hf_dir: str, precision, out_root: str, **publish_kwargs) -> str:
    """An HF directory engines can be started from in the precision policy's rollout format.

    SGLang fixes each layer's quantization method when it starts, and later weight updates load
    into those layers: engines serving FP8 rollouts must therefore start from a checkpoint already
    in that format. Returns `hf_dir` itself when no quantization is needed or it is already in the
    format, else <out_root>/launch_<format> (config, tokenizer files, quantized safetensors), built
    once per source: every engine node of a run calls this at the same time on a shared run_dir, so
    it goes through `convert.shared_dir.publish_once` (one builder, atomic publish, a complete one is
    reused and never rewritten). `publish_kwargs` tune its polling (tests).
    """
    import shutil

    from megatron_rl.convert.shared_dir import publish_once
    from megatron_rl.precision.hf_fp8 import load_fp8_checkpoint

    fmt = rollout_format(precision)
    config = read_config(hf_dir)
    current = checkpoint_format(config)
    if fmt.matches(config):
        return hf_dir
    if current is not None:
        if not fmt.quantizes_weights:
            raise ValueError(f"{hf_dir} holds a {current} checkpoint but precision.rollout_quantization=none")
        raise ValueError(f"{hf_dir} holds a {current} checkpoint; precision.rollout_quantization={fmt.name} "
                         "needs a high-precision source to quantize from")
    if fmt.quantization_config is None:  # the source declares K/V scales the run does not recalibrate: serve it plain
        return hf_dir
    from megatron_rl.rollout.sync.disk import write_hf_checkpoint

    def build(tmp: str) -> None:
        if fmt.quantizes_weights:
            tensors, _ = load_fp8_checkpoint(hf_dir)
            write_hf_checkpoint(fmt.quantize_state_dict(tensors), hf_dir, tmp, fmt.config_updates())
        else:  # the same weights under a config whose quant method creates K/V cache scales: link, do not copy
            for p in launch_source_files(hf_dir):
                if p.name.endswith(".safetensors") or p.name == "model.safetensors.index.json":
                    os.symlink(os.path.abspath(p), os.path.join(tmp, p.name))
                elif p.name.endswith(".json") and p.name != "config.json":
                    shutil.copyfile(p, os.path.join(tmp, p.name))
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({**config, **fmt.config_updates()}, f, indent=2)
        for name in os.listdir(hf_dir):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tmp, name))

    identity = {"format": fmt.name, "quantization_config": fmt.quantization_config}
    return publish_once(os.path.join(out_root, f"launch_{fmt.name}"), identity, launch_source_files(hf_dir), build,
                        **publish_kwargs)
