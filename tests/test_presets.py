"""Architecture presets: published parameter counts, HF configs with the same maths, override/validation errors."""
from __future__ import annotations

import pytest

from megatron_rl.config.model import ModelConfig
from megatron_rl.models.presets import get_preset, hf_config, pad_vocab, preset_names, resolve_architecture

# (total, non-embedding) parameters in billions as published on the model cards
# (Qwen3 cards list both; Llama-3-8B: 8.03B total).
PUBLISHED = {
    "qwen3-0.6b": (0.6, 0.44),
    "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2),
    "qwen3-32b": (32.8, 31.2),
    "llama3-8b": (8.03, None),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_presets_match_published_sizes(name):
    """Shape formula (nothing is built) within rounding of the published sizes."""
    arch = get_preset(name)
    total, non_embedding = PUBLISHED[name]
    n = arch.num_parameters() / 1e9
    assert n == pytest.approx(total, rel=0.01 if total > 1 else 0.05)
    if non_embedding is not None:
        embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
        assert (arch.num_parameters() - embeddings) / 1e9 == pytest.approx(non_embedding, rel=0.01)


def test_tiny_formula_matches_a_built_hf_model():
    """The formula counts exactly the parameters of the HF model built from hf_config (an independent implementation)."""
    import torch
    from transformers import AutoModelForCausalLM

    arch = resolve_architecture(ModelConfig(preset="tiny"), 100)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch))
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()


@pytest.mark.parametrize("name", preset_names())
def test_hf_config_carries_the_same_maths(name):
    """rope theta, eps, head_dim, GQA, tying, vocab and qk-norm family agree."""
    arch = get_preset(name)
    cfg = hf_config(arch)
    assert type(cfg).__name__ == ("Qwen3Config" if arch.family == "qwen3" else "LlamaConfig")
    assert cfg.rope_parameters["rope_theta"] == arch.rope_theta
    assert cfg.rms_norm_eps == arch.norm_eps and cfg.head_dim == arch.head_dim
    assert cfg.num_key_value_heads == arch.num_query_groups and cfg.num_attention_heads == arch.num_attention_heads
    assert cfg.intermediate_size == arch.ffn_hidden_size and cfg.vocab_size == arch.vocab_size
    assert cfg.tie_word_embeddings == arch.tie_word_embeddings and cfg.max_position_embeddings == arch.max_seq_len


def test_overrides_and_vocab_padding():
    """ModelConfig overrides apply; the tokenizer vocab (argument) wins and is padded to the preset multiple."""
    arch = resolve_architecture(ModelConfig(preset="tiny", num_layers=4, hidden_size=96, max_seq_len=64, vocab_size=70), 100)
    assert (arch.num_layers, arch.hidden_size, arch.max_seq_len, arch.vocab_size) == (4, 96, 64, 128)
    assert resolve_architecture(ModelConfig(preset="tiny", vocab_size=70)).vocab_size == 128
    assert resolve_architecture(ModelConfig(preset="qwen3-8b")).vocab_size == 151936
    assert pad_vocab(64, 64) == 64 and pad_vocab(65, 64) == 128


def test_unknown_preset_lists_valid_names():
    """The error names the field and every valid preset."""
    with pytest.raises(ValueError) as err:
        resolve_architecture(ModelConfig(preset="qwen4"))
    assert "model.preset='qwen4'" in str(err.value)
    for name in preset_names():
        assert name in str(err.value)


def test_bad_override_is_named():
    """Non-positive overrides name the field."""
    from megatron_rl.config import RunConfig

    # the range is declared on the config field, so the value never reaches the preset
    with pytest.raises(ValueError, match="model.num_layers"):
        RunConfig.model_validate({"model": {"preset": "tiny", "num_layers": 0}})
