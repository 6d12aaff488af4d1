"""`megatron-rl` command line: train, sft, serve, data, convert, config.

    megatron-rl train examples/configs/tiny_fp8_grpo.yaml [dotted.key=value ...]
    torchrun --nproc-per-node 2 -m megatron_rl.cli train CONFIG parallel.tensor_model_parallel_size=2
    megatron-rl sft CONFIG          # supervised warm start only
    megatron-rl serve --model-path DIR --port 30000   # embedded SGLang-protocol rollout server
    megatron-rl engines CONFIG [overrides]            # this node's engines (+ router): print URLs, block until killed
    megatron-rl engines CONFIG --dry-run --gpus 8     # what it would start: one JSON line {argv, env} per process
    megatron-rl data CONFIG         # write the synthetic task's JSONL + tokenizer
    megatron-rl convert hf-to-megatron HF MG [--config CONFIG]   # reshardable torch_dist checkpoint (torchrun)
    megatron-rl convert megatron-to-hf MG HF [--hf-config BASE]  # any TP/PP layout -> safetensors shards + index
    megatron-rl convert hf-to-fp8 HF FP8 | megatron-to-fp8 MG FP8   # FP8 blockwise HF checkpoint for SGLang
    megatron-rl plan CONFIG --nodes N [--gpus-per-node G] [--gpu h100|h200|b200]   # check + estimate a layout
    megatron-rl config [CONFIG]     # print the resolved config, or every field with its doc
    megatron-rl config --reference > docs/config.md   # the Markdown config reference
    megatron-rl study SPEC.yaml [--report-only] [--arms A B]   # arms x seeds from one warm start -> RESULTS.md + plots
    megatron-rl study SPEC.yaml --hp-measure [--hp-steps late|all] [--hp-own]   # finished runs' weights in high precision
    megatron-rl hp-measure RUN_DIR [--steps final|all|N,M] [--own]   # one run: RUN_DIR/hp_measure.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, applied in order")


def _load(args, check_layout: bool = True, check_device: bool = True, engine_device: bool = True):
    from megatron_rl.config import load_config

    return load_config(args.config, args.overrides, check_layout=check_layout, check_device=check_device,
                       engine_device=engine_device)


def cmd_train(args) -> int:
    """RL training (runs the warm start first when the config has no init checkpoint)."""
    cfg = _load(args)  # first: a config refused at load time exits before the loop's imports (~3 CPU-s)
    from megatron_rl.loop import run

    run(cfg)
    return 0


def cmd_sft(args) -> int:
    """Supervised warm start only."""
    from megatron_rl.config.run import check_config_for_world
    from megatron_rl.parallel import state
    from megatron_rl.runtime import check_data_paths, load_datasets, read_data_before_writing
    from megatron_rl.warm_start import check_model_sources, ensure_warm_start

    cfg = _load(args)
    check_data_paths(cfg)
    check_model_sources(cfg, Path(cfg.run_dir))
    read_data_before_writing(cfg)
    state.init_distributed(cfg.parallel, cfg.train.seed)
    check_config_for_world(cfg, state.dp_size())
    run_dir = Path(cfg.run_dir)
    tokenizer, train_rows, _ = load_datasets(cfg, run_dir)
    print(ensure_warm_start(cfg, run_dir, tokenizer, train_rows))
    return 0


def cmd_data(args) -> int:
    """Write task data and tokenizer into <run_dir>/data."""
    from megatron_rl.data.prepare import prepare_task_data

    cfg = _load(args)
    for name, path in prepare_task_data(cfg.data, Path(cfg.run_dir) / "data").items():
        print(f"{name}: {path}")
    return 0


def cmd_config(args) -> int:
    """Print the resolved config (YAML); --fields: every field and its one-line doc; --reference: docs/config.md."""
    import yaml

    from megatron_rl.config import RunConfig

    if args.reference:
        from megatron_rl.config.reference import render_reference

        sys.stdout.write(render_reference())
        return 0
    if args.fields:
        _print_fields(RunConfig, "")
        return 0
    print(yaml.safe_dump(_load(args).model_dump(mode="json"), sort_keys=False))
    return 0


def _print_fields(model, prefix: str) -> None:
    from pydantic import BaseModel

    from megatron_rl.config.base import describe_range

    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _print_fields(ann, f"{prefix}{name}.")
        else:
            valid = describe_range(field)
            print(f"{prefix}{name} = {field.default!r}  # {field.description or ''}" + (f" [valid: {valid}]" if valid else ""))


def cmd_engines(args) -> int:
    """Start this node's rollout engines (rollout.engine embedded|sglang, + router when rollout.use_router), print their URLs, block until killed."""
    import json

    from megatron_rl.rollout.node import dry_run, serve_engines

    if args.gpus is not None and not args.dry_run:
        print("error: --gpus applies to --dry-run (a real start uses the GPUs this node has)", file=sys.stderr)
        return 2
    try:
        if args.dry_run:
            # the learner's recipe is the learner nodes' business (checked by train); engine nodes check their own
            for line in dry_run(_load(args, check_device=False), model_path=args.model_path, gpus=args.gpus):
                print(json.dumps(line), flush=True)
            return 0
        return serve_engines(_load(args, check_device=False), model_path=args.model_path, urls_file=args.urls_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_convert(args) -> int:
    """Checkpoint conversion between HF, megatron torch_dist and HF FP8 blockwise (see megatron_rl/convert)."""
    from megatron_rl.models.hf_mapping import MappingError

    try:
        return _convert(args)
    except (FileNotFoundError, ValueError, MappingError) as exc:
        # one line naming the file or config key; a traceback adds nothing for a bad input path or model
        print(f"error: convert {args.kind}: {exc}", file=sys.stderr)
        return 2


def _convert(args) -> int:
    """Dispatch one conversion kind."""
    from megatron_rl import convert

    shard = convert.parse_size(args.max_shard_size)
    if args.kind == "hf-to-fp8":
        print(convert.hf_to_fp8(args.src, args.dst, scale_fmt=args.scale_fmt, max_shard_bytes=shard))
    elif args.kind == "megatron-to-fp8":
        print(convert.megatron_to_fp8(args.src, args.dst, scale_fmt=args.scale_fmt, hf_config_dir=args.hf_config,
                                      max_shard_bytes=shard))
    elif args.kind == "megatron-to-hf":
        print(convert.megatron_to_hf(args.src, args.dst, dtype=args.dtype, hf_config_dir=args.hf_config,
                                     max_shard_bytes=shard))
    else:
        from megatron_rl.config import load_config

        # model.* given explicitly must agree with the checkpoint; otherwise the HF config.json alone decides.
        check = args.config is not None or any(o.startswith("model.") for o in args.overrides)
        print(convert.hf_to_megatron(args.src, args.dst, load_config(args.config, args.overrides), check_model=check))
    return 0


def cmd_plan(args) -> int:
    """Check a config's layout against an allocation and estimate memory, traffic and step time (megatron_rl/plan)."""
    from megatron_rl.plan.report import run

    # plan names each layout problem by code, and checks the recipe against --gpu rather than this machine
    return run(_load(args, check_layout=False, check_device=False, engine_device=False), args, title=args.config or "")


def cmd_study(args) -> int:
    """Arms x seeds of RL runs from one shared warm start, one after another (resumable), then RESULTS.md and plots."""
    from megatron_rl.study import load_study
    from megatron_rl.study.runner import measure_study, run_study

    study = load_study(args.spec)
    if args.hp_measure:
        failed = measure_study(study, args.hp_steps, ("hp", "own") if args.hp_own else ("hp",), args.hp_prompts,
                               args.hp_eval_prompts, only_arms=args.arms)
        return 1 if run_study(study, report_only=True) + failed else 0
    failed = run_study(study, report_only=args.report_only, only_arms=args.arms, only_seeds=args.seeds)
    return 1 if failed else 0


def cmd_hp_measure(args) -> int:
    """A run's saved weights through a high-precision engine and forward: greedy accuracy, sampled reward, entropy."""
    from megatron_rl.study.hp_measure import measure_run

    try:
        measure_run(args.run_dir, args.steps, ("hp", "own") if args.own else ("hp",), prompts=args.prompts, seed=args.seed,
                    eval_prompts=args.eval_prompts)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: hp-measure {args.run_dir}: {exc}", file=sys.stderr)
        return 2
    return 0


def _quiet_known_upstream_warnings() -> None:
    """Silence known notices from dependencies that the job cannot act on (noise in its output)."""
    import warnings

    # megatron-core's import-time notices about TE/Apex fallbacks and its gloo/CPU paths (expected on CPU)
    for pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "Warning: tp_group is None", "`torch.distributed.(reduce_scatter|all_gather_into)"):
        warnings.filterwarnings("ignore", message=pattern)
    # Loading a torch_dist checkpoint (resume): megatron-core 0.16.1's TorchDistLoadShardedStrategy calls torch's
    # deprecated checkpoint.load_state_dict with torch ShardedTensors, whose use torch's planner flags as deprecated.
    warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning,
                            module=r"megatron\.core\.dist_checkpointing")
    warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                            category=FutureWarning)


