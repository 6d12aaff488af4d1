"""Layer specs of the learner's GPTModel: local spec (CPU) and Transformer Engine spec (GPU).

The local spec follows megatron's `get_gpt_layer_local_spec` layout (TransformerLayer ->
SelfAttention + MLP, same parameter names) but substitutes two leaves through megatron's normal
spec extension points:
- `SDPACoreAttention`: torch scaled_dot_product_attention, causal, context-parallel aware (it
  all-gathers K/V over the CP group and masks with the true positions of the load-balanced
  2*CP chunk layout, so every rank computes exact causal attention on its two chunks);
- `RMSNorm`: torch RMSNorm whose weight carries `sequence_parallel` so that
  finalize_model_grads sums its gradient over TP under sequence parallelism.
The linear classes of each layer come from `megatron_rl.precision.linear_classes_for_layer`
(FP8 emulation on CPU), selected by the layer's global index.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_rl.config.precision import PrecisionConfig


def cp_chunk_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by `cp_rank` under megatron's load-balanced layout (chunks r and 2*cp-1-r)."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*context_parallel_size={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


def to_cp_layout(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """The slice of a full-sequence tensor that `cp_rank` holds (megatron's get_batch_on_this_cp_rank layout)."""
    if cp_size == 1:
        return x
    index = cp_chunk_positions(x.shape[seq_dim], cp_size, cp_rank).to(x.device)
    return x.index_select(seq_dim, index)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim, built like megatron norms (config, hidden_size, eps)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # finalize_model_grads all-reduces grads of params flagged like this over TP under SP.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in fp32, scale, return in the input dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention with torch SDPA; CP-aware (K/V all-gathered, positions from the 2*CP layout)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as mpu

        self.config = config
        tp = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") else mpu.get_tensor_model_parallel_world_size()
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else mpu.get_context_parallel_group()
        self.heads = config.num_attention_heads // tp
        self.groups = max(1, config.num_query_groups // tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """[sq, b, np, hn] x [sk, b, ng, hn] -> [sq, b, np*hn]; right-padded batches need no mask beyond causal."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention supports neither packed sequences nor attention bias")
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        sq = query.shape[0]
        if cp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # Backward reduce-scatters, summing every rank's K/V gradient into the owner's chunk.
            key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
            seq = sq * cp_size
            q_pos = cp_chunk_positions(seq, cp_size, self.cp_group.rank())
            k_pos = torch.cat([cp_chunk_positions(seq, cp_size, r) for r in range(cp_size)])
            mask = (q_pos[:, None] >= k_pos[None, :]).to(query.device)
        else:
            mask = None
        rep = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        b, np_, _, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def local_layer_spec(column_cls: type, row_cls: type, qk_layernorm: bool):
    """One transformer layer's ModuleSpec with local (non-TE) modules and the given linear classes."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column_cls,
                    core_attention=SDPACoreAttention,
                    linear_proj=row_cls,
                    q_layernorm=RMSNorm if qk_layernorm else IdentityOp,
                    k_layernorm=RMSNorm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column_cls, linear_fc2=row_cls)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def layer_offset(config: Any, vp_stage: Optional[int]) -> tuple[int, int]:
    """(global index of this stage's/chunk's first layer, number of layers it builds)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage), get_num_layers_to_build(config, vp_stage=vp_stage)


def uses_te_spec(facts) -> bool:
    """True when the learner builds megatron's Transformer Engine spec: CUDA and an importable TE (`DeviceFacts`).

    CUDA alone is not enough: megatron's TE spec names TE classes (TESpecProvider) that exist only when
    TE imports, so a GPU without TE builds the local spec (recipe none; an FP8 recipe there is refused
    when the config loads, precision/device.py).
    """
    return bool(facts.cuda and facts.te)


def block_spec(config: Any, precision_cfg: PrecisionConfig, vp_stage: Optional[int] = None, use_te: Optional[bool] = None):
    """TransformerBlockSubmodules for this pipeline stage / virtual chunk (layers sliced by global index).

    `use_te` is the Learner's decision (`uses_te_spec` of its device facts); None asks this process's facts.
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_rl.precision import linear_classes_for_layer

    if use_te is None:
        from megatron_rl.precision.device import detect_device_facts

        use_te = uses_te_spec(detect_device_facts())
    offset, count = layer_offset(config, vp_stage)
    if use_te:
        # Imported lazily: Transformer Engine exists only on GPU machines.
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        return TransformerBlockSubmodules(layer_specs=[spec] * count, layer_norm=TENorm)
    specs = []
    for i in range(offset, offset + count):
        column_cls, row_cls = linear_classes_for_layer(precision_cfg, i, config.num_layers)
        specs.append(local_layer_spec(column_cls, row_cls, config.qk_layernorm))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)
