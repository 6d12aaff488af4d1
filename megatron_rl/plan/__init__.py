"""`megatron-rl plan`: check a run's layout against an allocation before the job is queued, and estimate it.

    megatron-rl plan examples/configs/qwen3_8b_fp8_grpo.yaml --nodes 2 --gpus-per-node 8 --gpu h100

Given a config and an allocation it derives the layout (engine nodes, learner GPUs, DP), runs the
checks of plan/checks.py (each problem a named code), and estimates per-GPU memory of the learner
(plan/memory.py), of the engines (weights + KV cache at the configured concurrency), the bytes moved
per step (weight sync, calibration collective) and the step time (plan/throughput.py). Exit status 0
when no check failed, 2 otherwise. Assumptions (MFU, decode efficiency, prompt length, overhead) are
options with stated defaults and are printed with the result.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from megatron_rl.plan import checks, memory, throughput
from megatron_rl.plan.checks import Finding
from megatron_rl.plan.hardware import GIB, DeviceSpec, get_device
from megatron_rl.precision.device import engine_device_errors, rollout_scale_fmt_for


@dataclass
class PlanOptions:
    """Workload and efficiency assumptions of the estimate (the CLI's options)."""

    prompt_tokens: int = 512
    """Prompt length assumed for every sample (the config holds only the response limit)."""
    response_fill: float = 1.0
    """Mean response length as a fraction of rollout.sampling.max_new_tokens (1.0: every response hits the limit)."""
    mfu: float = 0.4
    """Model FLOPs utilisation of learner passes and prefill, against the BF16 dense peak."""
    fp8_speedup: float = 1.2
    """Learner speed-up of FP8 passes over BF16 (NeMo-RL reports +15-25% step throughput from FP8 linears)."""
    decode_tokens_per_s: Optional[float] = None
    """Decode throughput per engine replica; None derives it from HBM bandwidth (memory-bound decode)."""
    hbm_efficiency: float = 0.7
    """Fraction of peak HBM bandwidth a decode iteration achieves."""
    overhead_gib: float = 4.0
    """Per-GPU allowance for the CUDA context, NCCL buffers and allocator fragmentation."""
    engine_nodes: int = 1
    """Nodes running `megatron-rl engines` when disaggregated (rollout.num_engines counts the engines of one node)."""
    engine_gpu: Optional[str] = None
    """GPU model of the engines where it differs from the learner's (--engine-gpu); None: rollout.engine_gpu, else the learner's."""


@dataclass
class Layout:
    """Where everything runs."""

    nodes: int
    """Nodes in the allocation."""
    gpus_per_node: int
    """GPUs per node."""
    device: str
    """Device model name of the learner (and of colocated engines)."""
    engine_device: str
    """Device model name of the GPU engines (rollout.engine_gpu or --engine-gpu where it differs from the learner's)."""
    placement: str
    """disaggregated | colocated."""
    engine_kind: str
    """rollout.engine."""
    engine_gpus: int
    """GPUs the engines use (0 for embedded CPU engines)."""
    engine_nodes: int
    """Whole nodes given to engines (disaggregated)."""
    engine_replicas: int
    """Independent engine replicas (num_engines x engine_dp_size)."""
    learner_gpus: int
    """GPUs of the learner (torchrun world size)."""
    tp: int
    """Learner TP."""
    pp: int
    """Learner PP."""
    vpp: Optional[int]
    """Learner VPP."""
    cp: int
    """Learner CP."""
    dp: int
    """Learner DP (0 when the learner GPUs do not divide)."""


@dataclass
class Plan:
    """Everything `megatron-rl plan` reports."""

    layout: Layout
    """The derived layout."""
    findings: list[Finding]
    """Check results."""
    seq_len: int
    """Padded training sequence length."""
    learner_memory: memory.LearnerMemory
    """Per-GPU learner memory."""
    engine_memory: Optional[memory.EngineMemory]
    """Per-GPU engine memory (None for embedded engines)."""
    weight_sync_bytes: int
    """Bytes pushed to the engines per weight sync."""
    calibration_bytes_per_calibration_step: int
    """Bytes one learner rank receives for Calibrated Clipping in a calibration step (0 when off)."""
    calibration_bytes_per_step: float
    """The same amortised over calibrate_every."""
    flops: throughput.LearnerFlops
    """Learner FLOPs per step."""
    decode_tokens_per_s: float
    """Decode throughput per replica used for the estimate."""
    step_time: throughput.StepTime
    """Estimated seconds per step."""
    tokens_per_step: float
    """Prompt + response tokens trained per step."""
    options: PlanOptions = field(default_factory=PlanOptions)
    """Assumptions used."""
    colocate_offload: bool = False
    """rollout.colocate_offload: optimizer states and gradients leave the GPU while colocated engines run."""
    learner_beside_engines: int = 0
    """Bytes a learner rank keeps on the GPU while colocated engines run (0 when not colocated; LearnerMemory.beside_engines)."""
    recipe: str = "none"
    """precision.recipe of the learner."""
    rollout_quantization: str = "none"
    """precision.rollout_quantization of the weights sent to the engines."""
    rollout_scale_fmt_requested: str = "auto"
    """precision.rollout_scale_fmt as configured (auto, fp32 or ue8m0)."""
    rollout_scale_fmt: str = "fp32"
    """precision.rollout_scale_fmt as the engines of this allocation get it (auto resolved for the --gpu engines)."""
    learner_kernels: list[str] = field(default_factory=list)
    """Which layer spec, fusions and overlaps the learner runs on this GPU (trainer/model.py LearnerKernels)."""
    kv_cache_scales: str = "unit"
    """FP8 KV cache scales the engines get: recalibrate (measured, sent with every sync) or unit (precision/kv_scales.py)."""
    host_memory: Optional[memory.HostMemory] = None
    """Peak host memory of one learner node during the HF warm start and a checkpoint save (None without learner GPUs)."""

    @property
    def ok(self) -> bool:
        """True when no check reported an error."""
        return not any(f.level == "error" for f in self.findings)

    def codes(self, level: str = "error") -> list[str]:
        """Codes of the findings at `level`."""
        return [f.code for f in self.findings if f.level == level]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for tools/scaling_sweep.py and --json)."""
        out = asdict(self)
        out["ok"] = self.ok
        out["step_time"]["total"] = self.step_time.total
        out["flops"]["total"] = self.flops.total
        return out


def _layout(cfg, nodes: int, gpus_per_node: int, device: DeviceSpec, engine_nodes: int,
            engine_device: DeviceSpec) -> Layout:
    """Engines per node x engine nodes (disaggregated: whole nodes of their own; colocated: every node), learner the rest.

    rollout.num_engines x engine_tp_size x engine_dp_size are one node's engine GPUs, as `megatron-rl engines` starts
    them per node (rollout/node.py); embedded engines are CPU processes and take no GPU.
    """
    r, p = cfg.rollout, cfg.parallel
    per_node = 0 if r.engine == "embedded" else r.num_engines * r.engine_tp_size * r.engine_dp_size
    if r.engine == "embedded":
        engine_nodes, learner_gpus = 1, nodes * gpus_per_node
    elif r.placement == "colocated":
        engine_nodes, learner_gpus = nodes, nodes * gpus_per_node
    else:
        learner_gpus = (nodes - engine_nodes) * gpus_per_node
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    dp = learner_gpus // mp if learner_gpus > 0 and learner_gpus % mp == 0 else 0
    return Layout(nodes=nodes, gpus_per_node=gpus_per_node, device=device.name, engine_device=engine_device.name,
                  placement=r.placement,
                  engine_kind=r.engine, engine_gpus=per_node * engine_nodes,
                  engine_nodes=engine_nodes if r.engine != "embedded" else 0,
                  engine_replicas=r.num_engines * r.engine_dp_size * engine_nodes, learner_gpus=learner_gpus,
                  tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size, cp=p.context_parallel_size, dp=dp)


def make_plan(cfg, nodes: int, gpus_per_node: int, gpu: str = "h100", options: Optional[PlanOptions] = None,
              vocab_size: Optional[int] = None) -> Plan:
    """Check and estimate `cfg` on `nodes` x `gpus_per_node` devices of model `gpu`."""
    from megatron_rl.models.presets import resolve_architecture
    from megatron_rl.phases.batching import seq_multiple, token_alignment

    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    opt = options or PlanOptions()
    device = get_device(gpu)
    arch = resolve_architecture(cfg.model, vocab_size)
    if opt.engine_nodes < 1:
        raise ValueError(f"--engine-nodes must be >= 1, got {opt.engine_nodes}")
    # mixed clusters (H100 learners, B200 engines): the engines' own GPU sets their scales, memory and decode speed
    engine_device = get_device(opt.engine_gpu or cfg.rollout.engine_gpu or gpu)
    lay = _layout(cfg, nodes, gpus_per_node, device, opt.engine_nodes, engine_device)
    r, p, t, prec = cfg.rollout, cfg.parallel, cfg.train, cfg.precision
    findings = checks.architecture_checks(arch, lay.tp, lay.pp, lay.vpp)
    findings += checks.fp8_alignment_checks(arch, lay.tp, prec.recipe)
    findings += checks.recipe_device_checks(prec.recipe, device.name, device.compute_capability)
    engine_cc = None if lay.engine_kind == "embedded" else engine_device.compute_capability  # embedded engines: CPU
    scale_fmt = rollout_scale_fmt_for(prec, engine_cc)
    if lay.placement == "colocated" and engine_device.name != device.name:
        findings.append(Finding("engine-gpu-colocated", "error",
                                f"colocated engines share the learner's {device.name} GPUs, not {engine_device.name}: "
                                "leave --engine-gpu and rollout.engine_gpu unset (or equal to --gpu)"))
    findings += [Finding("rollout-scales-requantized", "error", f"{e} ({engine_device.name} engines)")
                 for e in engine_device_errors(prec.model_copy(update={"rollout_scale_fmt": scale_fmt}), engine_cc)]
    findings += checks.allocation_checks(nodes=nodes, gpus_per_node=gpus_per_node,
                                         engine_gpus_per_node=lay.engine_gpus // max(lay.engine_nodes, 1),
                                         engine_tp=r.engine_tp_size, engine_nodes=lay.engine_nodes,
                                         learner_gpus=lay.learner_gpus, model_parallel=lay.tp * lay.pp * lay.cp,
                                         placement=lay.placement, engine_kind=lay.engine_kind, arch=arch)
    samples = t.prompts_per_step * r.n_samples_per_prompt
    findings += checks.batch_checks(samples=samples, dp=lay.dp, num_minibatches=t.num_minibatches,
                                    micro_batch_size=t.micro_batch_size, pp=lay.pp, vpp=lay.vpp)
    response = r.sampling.max_new_tokens
    seq_len, seq_findings = checks.sequence_checks(
        prompt_tokens=opt.prompt_tokens, response_tokens=response, multiple=seq_multiple(p, prec),
        max_seq_len=arch.max_seq_len, cp=lay.cp, tp=lay.tp, sp=p.sequence_parallel, token_alignment=token_alignment(prec))
    findings += seq_findings
    if lay.dp > 1 and not p.use_distributed_optimizer:
        findings.append(Finding("distributed-optimizer-off", "info",
                                f"DP={lay.dp}: parallel.use_distributed_optimizer=true would shard the Adam state {lay.dp * lay.cp}-way"))

    dp = max(lay.dp, 1)
    microbatches = max(samples // (t.num_minibatches * dp * t.micro_batch_size), 1)
    lm = memory.learner_memory(
        arch, tp=lay.tp, pp=lay.pp, vpp=lay.vpp, cp=lay.cp, dp=dp, sp=p.sequence_parallel,
        params_dtype=cfg.optim.params_dtype, distributed_optimizer=p.use_distributed_optimizer, recipe=prec.recipe,
        fp8_params=prec.fp8_params, seq_len=seq_len, micro_batch_size=t.micro_batch_size,
        num_microbatches=microbatches, logprob_chunk=p.logprob_chunk_size, kl_reference=cfg.algo.kl.coef > 0,
        overhead_bytes=int(opt.overhead_gib * GIB))
    host = None
    if lay.learner_gpus > 0:
        host = memory.host_memory(arch, lm, tp=lay.tp, ranks_per_node=min(gpus_per_node, lay.learner_gpus),
                                  params_dtype=cfg.optim.params_dtype)
    usable = device.memory_bytes
    # Without a valid learner layout (no GPUs, or they do not divide) its memory is not meaningful yet.
    if lay.dp > 0 and lm.total() > usable:
        if lm.total(recompute=True) <= usable:
            findings.append(Finding("learner-needs-recompute", "warning",
                                    f"learner peak {lm.total() / GIB:.1f} GiB > {usable / GIB:.1f} GiB without recompute, "
                                    f"{lm.total(recompute=True) / GIB:.1f} GiB with full recompute"))
        else:
            findings.append(Finding("learner-out-of-memory", "error",
                                    f"learner peak {lm.total(recompute=True) / GIB:.1f} GiB even with full recompute > "
                                    f"{usable / GIB:.1f} GiB per {device.name}: raise TP/PP/CP, enable "
                                    f"parallel.use_distributed_optimizer or lower train.micro_batch_size"))

    fp8_rollout = prec.rollout_quantization != "none"
    em = None
    replicas = lay.engine_replicas
    concurrent = math.ceil(min(r.concurrency, t.prompts_per_step) * r.n_samples_per_prompt / max(replicas, 1))
    seq_tokens = opt.prompt_tokens + response
    if lay.engine_kind != "embedded":
        fraction = r.mem_fraction_static
        if fraction is None:
            fraction = memory.sglang_default_mem_fraction(engine_device.memory_bytes, r.engine_tp_size)
        em = memory.engine_memory(arch, engine_tp=r.engine_tp_size, fp8_weights=fp8_rollout,
                                  kv_fp8=prec.kv_cache_dtype == "fp8_e4m3", device_bytes=engine_device.memory_bytes,
                                  mem_fraction_static=fraction, concurrent_sequences=concurrent,
                                  tokens_per_sequence=seq_tokens)
        findings += _engine_findings(em, lay, lm, engine_device, fraction, seq_tokens, r.colocate_offload)

    payload = throughput.weight_sync_bytes(arch, fp8_rollout)
    calib = cfg.algo.calibration
    calib_step, calib_per_step = 0, 0.0
    if calib.enabled and calib.strength != "targeted":  # targeted runs no event and no solve: nothing to reduce
        tokens_per_rank = int(samples * seq_len / t.num_minibatches / (dp * lay.cp))
        off_policy = t.num_minibatches * t.ppo_epochs - 1
        from megatron_rl.algo.calibration import HIST_BINS, HIST_LOG_MAX, HIST_LOG_MIN, MAX_SAMPLES_PER_RANK

        kw = dict(world_size=dp * lay.cp, max_samples_per_rank=MAX_SAMPLES_PER_RANK, hist_bins=HIST_BINS,
                  hist_log_min=HIST_LOG_MIN, hist_log_max=HIST_LOG_MAX)
        # an event: the targets' reduce + one solve over the step's off-policy tokens; per_step repeats that solve on
        # every step; per_minibatch adds a pre-pass solve per off-policy mini-batch on every step
        event = throughput.calibration_step_bytes(calib.backend, tokens_per_rank=tokens_per_rank * off_policy, solves=1, **kw)
        targets = throughput.calibration_step_bytes(calib.backend, tokens_per_rank=0, solves=0, **kw)
        every_step = {"per_step": event - targets,
                      "per_minibatch": throughput.calibration_step_bytes(calib.backend, tokens_per_rank=tokens_per_rank,
                                                                         solves=off_policy, **kw) - targets,
                      }.get(calib.bounds_update, 0)
        calib_step = event + (every_step if calib.bounds_update == "per_minibatch" else 0)
        calib_per_step = every_step + (calib_step - every_step) / calib.calibrate_every

    mean_response = response * opt.response_fill
    tokens = samples * (opt.prompt_tokens + mean_response)
    context = (opt.prompt_tokens + mean_response) / 2
    flops = throughput.learner_flops(arch, tokens, context, ppo_epochs=t.ppo_epochs, kl=cfg.algo.kl.coef > 0,
                                     calibrating=calib.enabled,
                                     calibrate_every=calib.calibrate_every, shadow_fraction=calib.shadow_fraction,
                                     num_minibatches=t.num_minibatches,
                                     decision_share=cfg.algo.every_step_hp_share(prec.recipe))
    rollout_gpus = lay.engine_gpus if lay.engine_kind != "embedded" else replicas * r.engine_tp_size
    per_gpu_weights = em.weights if em else memory.served_weight_bytes(arch, fp8_rollout) // r.engine_tp_size
    kv_token = em.kv_bytes_per_token if em else memory.kv_bytes_per_token(arch, r.engine_tp_size, False)
    batch = concurrent if em is None else max(1, min(concurrent, em.kv_capacity_tokens // max(seq_tokens, 1)))
    decode = throughput.optional_override(opt.decode_tokens_per_s, throughput.decode_tokens_per_s(
        per_gpu_weights, kv_token, batch, opt.prompt_tokens + mean_response / 2, engine_device.hbm_bytes_per_s,
        opt.hbm_efficiency))
    peak = engine_device.fp8_flops if fp8_rollout else engine_device.bf16_flops
    step = throughput.StepTime(
        rollout=throughput.rollout_seconds(prompts=t.prompts_per_step, samples=samples, prompt_tokens=opt.prompt_tokens,
                                           response_tokens=mean_response, replicas=replicas, engine_gpus=rollout_gpus,
                                           prefill_flops_per_token=throughput.forward_flops_per_token(arch, opt.prompt_tokens / 2),
                                           peak_flops=peak, mfu=opt.mfu, decode_tps=decode),
        learner=throughput.learner_seconds(flops, lay.learner_gpus, device.bf16_flops, opt.mfu,
                                           opt.fp8_speedup if prec.recipe != "none" else 1.0,
                                           # the layers' share of the FLOPs, as the layer count's share
                                           min(1.0, 2 * prec.first_last_layers_high_precision / arch.num_layers)),
        weight_sync=throughput.sync_seconds(payload, device.network_bytes_per_s, True),
        overlapped=throughput.overlapped(r))
    findings += _calibration_cost(flops, step, lay.learner_gpus, device.bf16_flops, opt, prec.recipe)
    return Plan(layout=lay, findings=findings, seq_len=seq_len, learner_memory=lm, engine_memory=em,
                weight_sync_bytes=payload, calibration_bytes_per_calibration_step=calib_step,
                calibration_bytes_per_step=calib_per_step, flops=flops, decode_tokens_per_s=decode, step_time=step,
                tokens_per_step=tokens, options=opt, colocate_offload=r.colocate_offload,
                learner_beside_engines=lm.beside_engines(r.colocate_offload) if lay.placement == "colocated" else 0,
                recipe=prec.recipe, rollout_quantization=prec.rollout_quantization,
                rollout_scale_fmt_requested=prec.rollout_scale_fmt, rollout_scale_fmt=scale_fmt,
                learner_kernels=_learner_kernels(device, p), kv_cache_scales=_kv_cache_scales(cfg), host_memory=host)


def _calibration_cost(flops: throughput.LearnerFlops, step: throughput.StepTime, gpus: int, peak_flops: float,
                      opt: PlanOptions, recipe: str) -> list[Finding]:
    """What the high-precision forwards of calibration (or of a high-precision clip decision) cost: their seconds and
    share of the step, and a warning when they make an FP8 learner slower than a BF16 learner without them."""
    if flops.shadow <= 0 or gpus <= 0:
        return []
    extra = flops.shadow / (gpus * peak_flops * opt.mfu)
    without = step.learner - extra
    out = [Finding("calibration-cost", "info",
                   f"high-precision forwards of calibration: {extra:.1f} s of the learner's {step.learner:.1f} s "
                   f"(+{extra / without:.1%} on the {without:.1f} s it takes without them), "
                   f"{extra / step.total:.0%} of the {step.total:.1f} s step")]
    bf16 = throughput.learner_seconds(throughput.LearnerFlops(flops.train, flops.forward_only, 0.0), gpus, peak_flops,
                                      opt.mfu, 1.0)
    if recipe != "none" and step.learner > bf16:
        out.append(Finding(
            "calibration-slower-than-bf16", "warning",
            f"with its high-precision forwards this FP8 learner takes {step.learner:.1f} s, a BF16 learner without them "
            f"{bf16:.1f} s: keep the vanilla bounds (algo.calibration.enabled=false), calibrate every "
            f"calibrate_every steps (algo.calibration.strength=full), or train in BF16 with FP8 rollout "
            f"(precision.recipe=none, precision.rollout_quantization=fp8-blockwise; docs/calibration.md)"))
    return out


def _kv_cache_scales(cfg) -> str:
    """precision.kv_cache_scales as the run resolves it (config/run.py resolve_for_engines)."""
    from megatron_rl.config.run import sglang_drops_kv_scales

    prec = cfg.precision
    if prec.kv_cache_scales != "auto":
        return prec.kv_cache_scales
    return "recalibrate" if prec.recalibrates_kv_scales and not sglang_drops_kv_scales(cfg) else "unit"


def _learner_kernels(device: DeviceSpec, parallel) -> list[str]:
    """LearnerKernels.describe() for learners on `device` with Transformer Engine (the GPU image), or on CPU."""
    from megatron_rl.precision.device import CPU, gpu_facts
    from megatron_rl.trainer.model import learner_kernels

    cc = device.compute_capability
    facts = gpu_facts(cc, te=True, apex_wgrad=True) if cc else CPU
    return learner_kernels(facts, parallel).describe(apex_known=cc is None)


def _engine_findings(em: memory.EngineMemory, lay: Layout, lm: memory.LearnerMemory, device: DeviceSpec,
                     fraction: float, seq_tokens: int, offload: bool = False) -> list[Finding]:
    """Engine weights vs the static pool, KV capacity vs one sequence and vs demand, colocated sharing."""
    out = []
    if em.weights > em.pool:
        out.append(Finding("engine-weights-exceed-pool", "error",
                           f"served weights {em.weights / GIB:.1f} GiB per engine GPU exceed rollout.mem_fraction_static="
                           f"{fraction} x {device.memory_bytes / GIB:.0f} GiB: raise rollout.engine_tp_size"))
    elif em.kv_capacity_tokens < seq_tokens:
        out.append(Finding("kv-cache-below-one-sequence", "error",
                           f"KV cache holds {em.kv_capacity_tokens} tokens per replica, one sequence needs {seq_tokens}"))
    elif em.kv_capacity_tokens < em.kv_demand_tokens:
        out.append(Finding("kv-cache-limits-concurrency", "warning",
                           f"KV cache holds {em.kv_capacity_tokens} tokens per replica; rollout.concurrency asks "
                           f"{em.kv_demand_tokens}: requests will queue (raise engine_tp_size or use fp8_e4m3 KV)"))
    kept = lm.beside_engines(offload)
    if lay.placement == "colocated" and kept + em.pool > device.memory_bytes:
        hint = ("" if offload or lm.beside_engines(True) + em.pool > device.memory_bytes
                else " or set rollout.colocate_offload=true (optimizer states and gradients to host while the engines run)")
        out.append(Finding("colocated-out-of-memory", "error",
                           f"colocated: learner state kept beside the engines {kept / GIB:.1f} GiB + engine pool "
                           f"{em.pool / GIB:.1f} GiB exceed {device.memory_bytes / GIB:.1f} GiB: lower "
                           f"rollout.mem_fraction_static{hint}"))
    return out
