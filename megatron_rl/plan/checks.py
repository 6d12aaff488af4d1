"""Layout checks of `megatron-rl plan`: every problem is a `Finding` with a stable, named code.

Errors mean the job would fail (megatron asserts, a batch that cannot split, out of memory, no GPU
left for a role); warnings mean it runs but wastes resources or throughput; info explains a derived
number. Tests and scripts match on `code`, people read `message`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_rl.models.presets import Architecture

Level = Literal["error", "warning", "info"]

CODES = {
    "heads-not-divisible-by-tp": "num_attention_heads % TP != 0 (megatron splits whole heads)",
    "query-groups-not-divisible-by-tp": "num_query_groups % TP != 0 (megatron splits whole KV groups)",
    "ffn-not-divisible-by-tp": "ffn_hidden_size % TP != 0",
    "vocab-not-divisible-by-tp": "vocab_size % TP != 0 (vocab-parallel embedding and output layer)",
    "layers-not-divisible-by-pipeline": "num_layers % (PP x VPP) != 0",
    "too-few-microbatches-for-vpp": "the interleaved schedule needs at least PP micro-batches per update",
    "no-gpus-for-learner": "the engines take every GPU of the allocation",
    "learner-gpus-not-divisible": "learner GPUs % (TP x PP x CP) != 0",
    "engines-exceed-allocation": "the engines need more GPUs than the allocation has",
    "engine-tp-exceeds-node": "rollout.engine_tp_size > GPUs per node",
    "engine-heads-not-divisible": "SGLang needs num_attention_heads % engine_tp_size == 0",
    "batch-does-not-split": "samples per step % (DP x num_minibatches x micro_batch_size) != 0",
    "sequence-exceeds-max-seq-len": "prompt + response, padded, exceeds model.max_seq_len",
    "fp8-gemm-misaligned": "an FP8 GEMM dimension per TP rank is not a multiple of 16 (32 for MXFP8)",
    "recipe-unsupported-by-gpu": "the GPU's compute capability cannot run precision.recipe (Transformer Engine's support checks)",
    "rollout-scales-requantized": "the engines' SGLang would requantize fp32 block scales to UE8M0 (sm100): other bits than sent",
    "learner-out-of-memory": "the learner's peak memory exceeds the GPU",
    "engine-weights-exceed-pool": "the served weights do not fit mem_fraction_static of an engine GPU",
    "kv-cache-below-one-sequence": "the KV cache cannot hold one full-length sequence",
    "colocated-out-of-memory": "learner state + the engine pool exceed the shared GPU",
    "engine-gpu-colocated": "colocated engines share the learner's GPUs: their GPU model is the learner's",
    "colocated-multi-node": "colocated engines get weights by CUDA-IPC handle (transport=tensor) from one node's learner",
    "engine-gpus-idle": "GPUs on engine nodes that no engine uses",
    "kv-cache-limits-concurrency": "the KV cache holds fewer tokens than the configured concurrency asks",
    "learner-needs-recompute": "the learner fits only with full activation recompute",
    "embedded-engines": "embedded engines run on CPU and take no GPU",
    "distributed-optimizer-off": "DP > 1 without the distributed optimizer keeps full optimizer state on every rank",
    "sequence-padding": "the multiple sequences are padded to",
    "calibration-cost": "seconds and share of the step that calibration's high-precision forwards take",
    "calibration-slower-than-bf16": "calibration's high-precision forwards make the FP8 learner slower than a BF16 one",
}
"""Every finding code with what it means."""


@dataclass(frozen=True)
class Finding:
    """One result of a check."""

    code: str
    """Stable name (a key of CODES)."""
    level: Level
    """error | warning | info."""
    message: str
    """What is wrong (or derived) with the numbers involved, and the field to change."""

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}")


def architecture_checks(arch: Architecture, tp: int, pp: int, vpp: int | None) -> list[Finding]:
    """Divisibility megatron asserts when it builds the model under TP/PP/VPP."""
    out = []
    for code, field, value in (("heads-not-divisible-by-tp", "num_attention_heads", arch.num_attention_heads),
                               ("query-groups-not-divisible-by-tp", "num_query_groups", arch.num_query_groups),
                               ("ffn-not-divisible-by-tp", "ffn_hidden_size", arch.ffn_hidden_size),
                               ("vocab-not-divisible-by-tp", "vocab_size", arch.vocab_size)):
        if value % tp:
            out.append(Finding(code, "error", f"model.{field}={value} is not divisible by "
                                              f"parallel.tensor_model_parallel_size={tp}"))
    stages = pp * (vpp or 1)
    if arch.num_layers % stages:
        out.append(Finding("layers-not-divisible-by-pipeline", "error",
                           f"model.num_layers={arch.num_layers} is not divisible by parallel.pipeline_model_parallel_size "
                           f"x virtual_pipeline_model_parallel_size = {pp} x {vpp or 1} = {stages}"))
    return out


def fp8_alignment_checks(arch: Architecture, tp: int, recipe: str) -> list[Finding]:
    """Each FP8 GEMM's K and N per TP rank must be a multiple of 16 (TE assert_dim_for_fp8_exec; 32 for MXFP8 blocks)."""
    if recipe == "none":
        return []
    align = 32 if recipe.startswith("mx") else 16
    h, d, f, a, g = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.num_attention_heads, arch.num_query_groups
    dims = {"hidden_size": h, "qkv output / TP": (a + 2 * g) * d // tp, "attention width / TP": a * d // tp,
            "fc1 output (2 x ffn) / TP": 2 * f // tp, "ffn / TP": f // tp}
    bad = {k: v for k, v in dims.items() if v % align}
    if not bad:
        return []
    return [Finding("fp8-gemm-misaligned", "error",
                    f"precision.recipe={recipe} needs GEMM dims divisible by {align}; not: {bad} (TP={tp})")]


def recipe_device_checks(recipe: str, device_name: str, capability: Optional[tuple[int, int]]) -> list[Finding]:
    """precision.recipe against the GPU's compute capability, by Transformer Engine's rules (precision/device.py)."""
    from megatron_rl.precision.device import recipe_capability_error

    if capability is None:  # the nominal CPU device: every recipe is emulated
        return []
    error = recipe_capability_error(recipe, capability)
    return [Finding("recipe-unsupported-by-gpu", "error", f"{error} ({device_name})")] if error else []


def allocation_checks(*, nodes: int, gpus_per_node: int, engine_gpus_per_node: int, engine_tp: int, engine_nodes: int,
                      learner_gpus: int, model_parallel: int, placement: str, engine_kind: str,
                      arch: Architecture) -> list[Finding]:
    """Do learner and engines fit the allocation (disaggregated: engines own whole nodes; colocated: they share)?"""
    out = []
    if engine_kind == "embedded":
        out.append(Finding("embedded-engines", "info", "rollout.engine=embedded: engines are CPU processes; every GPU is the learner's"))
    elif engine_tp > gpus_per_node:
        out.append(Finding("engine-tp-exceeds-node", "error",
                           f"rollout.engine_tp_size={engine_tp} exceeds --gpus-per-node={gpus_per_node}"))
    if engine_kind != "embedded" and arch.num_attention_heads % engine_tp:
        out.append(Finding("engine-heads-not-divisible", "error",
                           f"num_attention_heads={arch.num_attention_heads} is not divisible by rollout.engine_tp_size={engine_tp}"))
    if engine_gpus_per_node > gpus_per_node or (placement == "disaggregated" and engine_nodes > nodes):
        out.append(Finding("engines-exceed-allocation", "error",
                           f"engines need {engine_gpus_per_node} GPUs per engine node (rollout.num_engines x engine_tp_size x "
                           f"engine_dp_size) on {engine_nodes} node(s); the allocation has {nodes} x {gpus_per_node}"))
        return out
    if placement == "colocated" and engine_kind != "embedded" and nodes > 1:
        out.append(Finding("colocated-multi-node", "error",
                           f"rollout.placement=colocated on {nodes} nodes: colocated engines receive weights through "
                           "rollout.weight_sync.transport=tensor (CUDA-IPC handles), which reach engines on the learner "
                           "controller's node only; run colocated on 1 node or use placement=disaggregated"))
    if placement == "disaggregated" and engine_kind != "embedded" and engine_gpus_per_node < gpus_per_node:
        out.append(Finding("engine-gpus-idle", "warning",
                           f"{gpus_per_node - engine_gpus_per_node} GPU(s) per engine node run nothing: raise rollout.num_engines "
                           f"or engine_tp_size/engine_dp_size to {gpus_per_node} GPUs per node"))
    if learner_gpus <= 0:
        out.append(Finding("no-gpus-for-learner", "error",
                           f"rollout.placement={placement}: the engines take {engine_nodes} of {nodes} node(s), leaving no "
                           f"GPU for the learner; add nodes or set rollout.placement=colocated"))
    elif learner_gpus % model_parallel:
        out.append(Finding("learner-gpus-not-divisible", "error",
                           f"{learner_gpus} learner GPUs are not divisible by TP x PP x CP = {model_parallel}"))
    return out


def batch_checks(*, samples: int, dp: int, num_minibatches: int, micro_batch_size: int, pp: int,
                 vpp: int | None) -> list[Finding]:
    """The step's samples must split into mini-batches, DP shards and micro-batches; VPP needs >= PP micro-batches."""
    out = []
    unit = dp * num_minibatches * micro_batch_size
    if dp > 0 and samples % unit:
        out.append(Finding("batch-does-not-split", "error",
                           f"train.prompts_per_step x rollout.n_samples_per_prompt = {samples} is not divisible by DP ({dp}) x "
                           f"train.num_minibatches ({num_minibatches}) x train.micro_batch_size ({micro_batch_size}) = {unit}"))
    elif dp > 0 and vpp:
        per_update = samples // unit
        if per_update < pp:
            out.append(Finding("too-few-microbatches-for-vpp", "error",
                               f"{per_update} micro-batch(es) per update and DP rank < PP={pp}, which the interleaved "
                               f"schedule needs; lower train.micro_batch_size or train.num_minibatches"))
    return out


def sequence_checks(*, prompt_tokens: int, response_tokens: int, multiple: int, max_seq_len: int,
                    cp: int, tp: int, sp: bool, token_alignment: int) -> tuple[int, list[Finding]]:
    """(padded training sequence length, findings): prompt + response padded to `multiple` must fit max_seq_len."""
    raw = prompt_tokens + response_tokens
    padded = math.ceil(raw / multiple) * multiple
    out = [Finding("sequence-padding", "info",
                   f"sequences pad to a multiple of {multiple} (2*CP={2 * cp if cp > 1 else 1}, x TP={tp if sp else 1} "
                   f"for sequence parallelism, FP8 token alignment {token_alignment} per rank): {raw} -> {padded} tokens")]
    if padded > max_seq_len:
        out.append(Finding("sequence-exceeds-max-seq-len", "error",
                           f"prompt {prompt_tokens} + rollout.sampling.max_new_tokens {response_tokens} padded to {padded} "
                           f"exceeds model.max_seq_len={max_seq_len}"))
    return padded, out
