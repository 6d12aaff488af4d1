"""Model architecture and learner parallelism configs."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from megatron_rl.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, StrictConfig


class ModelConfig(StrictConfig):
    """Which architecture the learner builds (a preset, optionally with overrides)."""

    preset: str = "tiny"
    """Architecture preset name (megatron_rl.models.presets: tiny, tiny-deep, qwen3-0.6b, qwen3-8b, qwen3-14b, qwen3-32b, llama3-8b)."""
    num_layers: Optional[PositiveInt] = None
    """Override the preset's number of transformer layers."""
    hidden_size: Optional[PositiveInt] = None
    """Override the preset's hidden size."""
    ffn_hidden_size: Optional[PositiveInt] = None
    """Override the preset's SwiGLU intermediate size."""
    num_attention_heads: Optional[PositiveInt] = None
    """Override the preset's number of query heads."""
    num_query_groups: Optional[PositiveInt] = None
    """Override the preset's number of key/value heads (GQA groups)."""
    head_dim: Optional[PositiveInt] = None
    """Override the preset's per-head width."""
    vocab_size: Optional[PositiveInt] = None
    """Override the vocabulary size (set from the tokenizer for the tiny task)."""
    max_seq_len: Optional[PositiveInt] = None
    """Override the preset's maximum sequence length."""
    init_checkpoint: Optional[str] = None
    """Megatron distributed checkpoint (or HF directory) to initialise the learner from."""


class ParallelConfig(StrictConfig):
    """Learner parallel layout; the product TP*PP*CP must divide the world size, DP takes the rest."""

    tensor_model_parallel_size: PositiveInt = 1
    """Tensor-parallel size (TP, >= 1)."""
    pipeline_model_parallel_size: PositiveInt = 1
    """Pipeline-parallel size (PP, >= 1)."""
    virtual_pipeline_model_parallel_size: Optional[PositiveInt] = None
    """Model chunks per pipeline rank for the interleaved schedule (VPP, >= 1); None disables."""
    context_parallel_size: PositiveInt = 1
    """Context-parallel size (CP, >= 1)."""
    sequence_parallel: bool = False
    """Sequence parallelism over the TP group (needs TP > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron DistributedOptimizer)."""
    logprob_chunk_size: PositiveInt = 1024
    """Tokens per chunk when computing log-probs/entropy from vocab-parallel logits (bounds memory)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto picks nccl with CUDA, gloo without."""

    @model_validator(mode="after")
    def _check(self) -> "ParallelConfig":
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1")
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size < 2:
            raise ValueError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2")
        return self


class OptimConfig(StrictConfig):
    """Optimizer settings, passed to megatron's get_megatron_optimizer."""

    lr: PositiveFloat = 1e-5
    """Peak learning rate (> 0, finite)."""
    min_lr: NonNegativeFloat = 0.0
    """Final learning rate of the decay (>= 0, <= lr)."""
    lr_warmup_steps: NonNegativeInt = 0
    """Linear warm-up steps (optimizer steps, >= 0)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up, over the run's optimizer steps (a resume with more train.steps re-plans it over the new total)."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay (AdamW, >= 0)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False)
    """Adam beta1, in [0, 1)."""
    adam_beta2: float = Field(0.999, ge=0, lt=1, allow_inf_nan=False)
    """Adam beta2, in [0, 1)."""
    adam_eps: PositiveFloat = 1e-8
    """Adam epsilon (> 0)."""
    clip_grad: NonNegativeFloat = 1.0
    """Global gradient-norm clip (>= 0; 0 disables)."""
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute dtype of the learner (fp32 on CPU; bf16 with fp32 main params on GPU)."""

    @model_validator(mode="after")
    def _check(self) -> "OptimConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) must be <= optim.lr ({self.lr})")
        return self