def build_parser() -> argparse.ArgumentParser:
    """The `megatron-rl` argument parser (every subcommand and argument carries a help line)."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to run")
    for name, fn in (("train", cmd_train), ("sft", cmd_sft), ("data", cmd_data)):
        p = sub.add_parser(name, help=fn.__doc__, description=fn.__doc__)
        _add_config_args(p)
        p.set_defaults(fn=fn)
    p = sub.add_parser("config", help=cmd_config.__doc__, description=cmd_config.__doc__)
    _add_config_args(p)
    p.add_argument("--fields", action="store_true", help="list every config field with its documentation")
    p.add_argument("--reference", action="store_true",
                   help="print the Markdown config reference (megatron-rl config --reference > docs/config.md)")
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("engines", help=cmd_engines.__doc__, description=cmd_engines.__doc__)
    _add_config_args(p)
    p.add_argument("--model-path", default=None, help="HF model directory the engines start from (default: model.init_checkpoint)")
    p.add_argument("--urls-file", default=None, help="also write the URLs as JSON {generate: [...], workers: [...]} here")
    p.add_argument("--dry-run", action="store_true",
                   help="start nothing: print one JSON line {argv, env} per process it would start (env: set values, null = removed)")
    p.add_argument("--gpus", type=int, default=None, help="--dry-run: GPUs of the node (default: the CUDA devices seen here)")
    p.set_defaults(fn=cmd_engines)
    p = sub.add_parser("convert", help=cmd_convert.__doc__, description=cmd_convert.__doc__)
    p.add_argument("kind", choices=["hf-to-megatron", "megatron-to-hf", "hf-to-fp8", "megatron-to-fp8"],
                   help="hf-to-megatron: reshardable torch_dist checkpoint; megatron-to-hf: safetensors shards + index from "
                        "any TP/PP layout; *-to-fp8: blockwise FP8 HF checkpoint for SGLang/vLLM")
    p.add_argument("src", help="HF directory, or megatron checkpoint (step_<N> directory or checkpoint root)")
    p.add_argument("dst", help="output directory (created)")
    p.add_argument("--scale-fmt", default="fp32", choices=["fp32", "ue8m0"],
                   help="*-to-fp8: format of the per-block scales (ue8m0: power-of-two scales, as in DeepSeek-V3.1 releases)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="megatron-to-hf: cast weights (default: as stored)")
    p.add_argument("--hf-config", default=None, help="megatron-to-*: base HF directory whose config.json and tokenizer files are used")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size, e.g. 5GB, 500MB or bytes")
    p.add_argument("--config", default=None, help="hf-to-megatron: run config giving the parallel layout (model.* is checked)")
    p.add_argument("overrides", nargs="*", help="hf-to-megatron: dotted.key=value overrides of --config")
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("plan", help=cmd_plan.__doc__, description=cmd_plan.__doc__)
    _add_config_args(p)
    from megatron_rl.plan.report import add_arguments

    add_arguments(p)
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("study", help=cmd_study.__doc__, description=cmd_study.__doc__)
    p.add_argument("spec", help="study spec YAML (see examples/studies/)")
    p.add_argument("--report-only", action="store_true", help="only rewrite RESULTS.md and the plots from the runs on disk")
    p.add_argument("--arms", nargs="+", metavar="ARM", default=None,
                   help="run only these arms (the others are left for a later invocation; the report covers every arm)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED", default=None,
                   help="run only these of the spec's seeds (the report covers every seed that ran)")
    p.add_argument("--hp-measure", action="store_true",
                   help="train nothing: measure every finished run's saved weights in high precision (megatron-rl "
                        "hp-measure, skipping what is measured), then rewrite RESULTS.md")
    p.add_argument("--hp-steps", default="final",
                   help="--hp-measure: checkpoints to measure: final, late (the second half), all, or steps N,M")
    p.add_argument("--hp-own", action="store_true", help="--hp-measure: also through each arm's own engine precision")
    p.add_argument("--hp-prompts", type=int, default=64, help="--hp-measure: training prompts sampled for the reward")
    p.add_argument("--hp-eval-prompts", type=int, default=None,
                   help="--hp-measure: held-out prompts of the greedy evaluation (default: each run's train.eval_max_prompts)")
    p.set_defaults(fn=cmd_study)
    p = sub.add_parser("hp-measure", help=cmd_hp_measure.__doc__, description=cmd_hp_measure.__doc__)
    p.add_argument("run_dir", help="a `megatron-rl train` run directory (config.yaml, checkpoints/)")
    p.add_argument("--steps", default="final",
                   help="checkpoints to measure: final (the newest), late (the second half), all, or steps N,M")
    p.add_argument("--prompts", type=int, default=64,
                   help="training prompts (a fixed seeded set) sampled rollout.n_samples_per_prompt times for the reward")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt set and of its sampling")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out prompts of the greedy evaluation (default: the run's train.eval_max_prompts)")
    p.add_argument("--own", action="store_true",
                   help="also measure through the run's own engine precision (view 'own') on the same prompts")
    p.set_defaults(fn=cmd_hp_measure)
    sub.add_parser("serve", help="Embedded SGLang-protocol rollout server (`megatron-rl serve --help` lists its flags).")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `megatron-rl` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_known_upstream_warnings()
    if argv and argv[0] == "serve":
        from megatron_rl.engine.server import main as serve_main

        return serve_main(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_rl.config import ConfigError
    from megatron_rl.data.jsonl import DataFormatError
    from megatron_rl.phases.health import TrainingHealthError
    from megatron_rl.phases.reward import DynamicSamplingError
    from megatron_rl.rollout.client import RolloutServerError
    from megatron_rl.rollout.launcher import LaunchError
    from megatron_rl.study.spec import StudyError

    try:
        return args.fn(args)
    except (ConfigError, DataFormatError, RolloutServerError, LaunchError, StudyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (TrainingHealthError, DynamicSamplingError) as exc:  # the run stopped itself (exit 3)
        print(f"error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
