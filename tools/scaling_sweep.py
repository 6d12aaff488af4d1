"""Write a scaling study: one job per (nodes x learner layout x precision) from one config, each checked by
`megatron-rl plan` first (invalid cells are listed with their error codes, not launched).

    # GPU cluster: Slurm jobs through examples/launch/slurm_{disaggregated,colocated}.sbatch
    python tools/scaling_sweep.py examples/configs/qwen3_8b_fp8_grpo.yaml --nodes 2 4 8 \
        --layouts tp2 tp4 tp2pp2 --precisions bf16 fp8 fp8_calib --steps 20 --out sweeps/qwen3_8b
    bash sweeps/qwen3_8b/submit_all.sh          # sbatch every job
    # CPU miniature (torchrun world = nodes, one process per "node"): see benchmarks/scaling_cpu.sh
    python tools/scaling_sweep.py examples/configs/tiny_fp8_grpo.yaml --launcher local --gpu cpu \
        --gpus-per-node 1 --nodes 1 2 4 --layouts dp --out sweeps/cpu train.micro_batch_size=16
    bash sweeps/cpu/run_all.sh

Writes OUT/manifest.json (every cell: overrides, run_dir, command, the plan's estimate or why it was
skipped), OUT/jobs/<name>.sbatch (slurm) or OUT/run_all.sh (local). tools/scaling_report.py reads the
manifest and the runs' metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "bf16": ["precision.recipe=none", "precision.rollout_quantization=none", "algo.calibration.enabled=false"],
    "fp8": ["precision.rollout_quantization=fp8-blockwise", "algo.calibration.enabled=false"],
    "fp8_calib": ["precision.rollout_quantization=fp8-blockwise", "algo.calibration.enabled=true"],
}
"""Precision arms: BF16 everywhere; FP8 learner + FP8 rollout; the same with Calibrated Clipping."""
_LAYOUT_FIELDS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "cp": "context_parallel_size", "vpp": "virtual_pipeline_model_parallel_size"}


def layout_overrides(layout: str) -> list[str]:
    """'tp2pp2', 'tp4sp', 'cp2' or 'dp' (everything data-parallel) -> parallel.* overrides."""
    if layout == "dp":
        return [f"parallel.{f}={1}" for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                               "context_parallel_size")] + ["parallel.sequence_parallel=false"]
    parts = re.findall(r"(vpp|tp|pp|cp)(\d+)|(sp)", layout)
    if not parts or "".join(a + b + c for a, b, c in parts) != layout:
        raise SystemExit(f"layout {layout!r}: use tp<N>, pp<N>, cp<N>, vpp<N> and sp, e.g. tp2pp2 or tp4sp; or dp")
    out = [f"parallel.{_LAYOUT_FIELDS[k]}={v}" for k, v, _ in parts if k]
    out.append(f"parallel.sequence_parallel={'true' if any(s for _, _, s in parts) else 'false'}")
    return out


def precision_overrides(name: str, base_recipe: str) -> list[str]:
    """Overrides of a precision arm; FP8 arms use the config's recipe (blockwise when it has none)."""
    fp8_recipe = base_recipe if base_recipe != "none" else "blockwise"
    extra = [] if name == "bf16" else [f"precision.recipe={fp8_recipe}"]
    return PRECISIONS[name] + extra


def job_command(launcher: str, config: str, overrides: list[str], nodes: int, gpus_per_node: int, placement: str) -> str:
    """Shell command of one cell: the Slurm script for the config's placement, or torchrun on this machine."""
    args = " ".join(shlex.quote(o) for o in overrides)
    if launcher == "slurm":
        script = REPO / "examples" / "launch" / f"slurm_{placement}.sbatch"
        return f"bash {shlex.quote(str(script))} {shlex.quote(config)} {args}"
    world = nodes * gpus_per_node
    return (f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone --nproc-per-node {world} "
            f"-m megatron_rl.cli train {shlex.quote(config)} {args}")


def sbatch_file(name: str, command: str, nodes: int, gpus_per_node: int, run_dir: str, engine_nodes: int = 1) -> str:
    """A job script for one cell (the Slurm launch script itself runs `megatron-rl plan` first)."""
    return (f"#!/usr/bin/env bash\n#SBATCH --job-name=scaling-{name}\n#SBATCH --nodes={nodes}\n"
            f"#SBATCH --gpus-per-node={gpus_per_node}\n#SBATCH --ntasks-per-node=1\n#SBATCH --exclusive\n"
            f"#SBATCH --output={run_dir}/slurm-%j.out\nset -euo pipefail\nmkdir -p {shlex.quote(run_dir)}\n"
            f"cd {shlex.quote(str(REPO))}\nexport ENGINE_NODES={engine_nodes}\nexec {command}\n")


