"""Checkpoint conversions between HF directories, megatron distributed checkpoints and HF FP8 checkpoints.

    megatron-rl convert hf-to-megatron   HF_DIR  MG_DIR  [--config CONFIG] [overrides]  # torchrun for big models
    megatron-rl convert megatron-to-hf   MG_DIR  HF_DIR  [--hf-config BASE_HF_DIR] [--dtype bf16]
    megatron-rl convert hf-to-fp8        HF_DIR  FP8_DIR [--scale-fmt fp32|ue8m0]
    megatron-rl convert megatron-to-fp8  MG_DIR  FP8_DIR [--hf-config BASE_HF_DIR]
(`python tools/convert_checkpoint.py ...` takes the same arguments.)

Architectures: Llama-3 (incl. Llama-3.1 rope scaling), Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3
dense, derived from the HF config.json (models/hf_arch.py), so no preset is needed. A megatron
checkpoint records its architecture in meta.json. Conversions are exact: tensors keep their
dtype unless `--dtype` asks otherwise, so HF -> megatron -> HF reproduces every bit. The megatron
side is read under any TP/PP layout and without a model (trainer/checkpoint_reader.py), one layer
at a time; HF output is written as size-bounded safetensors shards plus model.safetensors.index.json.
FP8 output is the blockwise format SGLang and vLLM load (precision/hf_fp8.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatron_rl.convert.safetensors_io import (DEFAULT_MAX_SHARD_BYTES, ShardedWriter, copy_side_files,
                                                hf_tensor_dtype, iter_hf_tensors)
from megatron_rl.models.hf_arch import architecture_differences, architecture_from_hf, read_hf_config
from megatron_rl.models.presets import Architecture

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""--dtype names."""
_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def detect_format(path: str | Path) -> str:
    """'hf' for an HF directory, 'megatron' for a megatron_rl checkpoint (step dir or root); FileNotFoundError otherwise."""
    from megatron_rl.trainer.checkpoint_reader import resolve_checkpoint

    p = Path(path)
    if (p / "config.json").exists():
        return "hf"
    try:
        resolve_checkpoint(p)
        return "megatron"
    except FileNotFoundError:
        raise FileNotFoundError(f"{p} is neither an HF directory (config.json) nor a megatron_rl checkpoint") from None


# ---------------------------------------------------------------------------- HF -> megatron
def hf_to_megatron(src: str, dst: str, cfg, check_model: bool = False) -> str:
    """Convert an HF directory to a megatron distributed checkpoint (weights only) under cfg's parallel layout.

    The architecture comes from src/config.json; parameters keep the checkpoint's dtype (bf16 stays
    bf16, anything else is held in fp32, which represents it exactly). With `check_model`, cfg.model
    must describe the same architecture. Collective under torchrun: each rank builds only its shard,
    and the result loads under any other layout (`model.init_checkpoint=DST`).
    """
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.models.presets import resolve_architecture
    from megatron_rl.parallel import state
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import load_initial_weights

    arch = architecture_from_hf(read_hf_config(src))
    if check_model:
        diff = architecture_differences(resolve_architecture(cfg.model, arch.vocab_size), arch)
        if diff:
            raise ValueError(f"model.* describes another architecture than {src}/config.json; (config, checkpoint): {diff}")
    params_dtype = "bf16" if hf_tensor_dtype(src) == torch.bfloat16 else "fp32"
    state.init_distributed(cfg.parallel, cfg.train.seed)
    # Weights are converted at their own precision; the FP8 policy applies when a run loads them.
    learner = Learner(cfg.model, cfg.parallel, cfg.optim.model_copy(update={"params_dtype": params_dtype}),
                      PrecisionConfig(), vocab_size=arch.vocab_size, seed=cfg.train.seed, architecture=arch,
                      total_steps=cfg.train.optimizer_steps)
    load_initial_weights(learner, src)
    return save_checkpoint(learner, dst, step=0, rl_state={"step": 0, "converted_from": str(src)}, keep_last=1)


