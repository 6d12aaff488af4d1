"""Per-GPU memory of the learner and the rollout engines, from the architecture and the layout (no model built).

Every term is a closed formula with its source in the docstring; all sizes are bytes. Notation:
h hidden, f SwiGLU width, L layers, a query heads, g KV groups, d head width, V vocabulary,
t TP, p PP, v VPP, c CP, d_dp DP, s sequence length per CP rank, b micro-batch size,
t_sp = t under sequence parallelism else 1, e activation element bytes (2, BF16).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.models.presets import Architecture

BF16, FP32 = 2, 4
BLOCK = 128


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one pipeline stage on one TP rank."""

    linear: int
    """GEMM weights (q/k/v, o, gate/up, down; + the output layer on the last stage): what FP8 recipes quantize."""
    other: int
    """Everything else held by the rank: embedding / output rows, norms, biases."""

    @property
    def total(self) -> int:
        """All parameters of the stage on this rank."""
        return self.linear + self.other


def layer_linear_params(arch: Architecture) -> int:
    """GEMM weights of one transformer layer: (a + 2g) d h (qkv) + a d h (o) + 2 f h (gate, up) + f h (down)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    return (arch.num_attention_heads + 2 * arch.num_query_groups) * d * h + arch.num_attention_heads * d * h + 3 * f * h


def layer_other_params(arch: Architecture, tp: int) -> int:
    """Non-GEMM parameters of one layer on one TP rank: replicated norms 2h (+ 2d qk-norms), the TP-sharded qkv bias."""
    norms = 2 * arch.hidden_size + (2 * arch.head_dim if arch.qk_layernorm else 0)
    bias = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim // tp if arch.qkv_bias else 0
    return norms + bias


def stage_params(arch: Architecture, tp: int, pp: int) -> tuple[ParamCounts, ParamCounts]:
    """(first stage, last stage) parameters per TP rank: L/p layers each; V h / t embedding rows on the first;
    final norm h and the V h / t output layer on the last (with PP > 1 megatron keeps a tied copy there too)."""
    layers = arch.num_layers // pp
    lin = layers * layer_linear_params(arch) // tp
    oth = layers * layer_other_params(arch, tp)
    vocab = arch.vocab_size * arch.hidden_size // tp
    output = 0 if (arch.tie_word_embeddings and pp == 1) else vocab
    if pp == 1:
        one = ParamCounts(lin + output, oth + vocab + arch.hidden_size)
        return one, one
    return ParamCounts(lin, oth + vocab), ParamCounts(lin + output, oth + arch.hidden_size)


@dataclass
class LearnerMemory:
    """Peak per-GPU bytes of a learner rank (the worse of the first and last pipeline stage)."""

    weights: int
    """Model weights in params_dtype (FP8 parameters store their GEMM weights in 2 x 1 byte)."""
    gradients: int
    """megatron DDP grad buffer, fp32 (grad_reduce_in_fp32, trainer/model.py)."""
    optimizer: int
    """fp32 main params (BF16 runs) + Adam moments, sharded over DP x CP with the distributed optimizer."""
    fp8_copies: int
    """TE's FP8 weight copies (row- and column-wise) and their scales, when FP8 is on and params are not FP8."""
    reference: int
    """KL reference policy: a snapshot of the weights and the live copy held while swapping (phases/logprobs.py)."""
    activations: int
    """Stored activations of the in-flight micro-batches, no recompute."""
    activations_recompute: int
    """The same with full recompute (layer inputs only + one layer's working set)."""
    logits: int
    """Last stage: kept BF16 logits + fp32 chunk temporaries of the vocab-parallel log-prob (trainer/logprobs.py)."""
    overhead: int
    """CUDA context, NCCL buffers and allocator fragmentation (a stated allowance)."""

    def total(self, recompute: bool = False) -> int:
        """Peak bytes without (or with) full activation recompute."""
        act = self.activations_recompute if recompute else self.activations
        return (self.weights + self.gradients + self.optimizer + self.fp8_copies + self.reference + act + self.logits
                + self.overhead)

    def resident(self) -> int:
        """Bytes held between steps (weights, grads, optimizer, FP8 copies, reference, overhead)."""
        return self.weights + self.gradients + self.optimizer + self.fp8_copies + self.reference + self.overhead

    def beside_engines(self, offload: bool) -> int:
        """Bytes a learner rank keeps on the GPU while colocated engines run (phases/placement.py): activations and logits
        are gone and the allocator cache is emptied; the weights, FP8 copies, KL reference and the overhead stay, and so do
        the gradient buffer and optimizer states unless rollout.colocate_offload moves them to host (trainer/offload.py)."""
        kept = self.weights + self.fp8_copies + self.reference + self.overhead
        return kept if offload else kept + self.gradients + self.optimizer


