"""Megatron-core <-> Hugging Face weight mapping for dense Llama-3 / Qwen2.5 / Qwen3 models.

Works on full (un-sharded) tensors: the Learner gathers TP/PP shards into megatron names first.
Layouts (FACTS.md): linear_qkv is grouped per query group, [q_g (heads_per_group*d), k_g (d),
v_g (d)] for each group g; linear_fc1 is cat([gate, up]). Both the local spec's norm names
(input_layernorm / pre_mlp_layernorm) and the TE spec's fused names
(linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight) are read; `to_megatron` writes
the layout given by `te_fused_norms`.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from megatron_rl.models.presets import Architecture

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# megatron suffix -> HF suffix for tensors that map one-to-one.
_DIRECT = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    # TE spec fuses the pre-norms into the following linear.
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}


class MappingError(KeyError):
    """A tensor that has no counterpart, or a missing/extra tensor, named explicitly."""


def split_qkv(qkv: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron grouped linear_qkv (weight [rows, H] or bias [rows]) -> (q, k, v) in HF layout."""
    g, d = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return q.reshape(g * per * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """HF q/k/v projections -> megatron grouped linear_qkv."""
    g = arch.num_query_groups
    return _merge_groups(q, k, v, g, arch.num_attention_heads // g, arch.head_dim)


def _merge_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: int, per: int, d: int) -> torch.Tensor:
    """q/k/v rows of `g` query groups (`per` heads each, head size `d`) -> those groups of the grouped linear_qkv."""
    tail = q.shape[1:]
    merged = torch.cat([q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)
    return merged.reshape(g * (per + 2) * d, *tail)


def megatron_to_hf(name: str, tensor: torch.Tensor, arch: Architecture) -> list[tuple[str, torch.Tensor]]:
    """One full megatron-named tensor -> its HF-named tensors (views of `tensor`, no copy).

    The streaming weight export maps one gathered parameter at a time with this; a tied output
    layer maps to nothing (HF checkpoints hold the embedding once).
    """
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor)]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    if name == "output_layer.weight":
        return [] if arch.tie_word_embeddings else [("lm_head.weight", tensor)]
    m = _LAYER.match(name)
    if not m:
        raise MappingError(f"no HF counterpart for megatron tensor '{name}'")
    prefix, suffix = f"model.layers.{int(m.group(1))}.", m.group(2)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, arch)
        return [(f"{prefix}self_attn.{proj}.{kind}", part) for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    if suffix in _DIRECT:
        return [(prefix + _DIRECT[suffix], tensor)]
    raise MappingError(f"no HF counterpart for megatron tensor '{name}'")


def to_hf(megatron_sd: Mapping[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """Full megatron-named state dict -> HF-named state dict (new tensors; inputs untouched)."""
    return {hf: t.clone() for name, tensor in megatron_sd.items() for hf, t in megatron_to_hf(name, tensor, arch)}


def to_megatron(hf_sd: Mapping[str, torch.Tensor], arch: Architecture, *, te_fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """HF-named state dict -> full megatron-named state dict (local-spec or TE-spec norm names)."""
    reverse = {hf: mg for mg, hf in _DIRECT.items() if "layernorm.weight" not in hf}
    reverse["input_layernorm.weight"] = "self_attention.linear_qkv.layer_norm_weight" if te_fused_norms else "input_layernorm.weight"
    reverse["post_attention_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight" if te_fused_norms else "pre_mlp_layernorm.weight"
    out: dict[str, torch.Tensor] = {}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in hf_sd.items():
        if name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = tensor.clone()
            if arch.tie_word_embeddings:
                continue
        elif name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = tensor.clone()
        elif name == "lm_head.weight":
            if not arch.tie_word_embeddings:
                out["output_layer.weight"] = tensor.clone()
        else:
            m = _HF_LAYER.match(name)
            if not m:
                raise MappingError(f"no megatron counterpart for HF tensor '{name}'")
            layer, suffix = int(m.group(1)), m.group(2)
            if suffix.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")):
                pending.setdefault(layer, {})[suffix] = tensor
            elif suffix in reverse:
                out[f"decoder.layers.{layer}.{reverse[suffix]}"] = tensor.clone()
            elif suffix.endswith("rotary_emb.inv_freq"):
                continue  # derived buffer, recomputed from rope_theta
            else:
                raise MappingError(f"no megatron counterpart for HF tensor '{name}'")
    for layer, parts in pending.items():
        prefix = f"decoder.layers.{layer}."
        for kind in ("weight", "bias"):
            names = [f"self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
            present = [n in parts for n in names]
            if any(present):
                if not all(present):
                    raise MappingError(f"layer {layer}: q/k/v {kind} must all be present")
                out[prefix + f"self_attention.linear_qkv.{kind}"] = merge_qkv(*(parts[n] for n in names), arch)
        if ("mlp.gate_proj.weight" in parts) != ("mlp.up_proj.weight" in parts):
            raise MappingError(f"layer {layer}: gate_proj and up_proj must both be present")
        if "mlp.gate_proj.weight" in parts:
            out[prefix + "mlp.linear_fc1.weight"] = torch.cat([parts["mlp.gate_proj.weight"], parts["mlp.up_proj.weight"]], dim=0)
    return out


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece `index` of torch.chunk(size elements, parts): the TP split megatron's shards use."""
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


def read_megatron_piece(name: str, full_shape: tuple[int, ...], arch: Architecture, reader,
                        shard: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """This TP rank's piece of the full megatron tensor `name`, read from HF tensors slice by slice (the rest is never read).

    `reader.read(hf_name, dim, start, stop)` gives that HF tensor's [start, stop) along `dim` (dim None: all of it)
    and `reader.shape(hf_name)` its shape; `shard` = (partition_dim, tp, tp_rank), None for the whole tensor. The
    piece equals torch.chunk(full, tp, partition_dim)[tp_rank], SwiGLU fc1 as cat(gate_i, up_i) (Learner's layout).
    """
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        name = "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding
    parts = [hf for hf, _ in megatron_to_hf(name, torch.empty(full_shape, device="meta"), arch)]
    if shard is None:
        whole = [reader.read(hf) for hf in parts]
        if len(parts) == 3:
            return merge_qkv(*whole, arch)
        return torch.cat(whole, dim=0) if len(parts) == 2 else whole[0]
    dim, tp, rank = shard
    if len(parts) == 3:  # linear_qkv: TP chunks whole query groups
        g, d = arch.num_query_groups, arch.head_dim
        per = arch.num_attention_heads // g
        if dim != 0 or g % tp:
            raise MappingError(f"{name}: cannot split {g} query groups over TP={tp} along dim {dim}")
        mine = g // tp
        q = reader.read(parts[0], 0, rank * mine * per * d, (rank + 1) * mine * per * d)
        k, v = (reader.read(hf, 0, rank * mine * d, (rank + 1) * mine * d) for hf in parts[1:])
        return _merge_groups(q, k, v, mine, per, d)
    pieces = [reader.read(hf, dim, *chunk_bounds(reader.shape(hf)[dim], tp, rank)) for hf in parts]
    return torch.cat(pieces, dim=0) if len(pieces) == 2 else pieces[0]  # fc1: cat(gate_i, up_i)


def check_complete(sd: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Raise MappingError naming missing, unexpected or mis-shaped tensors."""
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    shapes = [f"{k}: {tuple(sd[k].shape)} != {tuple(expected[k])}" for k in sorted(set(sd) & set(expected)) if tuple(sd[k].shape) != tuple(expected[k])]
    if missing or extra or shapes:
        raise MappingError(f"{what}: missing {missing[:5]}, unexpected {extra[:5]}, shape mismatches {shapes[:5]}")
