"""Plain-text rendering of a `Plan` and the `megatron-rl plan` command (argument parsing and exit status)."""
from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from megatron_rl.plan import Plan, PlanOptions, make_plan
from megatron_rl.plan.hardware import DEVICES, GIB


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _capability(device: str) -> str:
    cc = DEVICES[device].compute_capability
    return f" (compute capability {cc[0]}.{cc[1]})" if cc else ""


def _rollout_weights(plan: Plan) -> str:
    if plan.rollout_quantization == "none":
        return "high precision (precision.rollout_quantization=none)"
    chosen = plan.rollout_scale_fmt
    how = (f"precision.rollout_scale_fmt=auto -> {chosen}" if plan.rollout_scale_fmt_requested == "auto"
           else f"precision.rollout_scale_fmt={chosen}")
    if plan.rollout_quantization == "fp8-blockwise" and plan.rollout_scale_fmt_requested == "auto":
        how += (": the engines' SGLang requantizes block scales to UE8M0 for DeepGEMM on sm100, so the learner sends "
                "UE8M0" if chosen == "ue8m0" else ": these engines keep fp32 block scales")
    return f"{plan.rollout_quantization}, {chosen} scales ({how})"


def render(plan: Plan, title: str = "") -> str:
    """The report: layout, findings, memory, traffic and time, each line naming its formula's source."""
    lay, lm, em, st = plan.layout, plan.learner_memory, plan.engine_memory, plan.step_time
    lines = [f"megatron-rl plan{': ' + title if title else ''}",
             f"allocation: {lay.nodes} node(s) x {lay.gpus_per_node} {lay.device}{_capability(lay.device)} "
             f"({lay.placement}, rollout.engine={lay.engine_kind})",
             f"  engines: {lay.engine_gpus} GPU(s) on {lay.engine_nodes} node(s), {lay.engine_replicas} replica(s)"
             + (f", on {lay.engine_device}{_capability(lay.engine_device)}" if lay.engine_device != lay.device else ""),
             f"  learner: {lay.learner_gpus} GPU(s) = TP {lay.tp} x PP {lay.pp}{f' (VPP {lay.vpp})' if lay.vpp else ''} "
             f"x CP {lay.cp} x DP {lay.dp}; training sequences {plan.seq_len} tokens",
             f"precision: learner recipe {plan.recipe}; rollout weights {_rollout_weights(plan)}",
             f"learner kernels on {lay.device}{' with Transformer Engine' if _capability(lay.device) else ''} "
             "(trainer/model.py LearnerKernels):",
             *[f"  {line}" for line in plan.learner_kernels],
             "checks:"]
    for f in plan.findings:
        lines.append(f"  [{f.level:7}] {f.code}: {f.message}")
    if not any(f.level != "info" for f in plan.findings):
        lines.append("  no errors or warnings")
    lines += [
        "learner memory per GPU (worst pipeline stage; plan/memory.py):",
        f"  weights             {_gib(lm.weights)}   params x params_dtype bytes",
        f"  gradients           {_gib(lm.gradients)}   params x 4 (fp32 grad buffer)",
        f"  optimizer states    {_gib(lm.optimizer)}   Adam (+ fp32 main) / DP*CP with the distributed optimizer [megatron dist_optimizer.md]",
        f"  FP8 weight copies   {_gib(lm.fp8_copies)}   GEMM params x 2 bytes (row + column-wise) + scales [TE]",
        f"  KL reference        {_gib(lm.reference)}   2 x weights when algo.kl.coef > 0",
        f"  activations         {_gib(lm.activations)}   no recompute [Korthikanti et al. 2022, sec. 4; in-flight micro-batches]",
        f"  activations (full recompute) {_gib(lm.activations_recompute)}   layer inputs + one layer",
        f"  logits              {_gib(lm.logits)}   last stage: BF16 logits + fp32 log-prob chunks",
        f"  overhead            {_gib(lm.overhead)}   stated allowance (--overhead-gib)",
        f"  total               {_gib(lm.total())}   ({_gib(lm.total(recompute=True)).strip()} with full recompute)",
    ]
    if lay.placement == "colocated":
        offload = plan.colocate_offload
        lines.append(f"  beside the engines  {_gib(lm.beside_engines(offload))}   kept while colocated engines run: weights, FP8 "
                     f"copies, reference, overhead{'' if offload else ', gradients, optimizer states'} "
                     f"(rollout.colocate_offload={str(offload).lower()})")
    hm = plan.host_memory
    if hm is not None:
        lines += [
            f"learner host memory per node ({hm.ranks_per_node} rank(s) a node; plan/memory.py):",
            f"  HF warm start       {_gib(hm.warm_start)}   each rank reads only its TP/PP slices, one parameter at a time "
            f"(every rank reading the whole checkpoint: {_gib(hm.warm_start_whole_model).strip()})",
            f"  checkpoint save     {_gib(hm.checkpoint_save)}   every rank's weights + optimizer shard staged to host "
            "[megatron dist_checkpointing filesystem_async.py preload_tensors]",
        ]
    if em is not None:
        lines += [
            "engine memory per GPU (plan/memory.py):",
            f"  weights             {_gib(em.weights)}   served checkpoint / engine_tp_size (FP8: 1 B + 128x128 fp32 scales)",
            f"  KV cache per token  {em.kv_bytes_per_token:8d} B     2 x L x max(G / engine_tp, 1) x head_dim x KV dtype bytes",
            f"  static pool         {_gib(em.pool)}   rollout.mem_fraction_static x GPU memory",
            f"  KV capacity         {em.kv_capacity_tokens:8d} tokens per replica (pool - weights) / per-token bytes; "
            f"demand {em.kv_demand_tokens} (concurrency x n / replicas x (prompt + max_new_tokens))",
            f"  KV cache            {_gib(em.kv_bytes)}   pool - weights, {'FP8 E4M3' if em.kv_fp8 else 'BF16'} K/V"
            + (f" (scales: {plan.kv_cache_scales})" if em.kv_fp8 else ""),
            f"  concurrency         {em.sequences:8d} sequences per replica at once; "
            f"{em.sequences_other_dtype} with {'BF16' if em.kv_fp8 else 'FP8'} KV "
            f"({'what FP8 KV buys' if em.kv_fp8 else 'precision.kv_cache_dtype=fp8_e4m3'})",
        ]
    lines += [
        "communication per step (plan/throughput.py):",
        f"  weight sync         {_gb(plan.weight_sync_bytes)} pushed to every engine GPU (served checkpoint size)",
        f"  calibration         {plan.calibration_bytes_per_calibration_step} B per rank per calibration step, "
        f"{plan.calibration_bytes_per_step:.0f} B/step amortised [algo/calibration.py calibration_bytes, ring algorithms]",
        "step time estimate (plan/throughput.py):",
        f"  tokens per step     {plan.tokens_per_step:.3g} (prompt {plan.options.prompt_tokens} + response "
        f"{plan.options.response_fill:g} x max_new_tokens)",
        f"  learner FLOPs       {plan.flops.total:.3g} (train {plan.flops.train:.3g}, forward-only {plan.flops.forward_only:.3g}, "
        f"high-precision shadow / clip decision {plan.flops.shadow:.3g}) [Kaplan et al. 2020: 2N + 2 L n_ctx d_attn per token]",
        f"  learner             {st.learner:10.1f} s at MFU {plan.options.mfu:g} of BF16 peak, FP8 speed-up {plan.options.fp8_speedup:g}",
        f"  rollout             {st.rollout:10.1f} s at {plan.decode_tokens_per_s:.0f} decode tokens/s per replica "
        f"[memory-bound decode, Pope et al. 2022; HBM efficiency {plan.options.hbm_efficiency:g}]",
        f"  weight sync         {st.weight_sync:10.1f} s over the sender's network link",
        f"  step                {st.total:10.1f} s{' (rollout overlapped with training)' if st.overlapped else ''}",
        f"result: {'OK' if plan.ok else 'FAILED: ' + ', '.join(plan.codes())}",
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The plan command's options (after CONFIG and overrides)."""
    d = PlanOptions()
    p.add_argument("--nodes", type=int, required=True, help="nodes in the allocation")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help="device model (default h100)")
    p.add_argument("--engine-gpu", default=None, choices=sorted(DEVICES),
                   help="the engines' device model where it differs from --gpu (default: rollout.engine_gpu, else --gpu)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help=f"assumed prompt length (default {d.prompt_tokens})")
    p.add_argument("--response-fill", type=float, default=d.response_fill, help="mean response / max_new_tokens (default 1.0)")
    p.add_argument("--mfu", type=float, default=d.mfu, help=f"learner/prefill MFU vs BF16 peak (default {d.mfu})")
    p.add_argument("--fp8-speedup", type=float, default=d.fp8_speedup, help=f"FP8 learner speed-up (default {d.fp8_speedup})")
    p.add_argument("--decode-tps", type=float, default=None, help="decode tokens/s per replica (default: from HBM bandwidth)")
    p.add_argument("--hbm-efficiency", type=float, default=d.hbm_efficiency, help=f"decode HBM efficiency (default {d.hbm_efficiency})")
    p.add_argument("--overhead-gib", type=float, default=d.overhead_gib, help=f"per-GPU overhead allowance (default {d.overhead_gib})")
    p.add_argument("--engine-nodes", type=int, default=d.engine_nodes,
                   help="nodes running `megatron-rl engines` when disaggregated (rollout.num_engines is per node; default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(cfg, args, title: str = "") -> int:
    """Plan `cfg` for the allocation in `args`; print the report (or JSON); 0 if every check passed, else 2."""
    options = PlanOptions(prompt_tokens=args.prompt_tokens, response_fill=args.response_fill, mfu=args.mfu,
                          fp8_speedup=args.fp8_speedup, decode_tokens_per_s=args.decode_tps,
                          hbm_efficiency=args.hbm_efficiency, overhead_gib=args.overhead_gib,
                          engine_nodes=args.engine_nodes, engine_gpu=args.engine_gpu)
    plan = make_plan(cfg, args.nodes, args.gpus_per_node, args.gpu, options)
    print(json.dumps(plan.to_dict(), indent=1, default=str) if args.json else render(plan, title))
    return 0 if plan.ok else 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m megatron_rl.plan.report CONFIG [overrides] --nodes N ...` (same as `megatron-rl plan`)."""
    from megatron_rl.config import load_config

    p = argparse.ArgumentParser(prog="megatron-rl plan", description=__doc__)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    add_arguments(p)
    args = p.parse_args(argv)
    return run(load_config(args.config, args.overrides, check_layout=False, check_device=False,
                           engine_device=False), args, title=args.config)
