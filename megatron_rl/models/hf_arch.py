"""Derive an `Architecture` from a Hugging Face config.json (Llama-3, Qwen2 / Qwen2.5, Qwen3 dense).

    arch = architecture_from_hf(json.load(open("Qwen2.5-7B/config.json")))

Anything the megatron model cannot compute identically is rejected with the offending config
key named (another activation, biases beyond Qwen2's q/k/v bias, sliding-window attention,
rope scaling other than Llama-3.1's, which megatron-core implements with fixed constants).
The vocabulary is taken as is (`vocab_multiple=1`): HF checkpoints of these families already
pad it, and a layout whose TP does not divide it is rejected by the layout checks.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_rl.models.presets import LLAMA3_ROPE, Architecture

FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""HF model_type -> Architecture.family."""


class UnsupportedArchitecture(ValueError):
    """An HF config the megatron model cannot reproduce; the message names the config key."""


def _get(config: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    """config[key], with a named error when a required key is missing."""
    if key in config and config[key] is not None:
        return config[key]
    if required:
        raise UnsupportedArchitecture(f"config.json has no '{key}'")
    return default


def _rope(config: Mapping[str, Any]) -> tuple[float, Optional[float]]:
    """(rope_theta, Llama-3.1 scaling factor or None) from either config style (transformers 4 or 5)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedArchitecture(f"config.json rope type {rope_type!r} is not supported (only plain RoPE and 'llama3')")
    source = params if params.get("rope_type") == "llama3" else scaling
    for key, expected in LLAMA3_ROPE.items():
        if float(source.get(key, expected)) != float(expected):
            raise UnsupportedArchitecture(f"config.json rope scaling {key}={source.get(key)}: megatron-core implements "
                                          f"Llama-3.1 scaling with {key}={expected} only")
    return float(theta), float(source["factor"])


def architecture_from_hf(config: Mapping[str, Any], name: Optional[str] = None) -> Architecture:
    """The Architecture computing the same function as the HF model described by `config` (a config.json dict)."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(f"config.json model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"config.json hidden_act={act!r}: only SwiGLU ('silu') MLPs are supported")
    if config.get("mlp_bias"):
        raise UnsupportedArchitecture("config.json mlp_bias=true is not supported")
    if family != "qwen2" and config.get("attention_bias"):
        raise UnsupportedArchitecture(f"config.json attention_bias=true is not supported for {model_type} (it biases o_proj too)")
    if config.get("use_sliding_window"):
        raise UnsupportedArchitecture("config.json use_sliding_window=true is not supported")
    hidden = int(_get(config, "hidden_size", required=True))
    heads = int(_get(config, "num_attention_heads", required=True))
    theta, factor = _rope(config)
    return Architecture(
        name=name or f"hf-{model_type}",
        family=family,
        num_layers=int(_get(config, "num_hidden_layers", required=True)),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(config, "intermediate_size", required=True)),
        num_attention_heads=heads,
        num_query_groups=int(_get(config, "num_key_value_heads", heads)),
        head_dim=int(_get(config, "head_dim", hidden // heads)),
        vocab_size=int(_get(config, "vocab_size", required=True)),
        max_seq_len=int(_get(config, "max_position_embeddings", 2048)),
        rope_theta=theta,
        norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        qk_layernorm=family == "qwen3",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        vocab_multiple=1,
        qkv_bias=family == "qwen2",
        rope_scaling_factor=factor,
    )


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json of an HF directory (FileNotFoundError naming the directory otherwise)."""
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{hf_dir} is not an HF directory (no config.json)")
    return json.loads(path.read_text())


SHAPE_FIELDS = ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "head_dim", "vocab_size", "rope_theta", "norm_eps", "qk_layernorm", "tie_word_embeddings", "qkv_bias",
                "rope_scaling_factor")
"""Architecture fields that change the weights or the function (not the name, vocab padding rule or position limit)."""


def architecture_differences(a: Architecture, b: Architecture) -> dict[str, tuple[Any, Any]]:
    """{field: (a's value, b's value)} over SHAPE_FIELDS where the two architectures differ."""
    return {f: (getattr(a, f), getattr(b, f)) for f in SHAPE_FIELDS if getattr(a, f) != getattr(b, f)}