def optimizer_bytes_per_param(params_dtype: str, distributed: bool, shards: int) -> float:
    """Adam state bytes per parameter: fp32 m and v (8) + fp32 main params when params are BF16 (4), / shards when distributed.

    Matches megatron-core's Distributed Optimizer table (docs/source/api-guide/dist_optimizer.md:
    bf16 params + fp32 grads 18 bytes -> 6 + 12/d; fp32 params 16 -> 8 + 8/d, with params and grads counted apart).
    """
    state = 8 + (4 if params_dtype == "bf16" else 0)
    return state / shards if distributed else float(state)


def fp8_copy_bytes_per_param(recipe: str) -> float:
    """TE's cached FP8 weight (row-wise + column-wise, 1 byte each) plus scales: fp32 per 128x128 block (blockwise),
    one E8M0 byte per 32 values (mxfp8), one fp32 per tensor otherwise (negligible)."""
    scales = {"blockwise": 2 * FP32 / (BLOCK * BLOCK), "mxfp8": 2 * 1 / 32}.get(recipe, 0.0)
    return 2 + scales


def layer_activation_bytes(arch: Architecture, s: int, b: int, tp: int, sp: bool, fp8: bool) -> int:
    """Stored activations of one layer for one micro-batch (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1 accounting, redone for this block).

    Their GPT block stores s b h (34 + 5 a s / h) bytes; here the block is RMSNorm + GQA + SwiGLU with
    flash attention (no a s^2 softmax/mask terms, saved q, k, v, output and fp32 LSE) and no dropout:
      norms' inputs        2 * e s b h / t_sp        (residual stream into both RMSNorms)
      GEMM inputs          q_in s b (2 h / t_sp + a d / t + f / t)   (qkv, proj, fc2; fc1 shares the norm output)
      flash attention      e s b (a d + 2 g d + a d) / t + 4 s b a / t   (q, k, v, output, LSE)
      qk-norm inputs       e s b (a d + g d) / t    (Qwen3)
      SwiGLU input         e s b 2 f / t             (fc1 output)
    where q_in = 1 byte under FP8 (TE saves the quantized GEMM inputs for wgrad) else e = 2.
    """
    e, q_in = BF16, (1 if fp8 else BF16)
    h, f, a, g, d = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    t_sp = tp if sp else 1
    sb = s * b
    norms = 2 * e * sb * h // t_sp
    gemm_in = q_in * sb * (2 * h // t_sp + a * d // tp + f // tp)
    attn = e * sb * (2 * a * d + 2 * g * d) // tp + 4 * sb * a // tp
    qk_norm = e * sb * (a * d + g * d) // tp if arch.qk_layernorm else 0
    swiglu = e * sb * 2 * f // tp
    return norms + gemm_in + attn + qk_norm + swiglu


def inflight_factor(pp: int, vpp: int | None, num_microbatches: int) -> float:
    """Micro-batches whose activations the first stage holds, as multiples of one micro-batch over its L/p layers.

    1F1B keeps min(p, m) micro-batches in flight (Narayanan et al. 2021); Korthikanti et al. 2022 (sec. 4.2.3) give
    the interleaved schedule's extra factor (1 + (p - 1) / (p v)).
    """
    base = float(min(pp, max(num_microbatches, 1)))
    if vpp and pp > 1:
        base *= 1 + (pp - 1) / (pp * vpp)
    return base


def learner_memory(arch: Architecture, *, tp: int, pp: int, vpp: int | None, cp: int, dp: int, sp: bool,
                   params_dtype: str, distributed_optimizer: bool, recipe: str, fp8_params: bool,
                   seq_len: int, micro_batch_size: int, num_microbatches: int, logprob_chunk: int,
                   kl_reference: bool, overhead_bytes: int) -> LearnerMemory:
    """Per-GPU learner memory at the peak of a training step (the worse pipeline stage)."""
    fp8 = recipe != "none"
    wbytes = FP32 if params_dtype == "fp32" else BF16
    s = seq_len // cp
    per_layer = layer_activation_bytes(arch, s, micro_batch_size, tp, sp, fp8)
    layers = arch.num_layers // pp
    inflight = inflight_factor(pp, vpp, num_microbatches)
    t_sp = tp if sp else 1
    layer_input = BF16 * s * micro_batch_size * arch.hidden_size // t_sp
    vocab_rows = arch.vocab_size // tp
    best: LearnerMemory | None = None
    for index, counts in enumerate(stage_params(arch, tp, pp)):
        last = index == 1
        weights = counts.total * wbytes if not (fp8 and fp8_params) else counts.linear * 2 + counts.other * wbytes
        mem = LearnerMemory(
            weights=int(weights),
            gradients=counts.total * FP32,
            optimizer=int(counts.total * optimizer_bytes_per_param(params_dtype, distributed_optimizer, dp * cp)),
            fp8_copies=int(counts.linear * fp8_copy_bytes_per_param(recipe)) if fp8 and not fp8_params else 0,
            reference=int(2 * weights) if kl_reference else 0,
            activations=int(per_layer * layers * inflight),
            activations_recompute=int(layer_input * layers * inflight + per_layer),
            logits=(BF16 * s * micro_batch_size * vocab_rows + 3 * FP32 * min(logprob_chunk, s * micro_batch_size) * vocab_rows)
            if last else 0,
            overhead=overhead_bytes,
        )
        if best is None or mem.total() > best.total():
            best = mem
    assert best is not None
    return best


def largest_param_shard(arch: Architecture, tp: int) -> int:
    """Elements of the largest single parameter on one TP rank: max(V h, (a + 2g) d h, 2 f h, a d h, f h) / t (ceil)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    a, g = arch.num_attention_heads, arch.num_query_groups
    return -(-max(arch.vocab_size * h, (a + 2 * g) * d * h, 2 * f * h, a * d * h, f * h) // tp)


@dataclass
class HostMemory:
    """Peak host (CPU) bytes of one learner node while it reads or writes checkpoints (every rank of the node together)."""

    ranks_per_node: int
    """Learner ranks on one node."""
    warm_start: int
    """HF warm start (warm_start.load_initial_weights): per rank one parameter's slice at a time, read through safetensors get_slice, its merged q/k/v or gate/up copy, and the cast to params_dtype."""
    warm_start_whole_model: int
    """The same node if every rank read the whole BF16 checkpoint (one model per rank), for comparison."""
    checkpoint_save: int
    """A torch_dist save: megatron's FileSystemWriterAsync (dist_checkpointing/strategies/filesystem_async.py preload_tensors) copies each rank's weights and optimizer shard to host before writing."""


def host_memory(arch: Architecture, learner: LearnerMemory, *, tp: int, ranks_per_node: int,
                params_dtype: str) -> HostMemory:
    """Host bytes per node of the HF warm start (BF16 checkpoint) and of a checkpoint save, from the worst stage's figures."""
    cast = FP32 if params_dtype == "fp32" else 0  # bf16 -> bf16 is no copy
    per_rank_read = largest_param_shard(arch, tp) * (2 * BF16 + cast)
    return HostMemory(ranks_per_node=ranks_per_node, warm_start=ranks_per_node * per_rank_read,
                      warm_start_whole_model=ranks_per_node * served_weight_bytes(arch, fp8=False),
                      checkpoint_save=ranks_per_node * (learner.weights + learner.optimizer))


@dataclass
class EngineMemory:
    """Per-GPU bytes of one SGLang engine rank."""

    weights: int
    """Served weights on one engine TP rank."""
    kv_bytes_per_token: int
    """KV cache bytes per token on one engine TP rank."""
    pool: int
    """mem_fraction_static x device memory: SGLang's static pool for weights + KV cache."""
    kv_capacity_tokens: int
    """Tokens the KV cache holds per engine replica after the weights (<= 0: the weights do not fit)."""
    kv_demand_tokens: int
    """Tokens the configured concurrency asks one replica to hold at the same time."""
    kv_fp8: bool = False
    """Whether the cache stores FP8 (E4M3) K/V (precision.kv_cache_dtype=fp8_e4m3)."""
    kv_bytes: int = 0
    """Bytes of the KV cache on one engine GPU: the static pool minus the weights."""
    sequences: int = 0
    """Whole sequences (prompt + max_new_tokens) the KV cache holds per replica at once: the concurrency it allows."""
    sequences_other_dtype: int = 0
    """The same with the other KV dtype (BF16 when the cache is FP8, FP8 when BF16): what FP8 KV buys."""


def served_weight_bytes(arch: Architecture, fp8: bool) -> int:
    """Bytes of the whole served checkpoint: GEMM weights at 1 byte + fp32 128x128 block scales under FP8 (else BF16),
    embedding, untied lm_head, norms and biases in BF16 (precision/hf_fp8.py's format)."""
    linear = arch.num_layers * layer_linear_params(arch)
    other = arch.num_layers * layer_other_params(arch, 1) + arch.hidden_size
    other += arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    linear_bytes = linear * (1 + FP32 / (BLOCK * BLOCK)) if fp8 else linear * BF16
    return int(linear_bytes + other * BF16)


def kv_bytes_per_token(arch: Architecture, engine_tp: int, kv_fp8: bool) -> int:
    """2 (K and V) x L x max(g / t_e, 1) heads x d x (1 byte FP8 | 2 BF16): SGLang replicates KV heads when t_e > g."""
    heads = max(arch.num_query_groups // engine_tp, 1)
    return 2 * arch.num_layers * heads * arch.head_dim * (1 if kv_fp8 else BF16)


def engine_memory(arch: Architecture, *, engine_tp: int, fp8_weights: bool, kv_fp8: bool, device_bytes: int,
                  mem_fraction_static: float, concurrent_sequences: int, tokens_per_sequence: int) -> EngineMemory:
    """Engine weights per GPU (the served checkpoint / t_e), KV bytes per token, and KV capacity vs demand per replica."""
    weights = served_weight_bytes(arch, fp8_weights) // engine_tp
    per_token = kv_bytes_per_token(arch, engine_tp, kv_fp8)
    pool = int(mem_fraction_static * device_bytes)
    capacity = (pool - weights) // per_token
    other = (pool - weights) // kv_bytes_per_token(arch, engine_tp, not kv_fp8)
    seq = max(tokens_per_sequence, 1)
    return EngineMemory(weights=weights, kv_bytes_per_token=per_token, pool=pool, kv_capacity_tokens=int(capacity),
                        kv_demand_tokens=concurrent_sequences * tokens_per_sequence, kv_fp8=kv_fp8,
                        kv_bytes=max(pool - weights, 0), sequences=max(int(capacity) // seq, 0),
                        sequences_other_dtype=max(int(other) // seq, 0))


def sglang_default_mem_fraction(device_bytes: int, engine_tp: int) -> float:
    """SGLang's own --mem-fraction-static when unset (ServerArgs of sglang 0.5.8, dense model, no speculative decoding):
    (M - reserved) / M in MiB, reserved = 512 + 1.5 x chunked_prefill_size + 2 x cuda_graph_max_bs + tp / 8 x 1024,
    at least 10 GiB above 60 GiB; chunked prefill 8192 below 160 GiB (16384 above), graph batch 256 (TP < 4) or 512."""
    mib = device_bytes / 2**20
    chunk = 8192 if mib < 160 * 1024 else 16384
    graph_bs = 512 if (mib >= 160 * 1024 or engine_tp >= 4) else 256
    reserved = 512 + 1.5 * chunk + 2 * graph_bs + engine_tp / 8 * 1024
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)
