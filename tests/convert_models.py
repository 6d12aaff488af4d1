"""Tiny HF models of each supported family, built offline from configs (no download), for conversion tests."""
from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 96


def tiny_hf_config(family: str, **overrides):
    """A 2-layer, hidden-64 config of `family`: Llama-3.1 rope scaling, Qwen2 q/k/v bias + tied embeddings, Qwen3 qk-norm."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, initializer_range=0.2,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    common.update(overrides)
    if family == "llama":
        common.setdefault("max_position_embeddings", 16384)
        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192})
    common.setdefault("max_position_embeddings", 256)
    if family == "qwen2":
        common.setdefault("tie_word_embeddings", True)
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(family)


def make_hf_model(family: str, path, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """Random tiny model of `family` (every tensor perturbed, so norms and biases matter), saved to `path`; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = model.to(dtype).eval()
    model.save_pretrained(str(path))
    return model
