"""Model architecture and learner parallelism configs."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import model_validator

from megatron_rl.config.base import StrictConfig


class ModelConfig(StrictConfig):
    """Which architecture the learner builds (a preset, optionally with overrides)."""

    preset: str = "tiny"
    """Architecture preset name (megatron_rl.models.presets: tiny, qwen3-0.6b, qwen3-8b, qwen3-14b, qwen3-32b, llama3-8b)."""
    num_layers: Optional[int] = None
    """Override the preset's number of transformer layers."""
    hidden_size: Optional[int] = None
    """Override the preset's hidden size."""
    ffn_hidden_size: Optional[int] = None
    """Override the preset's SwiGLU intermediate size."""
    num_attention_heads: Optional[int] = None
    """Override the preset's number of query heads."""
    num_query_groups: Optional[int] = None
    """Override the preset's number of key/value heads (GQA groups)."""
    head_dim: Optional[int] = None
    """Override the preset's per-head width."""
    vocab_size: Optional[int] = None
    """Override the vocabulary size (set from the tokenizer for the tiny task)."""
    max_seq_len: Optional[int] = None
    """Override the preset's maximum sequence length."""
    init_checkpoint: Optional[str] = None
    """Megatron distributed checkpoint (or HF directory) to initialise the learner from."""


class ParallelConfig(StrictConfig):
    """Learner parallel layout; the product TP*PP*CP must divide the world size, DP takes the rest."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (PP)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule (VPP); None disables."""
    context_parallel_size: int = 1
    """Context-parallel size (CP)."""
    sequence_parallel: bool = False
    """Sequence parallelism over the TP group (needs TP > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron DistributedOptimizer)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs/entropy from vocab-parallel logits (bounds memory)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto picks nccl with CUDA, gloo without."""

    @model_validator(mode="after")
    def _check(self) -> "ParallelConfig":
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1")
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size < 2:
            raise ValueError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2")
        return self


class OptimConfig(StrictConfig):
    """Optimizer settings, passed to megatron's get_megatron_optimizer."""

    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps (optimizer steps)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute dtype of the learner (fp32 on CPU; bf16 with fp32 main params on GPU)."""
