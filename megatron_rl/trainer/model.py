"""Build the learner's megatron GPTModel chunks (one per virtual pipeline stage), wrapped in megatron DDP.

All CPU/gloo correctness settings are pinned in `build_transformer_config` (one place):
batch_p2p_comm off (on gloo batched isend/irecv match in the wrong order under VPP),
per-token-loss mode with our own finalize_model_grads_func (the loss arrives in global sum
form, so megatron must neither divide by micro-batch count nor average over DP), no fused
kernels or gradient-accumulation fusion (CUDA/apex only), CPU initialisation.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.config.model import OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.models.presets import Architecture, gpt_model_kwargs, transformer_config_kwargs
from megatron_rl.trainer.spec import block_spec


def finalize_grads_sum_form(model: list, num_tokens: Optional[torch.Tensor] = None, **kwargs: Any) -> None:
    """megatron's finalize_model_grads without the 1/num_tokens scaling (losses are already global sums)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def build_transformer_config(
    arch: Architecture,
    parallel_cfg: ParallelConfig,
    optim_cfg: OptimConfig,
    precision_cfg: PrecisionConfig,
    on_gpu: Optional[bool] = None,
):
    """TransformerConfig for `arch` under the parallel layout, with the CPU correctness settings pinned."""
    from megatron.core.transformer import TransformerConfig

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if optim_cfg.params_dtype == "bf16" else torch.float32
    pp = parallel_cfg.pipeline_model_parallel_size
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    if arch.num_layers % (pp * (vpp or 1)) != 0:
        raise ValueError(
            f"model.num_layers={arch.num_layers} must be divisible by parallel.pipeline_model_parallel_size * "
            f"virtual_pipeline_model_parallel_size = {pp * (vpp or 1)}"
        )
    tp = parallel_cfg.tensor_model_parallel_size
    for field, value in (("num_attention_heads", arch.num_attention_heads), ("num_query_groups", arch.num_query_groups),
                         ("vocab_size", arch.vocab_size), ("ffn_hidden_size", arch.ffn_hidden_size)):
        if value % tp != 0:
            raise ValueError(f"model {field}={value} must be divisible by parallel.tensor_model_parallel_size={tp}")
    kwargs = transformer_config_kwargs(arch)
    kwargs.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel_cfg.context_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Sum-form losses: see finalize_grads_sum_form.
        calculate_per_token_loss=True,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        batch_p2p_comm=on_gpu or vpp is None,
        deallocate_pipeline_outputs=on_gpu,
        # megatron's default "full" is deprecated (with a warning) in favour of [], which means the same: the whole layer
        cuda_graph_scope=[],
    )
    if on_gpu:
        # FP8 on GPU is Transformer Engine's, configured through TransformerConfig (precision/te.py).
        from megatron_rl.precision.te import transformer_config_kwargs as te_fp8_kwargs

        kwargs.update(te_fp8_kwargs(precision_cfg))
    config = TransformerConfig(**kwargs)
    config.finalize_model_grads_func = finalize_grads_sum_form
    return config


def build_model_chunks(arch: Architecture, config: Any, precision_cfg: PrecisionConfig,
                       use_te: Optional[bool] = None) -> list[torch.nn.Module]:
    """Unwrapped GPTModel chunks of this pipeline rank (one per virtual stage), on the compute device (`use_te`: block_spec's)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, precision_cfg, vp_stage=stage, use_te=use_te),
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            vp_stage=stage,
            **gpt_model_kwargs(arch),
        )
        if torch.cuda.is_available():
            model = model.cuda(torch.cuda.current_device())
        if precision_cfg.fp4_enabled:
            from megatron_rl.precision.fp4_linear import assign_fp4_streams

            assign_fp4_streams(model)
        chunks.append(model)
    return chunks


def wrap_ddp(chunks: list[torch.nn.Module], config: Any, parallel_cfg: ParallelConfig) -> list[torch.nn.Module]:
    """Wrap each chunk in megatron DDP (grads reduced over DP x CP in fp32; no overlap: the steps are small)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel_cfg.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP (and any other `.module` wrappers)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