def main(argv=None) -> int:
    """Write the grid; returns 0 (cells that fail the plan are recorded as skipped)."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import PlanOptions, make_plan

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides applied to every cell")
    p.add_argument("--nodes", type=int, nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", default=["dp"], help="learner layouts: tp2, tp2pp2, tp4sp, cp2, dp ...")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--steps", type=int, default=20, help="train.steps of every cell")
    p.add_argument("--launcher", choices=["slurm", "local"], default="slurm")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length the plan assumes (default 512)")
    p.add_argument("--mfu", type=float, default=0.4, help="MFU the plan assumes (default 0.4)")
    p.add_argument("--engine-nodes", type=int, default=1, help="disaggregated: nodes running engines in every cell (default 1)")
    p.add_argument("--out", required=True, help="output directory (manifest, job scripts, runs/)")
    args = p.parse_intermixed_args(argv)  # overrides may follow the options

    out = Path(args.out).resolve()
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, args.overrides, check_layout=False)
    cells, lines = [], []
    for nodes in args.nodes:
        for layout in args.layouts:
            for prec in args.precisions:
                name = f"n{nodes}_{layout}_{prec}"
                run_dir = str(out / "runs" / name)
                overrides = [*args.overrides, *layout_overrides(layout), *precision_overrides(prec, base.precision.recipe),
                             f"train.steps={args.steps}", f"run_dir={run_dir}", "checkpoint.resume=false",
                             "tracking.progress_bar=false"]
                cfg = load_config(args.config, overrides, check_layout=False)
                plan = make_plan(cfg, nodes, args.gpus_per_node, args.gpu,
                                 PlanOptions(prompt_tokens=args.prompt_tokens, mfu=args.mfu, engine_nodes=args.engine_nodes))
                cell = {"name": name, "nodes": nodes, "gpus_per_node": args.gpus_per_node, "gpu": args.gpu,
                        "layout": layout, "precision": prec, "run_dir": run_dir, "overrides": overrides,
                        "samples_per_step": cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt,
                        "plan": {"ok": plan.ok, "errors": plan.codes("error"), "step_s": plan.step_time.total,
                                 "rollout_s": plan.step_time.rollout, "learner_s": plan.step_time.learner,
                                 "weight_sync_s": plan.step_time.weight_sync, "dp": plan.layout.dp,
                                 "learner_gpus": plan.layout.learner_gpus}}
                if plan.ok:
                    cell["command"] = job_command(args.launcher, str(Path(args.config).resolve()), overrides, nodes,
                                                  args.gpus_per_node, cfg.rollout.placement)
                    if args.launcher == "slurm":
                        job = out / "jobs" / f"{name}.sbatch"
                        job.write_text(sbatch_file(name, cell["command"], nodes, args.gpus_per_node, run_dir,
                                                   args.engine_nodes))
                        lines.append(f"sbatch {shlex.quote(str(job))}")
                    else:
                        lines.append(f"echo '== {name}' && mkdir -p {shlex.quote(run_dir)} && "
                                     f"{cell['command']} > {shlex.quote(run_dir)}/train.log 2>&1")
                cells.append(cell)
                print(f"{name}: {'ok' if plan.ok else 'skipped (' + ', '.join(plan.codes('error')) + ')'}")
    script = out / ("submit_all.sh" if args.launcher == "slurm" else "run_all.sh")
    script.write_text("#!/usr/bin/env bash\n# Generated by tools/scaling_sweep.py\nset -euo pipefail\n"
                      f"cd {shlex.quote(str(REPO))}\n" + "\n".join(lines) + "\n")
    argv_used = list(sys.argv[1:] if argv is None else argv)
    manifest = {"config": str(Path(args.config).resolve()), "launcher": args.launcher,
                "command": " ".join(["python tools/scaling_sweep.py", *map(shlex.quote, argv_used)]),
                "cells": cells}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{sum(c['plan']['ok'] for c in cells)}/{len(cells)} cells -> {script}; manifest {out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
