"""Architecture presets and their two renderings: megatron TransformerConfig/GPTModel kwargs and HF configs.

A preset is a frozen `Architecture`. `resolve_architecture(model_cfg, vocab_size)` applies the
ModelConfig overrides; `transformer_config_kwargs(arch)` / `gpt_model_kwargs(arch)` give the
megatron side and `hf_config(arch)` a transformers Qwen3Config / Qwen2Config / LlamaConfig with the
same maths (rope theta and Llama-3 rope scaling, norm eps, head_dim, qk-norm, qkv bias, tied
embeddings), so weights map one-to-one. `architecture_from_hf` (models/hf_arch.py) derives an
Architecture from an HF config.json instead of a preset.
`tiny` trains on a CPU in seconds, `tiny-deep` (8 layers, width 64) in minutes; the real shapes are only instantiated on GPUs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_rl.config.model import ModelConfig


@dataclass(frozen=True)
class Architecture:
    """A dense decoder-only transformer (Qwen3 / Llama-3 family)."""

    name: str
    """Preset name."""
    family: Literal["qwen3", "qwen2", "llama"]
    """HF architecture family (selects Qwen3Config, Qwen2Config or LlamaConfig)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """SwiGLU intermediate size (per branch)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    """Per-head width (kv_channels)."""
    vocab_size: int
    """Vocabulary size (rows of the embedding / output layer), a multiple of `vocab_multiple`."""
    max_seq_len: int
    """Maximum sequence length (positions)."""
    rope_theta: float
    """RoPE base."""
    norm_eps: float
    """RMSNorm epsilon."""
    qk_layernorm: bool
    """RMSNorm on queries and keys per head (Qwen3)."""
    tie_word_embeddings: bool
    """Output layer shares the embedding matrix."""
    vocab_multiple: int = 64
    """The vocabulary is padded up to a multiple of this (so it splits evenly over TP ranks)."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2 / Qwen2.5)."""
    rope_scaling_factor: Optional[float] = None
    """Llama-3.1 ("llama3") RoPE frequency scaling factor (megatron rope_scaling); None = plain RoPE."""

    def num_parameters(self) -> int:
        """Parameter count from the shape formula (no model is built)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups) + self.num_attention_heads * d * h
        attn += 2 * d if self.qk_layernorm else 0
        attn += (self.num_attention_heads + 2 * self.num_query_groups) * d if self.qkv_bias else 0
        mlp = 3 * h * self.ffn_hidden_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        return self.num_layers * per_layer + embed + h + (0 if self.tie_word_embeddings else embed)


def megatron_param_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Full (un-sharded) shapes of every megatron parameter, by the local-spec names the Learner exports."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = ((arch.num_attention_heads + 2 * arch.num_query_groups) * d, h)
        if arch.qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = ((arch.num_attention_heads + 2 * arch.num_query_groups) * d,)
        if arch.qk_layernorm:
            shapes[p + "self_attention.q_layernorm.weight"] = (d,)
            shapes[p + "self_attention.k_layernorm.weight"] = (d,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, arch.num_attention_heads * d)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        shapes[p + "mlp.linear_fc1.weight"] = (2 * f, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, f)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["output_layer.weight"] = (arch.vocab_size, h)
    return shapes


PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("tiny", "qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, head_dim=16, vocab_size=256, max_seq_len=128, rope_theta=10000.0,
                     norm_eps=1e-6, qk_layernorm=True, tie_word_embeddings=False),
        # the deep miniature: depth over width, so low-precision error has layers to compound through
        Architecture("tiny-deep", "qwen3", num_layers=8, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                     num_query_groups=2, head_dim=16, vocab_size=256, max_seq_len=64, rope_theta=10000.0,
                     norm_eps=1e-6, qk_layernorm=True, tie_word_embeddings=False),
        Architecture("qwen3-0.6b", "qwen3", num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                     num_query_groups=8, head_dim=128, vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
                     norm_eps=1e-6, qk_layernorm=True, tie_word_embeddings=True),
        Architecture("qwen3-8b", "qwen3", num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                     num_query_groups=8, head_dim=128, vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
                     norm_eps=1e-6, qk_layernorm=True, tie_word_embeddings=False),
        Architecture("qwen3-14b", "qwen3", num_layers=40, hidden_size=5120, ffn_hidden_size=17408, num_attention_heads=40,
                     num_query_groups=8, head_dim=128, vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
                     norm_eps=1e-6, qk_layernorm=True, tie_word_embeddings=False),
        Architecture("qwen3-32b", "qwen3", num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                     num_query_groups=8, head_dim=128, vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
                     norm_eps=1e-6, qk_layernorm=True, tie_word_embeddings=False),
        Architecture("llama3-8b", "llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                     num_query_groups=8, head_dim=128, vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
                     norm_eps=1e-5, qk_layernorm=False, tie_word_embeddings=False),
    )
}


def preset_names() -> list[str]:
    """Valid preset names."""
    return list(PRESETS)


def get_preset(name: str) -> Architecture:
    """The preset `name`; ValueError listing the valid names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def pad_vocab(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple`."""
    if vocab_size < 1:
        raise ValueError(f"model.vocab_size must be >= 1, got {vocab_size}")
    return -(-vocab_size // multiple) * multiple


def resolve_architecture(model_cfg: ModelConfig, vocab_size: Optional[int] = None) -> Architecture:
    """The preset of `model_cfg` with its overrides applied; `vocab_size` (e.g. the tokenizer's) wins over model.vocab_size."""
    arch = get_preset(model_cfg.preset)
    changes: dict[str, Any] = {}
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "max_seq_len"):
        value = getattr(model_cfg, field)
        if value is not None:
            if value < 1:
                raise ValueError(f"model.{field} must be >= 1, got {value}")
            changes[field] = value
    heads = changes.get("num_attention_heads", arch.num_attention_heads)
    groups = changes.get("num_query_groups", arch.num_query_groups)
    if heads % groups != 0:
        raise ValueError(f"model.num_attention_heads={heads} must be a multiple of model.num_query_groups={groups}")
    vocab = vocab_size if vocab_size is not None else model_cfg.vocab_size
    if vocab is not None:
        changes["vocab_size"] = pad_vocab(vocab, arch.vocab_multiple)
    return dataclasses.replace(arch, **changes)


def transformer_config_kwargs(arch: Architecture) -> dict[str, Any]:
    """megatron TransformerConfig kwargs for the architecture (dropout off: RL log-probs must be deterministic).

    Fused kernels and communication overlap depend on the device, not the architecture: trainer/model.py's
    LearnerKernels adds them."""
    import torch.nn.functional as F

    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def gpt_model_kwargs(arch: Architecture) -> dict[str, Any]:
    """megatron GPTModel constructor kwargs (besides config/spec/pre_process/post_process)."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_seq_len,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor if arch.rope_scaling_factor is not None else 8.0,
    )


def hf_config(arch: Architecture, **extra: Any):
    """transformers Qwen3Config / Qwen2Config / LlamaConfig computing the same function as the megatron model."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_seq_len,
        rms_norm_eps=arch.norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        rope_parameters=_rope_parameters(arch),
        attention_bias=False,
        hidden_act="silu",
        attention_dropout=0.0,
    )
    common.update(extra)
    if arch.family != "qwen2" and arch.qkv_bias:
        raise ValueError(f"preset {arch.name}: only the qwen2 family has a qkv bias")
    if arch.family == "qwen2":
        if arch.qk_layernorm or not arch.qkv_bias:
            raise ValueError(f"preset {arch.name}: Qwen2 has a qkv bias and no qk-norm")
        del common["attention_bias"]  # Qwen2 always biases q/k/v and never o_proj
        return Qwen2Config(use_sliding_window=False, **common)
    if arch.family == "qwen3":
        if not arch.qk_layernorm:
            raise ValueError(f"preset {arch.name}: Qwen3 always has qk-norm")
        return Qwen3Config(**common)
    if arch.qk_layernorm:
        raise ValueError(f"preset {arch.name}: Llama has no qk-norm")
    return LlamaConfig(mlp_bias=False, **common)


LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3.1 rope-scaling constants megatron-core hard-codes (RotaryEmbedding._apply_scaling); only the factor varies."""


def _rope_parameters(arch: Architecture) -> dict[str, Any]:
    """HF rope_parameters of the architecture (plain RoPE, or Llama-3.1 scaling with megatron's constants)."""
    if arch.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": float(arch.rope_theta)}
    return {"rope_type": "llama3", "rope_theta": float(arch.rope_theta), "factor": float(arch.rope_scaling_factor),
            **LLAMA3_ROPE}