# ---------------------------------------------------------------------------- megatron -> HF names
def iter_megatron_as_hf(src: str | Path, arch: Architecture) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of a megatron checkpoint (any saving layout), mapped tensor by tensor as it is read."""
    from megatron_rl.models import hf_mapping
    from megatron_rl.trainer.checkpoint_reader import iter_full_tensors

    for name, tensor in iter_full_tensors(src):
        yield from hf_mapping.to_hf({name: tensor}, arch).items()


def _config_for(arch: Architecture, hf_config_dir: Optional[str], dtype_name: Optional[str]) -> dict:
    """config.json of the output: the base model's (checked against `arch`) or rendered from `arch`."""
    from megatron_rl.models.presets import hf_config

    if hf_config_dir is not None:
        config = read_hf_config(hf_config_dir)
        diff = architecture_differences(architecture_from_hf(config), arch)
        if diff:
            raise ValueError(f"--hf-config {hf_config_dir} describes another architecture than the checkpoint; "
                             f"(config.json, checkpoint): {diff}")
    else:
        config = hf_config(arch).to_dict()
    if dtype_name is not None:
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "dtype":
                config[key] = dtype_name
    return config


def megatron_to_hf(src: str, dst: str, *, dtype: Optional[str] = None, hf_config_dir: Optional[str] = None,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write a megatron checkpoint (any layout) as an HF directory: safetensors shards + index + config.json.

    `dtype` (bf16 | fp16 | fp32) casts the weights (default: as stored). `hf_config_dir` (the base
    model the run started from) supplies config.json, tokenizer and generation files; without it
    config.json is rendered from the recorded architecture and no tokenizer is written.
    """
    from megatron_rl.trainer.checkpoint_reader import checkpoint_architecture

    arch = checkpoint_architecture(src)
    target = DTYPES[dtype] if dtype is not None else None
    writer = ShardedWriter(dst, max_shard_bytes)
    stored = None
    for name, tensor in iter_megatron_as_hf(src, arch):
        stored = stored or tensor.dtype
        writer.add(name, tensor.to(target) if target is not None else tensor)
    writer.close()
    config = _config_for(arch, hf_config_dir, _HF_DTYPE_NAMES.get(target or stored))
    (Path(dst) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if hf_config_dir is not None:
        copy_side_files(hf_config_dir, dst)
    return str(dst)


# ---------------------------------------------------------------------------- -> FP8
def _write_fp8(tensors: Iterator[tuple[str, torch.Tensor]], config: dict, dst: str, scale_fmt: str,
               max_shard_bytes: int) -> str:
    """Quantize the FP8-served projections blockwise while streaming, write shards + config with quantization_config."""
    from megatron_rl.precision.hf_fp8 import quantization_config, quantize_state_dict

    tied = bool(config.get("tie_word_embeddings", False))
    writer = ShardedWriter(dst, max_shard_bytes)
    for name, tensor in tensors:
        if tied and name == "lm_head.weight":
            continue  # shares storage with embed_tokens; HF checkpoints omit it
        for out_name, out in quantize_state_dict({name: tensor}, (128, 128), scale_fmt).items():
            writer.add(out_name, out)
    writer.close()
    config = dict(config)
    config["quantization_config"] = quantization_config((128, 128), scale_fmt)
    (Path(dst) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(dst)


def hf_to_fp8(src: str, dst: str, scale_fmt: str = "fp32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Cast an HF checkpoint directory to an FP8 blockwise checkpoint SGLang/vLLM load (tokenizer files copied)."""
    out = _write_fp8(iter_hf_tensors(src), read_hf_config(src), dst, scale_fmt, max_shard_bytes)
    copy_side_files(src, dst)
    return out


def megatron_to_fp8(src: str, dst: str, scale_fmt: str = "fp32", hf_config_dir: Optional[str] = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write a megatron checkpoint (any layout) directly as an FP8 blockwise HF checkpoint for SGLang."""
    from megatron_rl.trainer.checkpoint_reader import checkpoint_architecture

    arch = checkpoint_architecture(src)
    out = _write_fp8(iter_megatron_as_hf(src, arch), _config_for(arch, hf_config_dir, None), dst, scale_fmt,
                     max_shard_bytes)
    if hf_config_dir is not None:
        copy_side_files(hf_config_dir, dst)
    return out


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KB' or a plain byte count -> bytes (decimal units, as HF's max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)
