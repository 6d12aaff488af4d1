"""Where the policy starts.

`model.init_checkpoint` names either an HF directory (config + safetensors), loaded through the
HF -> Megatron mapping on every rank, each reading only its own PP/TP slices, or a megatron distributed checkpoint (a step directory or a
checkpoint root, e.g. from `megatron-rl convert hf-to-megatron`), loaded sharded under any parallel
layout — the scalable path for 8B+ models. When it is unset, the supervised warm start
(`megatron_rl.sft`) trains the model on the task once and exports <run_dir>/sft/hf, reused later.
Imports go one way: this module calls `megatron_rl.sft`, which never imports this one.
Engines always start from an HF directory (exported from the learner for megatron checkpoints).
"""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.parallel.comm import barrier


def sft_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Output directory of the warm start."""
    return Path(cfg.sft.output_dir) if cfg.sft.output_dir else run_dir / "sft"


def needs_warm_start(cfg: RunConfig, run_dir: Path) -> bool:
    """True when the run will train the supervised warm start (no init checkpoint and no earlier warm start to reuse)."""
    out = sft_dir(cfg, run_dir) / "hf"
    # the export is one model.safetensors, or shards + an index once the model exceeds a bucket
    return not cfg.model.init_checkpoint and not ((out / "model.safetensors").exists()
                                                 or (out / "model.safetensors.index.json").exists())


def check_model_sources(cfg: RunConfig, run_dir: Path) -> None:
    """ConfigError naming the field, before anything is written, when the weights the run starts from cannot be used.

    model.init_checkpoint must be an HF directory (config.json) or a megatron_rl distributed checkpoint; it, or
    the warm start an earlier run left in sft.output_dir (default <run_dir>/sft), must hold the architecture of
    the model section (else loading fails deep in the weight mapping with a bare shape error); and the learner
    layout must split that architecture (`megatron-rl plan`'s checks, now with the checkpoint's vocabulary).
    """
    from megatron_rl.config import ConfigError

    if cfg.model.init_checkpoint:
        path = Path(cfg.model.init_checkpoint)
        label = f"model.init_checkpoint={path}"
        if not path.exists():
            raise ConfigError(f"model.init_checkpoint={path}: no such file or directory")
        if not (path / "config.json").exists() and not is_megatron_checkpoint(path):
            raise ConfigError(f"model.init_checkpoint={path} is neither an HF directory (no config.json) nor a "
                              "megatron_rl distributed checkpoint (no step_<N> directory with a COMPLETE marker)")
    elif not needs_warm_start(cfg, run_dir):
        path = sft_dir(cfg, run_dir) / "hf"
        label = f"sft.output_dir={sft_dir(cfg, run_dir)}{'' if cfg.sft.output_dir else ' (default <run_dir>/sft)'}: its warm start {path}"
    else:
        return  # the warm start is trained from the model section itself
    theirs = source_architecture(path, label)
    ours = _model_architecture(cfg, theirs.vocab_size)
    from megatron_rl.models.hf_arch import architecture_differences

    diff = architecture_differences(theirs, ours)
    if diff:
        from megatron_rl.config.model import ModelConfig

        parts = [f"{k}={a} there but {b} here ({f'model.{k}' if k in ModelConfig.model_fields else f'model.preset={cfg.model.preset}'})"
                 for k, (a, b) in diff.items()]
        raise ConfigError(f"{label} holds another architecture than the model section: {'; '.join(parts)}")
    from megatron_rl.config.run import layout_errors

    errors = layout_errors(cfg, ours)
    if errors:
        raise ConfigError(f"invalid layout for {label}: " + "; ".join(errors))


def source_architecture(path: Path, label: str):
    """The Architecture of an HF directory (config.json) or a megatron_rl checkpoint; ConfigError starting with `label` when unreadable."""
    from megatron_rl.config import ConfigError
    from megatron_rl.models.hf_arch import architecture_from_hf, read_hf_config

    try:
        if (path / "config.json").exists():
            return architecture_from_hf(read_hf_config(path))
        from megatron_rl.trainer.checkpoint_reader import checkpoint_architecture

        return checkpoint_architecture(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{label}: {exc}") from None


def _model_architecture(cfg: RunConfig, vocab_size: int):
    """The learner's architecture for a checkpoint with `vocab_size` embedding rows (ConfigError for a bad model section)."""
    from megatron_rl.config import ConfigError
    from megatron_rl.models.presets import resolve_architecture

    try:
        return resolve_architecture(cfg.model, vocab_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def ensure_warm_start(cfg: RunConfig, run_dir: Path, tokenizer, train_rows) -> str:
    """The HF directory the run starts from (running the SFT warm start first if needed)."""
    if cfg.model.init_checkpoint:
        path = Path(cfg.model.init_checkpoint)
        if not (path / "config.json").exists() and not is_megatron_checkpoint(path):
            raise FileNotFoundError(f"model.init_checkpoint={path} is neither an HF directory (no config.json) "
                                    "nor a megatron distributed checkpoint")
        return str(path)
    out = sft_dir(cfg, run_dir) / "hf"
    if needs_warm_start(cfg, run_dir):
        from megatron_rl.sft import run_sft  # heavy (megatron): imported only when a warm start is trained

        run_sft(cfg, tokenizer, train_rows, sft_dir(cfg, run_dir))
    barrier()
    return str(out)


def warm_start_summary(cfg: RunConfig, run_dir: Path) -> str:
    """Where the run started, for its summary: the init checkpoint, or how its SFT warm start ended."""
    if cfg.model.init_checkpoint:
        return f"model.init_checkpoint={cfg.model.init_checkpoint}"
    from megatron_rl.sft import warm_start_record

    record = warm_start_record(sft_dir(cfg, run_dir))
    if record is None:
        return f"SFT export {sft_dir(cfg, run_dir) / 'hf'}"
    acc = record.get("greedy_accuracy")
    measured = "" if acc is None else f", last check {100 * acc:.1f}% greedy accuracy on {cfg.sft.eval_prompts} prompts it did not train on"
    target, reached_at = record.get("stop_accuracy"), record.get("reached_at")
    if record.get("stopped_by") == "stop_accuracy":
        settled = f" at step {reached_at}, then {record['settle_steps']} settle steps" if record.get("settle_steps") else ""
        why = f" (reached sft.stop_accuracy={target}{settled})"
    elif target:
        why = f" (all sft.steps; sft.stop_accuracy={target} " + \
            (f"reached at step {reached_at}, settling cut short)" if reached_at else "not reached)")
    else:
        why = ""
    return f"SFT {record['steps']} steps{why}{measured}"


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True for a complete megatron_rl distributed checkpoint, or a root holding one."""
    from megatron_rl.trainer.checkpoint import latest_checkpoint

    path = Path(path)
    return (path / "COMPLETE").exists() or latest_checkpoint(path) is not None


def model_vocab_size(init_dir: str, tokenizer) -> int:
    """Rows of the model's embedding: the init checkpoint's (HF config.json or megatron meta.json), else the tokenizer's.

    Real checkpoints pad the vocabulary beyond the tokenizer (Qwen3: 151936 rows, 151669 tokens), so sizing
    the learner from the tokenizer would not fit their weights.
    """
    path = Path(init_dir)
    if (path / "config.json").exists():
        import json

        rows = int(json.loads((path / "config.json").read_text()).get("vocab_size") or len(tokenizer))
    elif is_megatron_checkpoint(path):
        from megatron_rl.trainer.checkpoint_reader import checkpoint_architecture

        rows = checkpoint_architecture(path).vocab_size
    else:
        return len(tokenizer)
    if rows < len(tokenizer):
        from megatron_rl.config import ConfigError

        raise ConfigError(f"model.init_checkpoint={init_dir} has {rows} embedding rows, fewer than the tokenizer's "
                         f"{len(tokenizer)} tokens (data.tokenizer_dir): they belong to different models")
    return rows


def initialize_learner(learner, init_dir: str, tokenizer, run_dir: Path) -> str:
    """Load the initial weights (HF or megatron checkpoint); returns the HF directory engines start from."""
    if not is_megatron_checkpoint(init_dir):
        load_initial_weights(learner, init_dir)
        return init_dir
    from megatron_rl.trainer.checkpoint import load_checkpoint

    from megatron_rl.phases.weights import export_hf_dir

    load_checkpoint(learner, init_dir, load_optimizer=False, load_rng=False)
    out = run_dir / "init_hf"
    export_hf_dir(learner, tokenizer, out)
    return str(out)


def load_initial_weights(learner, hf_dir: str) -> int:
    """Load HF safetensors into the learner through the mapping, each rank reading only its own PP/TP share; returns the bytes it read.

    Names and shapes are checked from the file headers first (nothing read); then every local parameter reads
    just its slice (`get_slice`), so a rank's host memory holds one parameter's shard at a time, not the model.
    """
    import torch

    from megatron_rl.convert.safetensors_io import SlicedHFReader
    from megatron_rl.models import hf_mapping

    reader = SlicedHFReader(hf_dir)
    headers = {name: torch.empty(reader.shape(name), device="meta") for name in reader.names()}
    expected = learner.expected_full_shapes()
    hf_mapping.check_complete(hf_mapping.to_megatron(headers, learner.arch), expected, f"initial weights from {hf_dir}")
    learner.load_pieces(lambda name, shard: hf_mapping.read_megatron_piece(name, expected[name], learner.arch, reader, shard),
                        f"initial weights from {hf_dir}")
    return reader.bytes_read
