"""Where the policy starts.

`model.init_checkpoint` names either an HF directory (config + safetensors), loaded through the
HF -> Megatron mapping on every rank, or a megatron distributed checkpoint (a step directory or a
checkpoint root, e.g. from `megatron-rl convert hf-to-megatron`), loaded sharded under any parallel
layout — the scalable path for 8B+ models. When it is unset, the supervised warm start
(`megatron_rl.sft`) trains the model on the task once and exports <run_dir>/sft/hf, reused later.
Engines always start from an HF directory (exported from the learner for megatron checkpoints).
"""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import barrier


def sft_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Output directory of the warm start."""
    return Path(cfg.sft.output_dir) if cfg.sft.output_dir else run_dir / "sft"


def needs_warm_start(cfg: RunConfig, run_dir: Path) -> bool:
    """True when the run will train the supervised warm start (no init checkpoint and no earlier warm start to reuse)."""
    return not cfg.model.init_checkpoint and not (sft_dir(cfg, run_dir) / "hf" / "model.safetensors").exists()


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
        from megatron_rl.sft import run_sft

        run_sft(cfg, tokenizer, train_rows, sft_dir(cfg, run_dir))
    barrier()
    return str(out)


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True for a complete megatron_rl distributed checkpoint, or a root holding one."""
    from megatron_rl.trainer.checkpoint import latest_checkpoint

    path = Path(path)
    return (path / "COMPLETE").exists() or latest_checkpoint(path) is not None


def initialize_learner(learner, init_dir: str, tokenizer, run_dir: Path) -> str:
    """Load the initial weights (HF or megatron checkpoint); returns the HF directory engines start from."""
    if not is_megatron_checkpoint(init_dir):
        load_initial_weights(learner, init_dir)
        return init_dir
    from megatron_rl.trainer.checkpoint import load_checkpoint

    load_checkpoint(learner, init_dir, load_optimizer=False, load_rng=False)
    out = run_dir / "init_hf"
    export_hf_dir(learner, tokenizer, out)
    return str(out)


def load_initial_weights(learner, hf_dir: str) -> None:
    """Load HF safetensors into the learner through the mapping (every rank reads the same file)."""
    from safetensors.torch import load_file

    from megatron_rl.models import hf_mapping

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    hf_sd = {}
    for f in files:
        hf_sd.update(load_file(str(f)))
    full = hf_mapping.to_megatron(hf_sd, learner.arch)
    hf_mapping.check_complete(full, learner.expected_full_shapes(), f"initial weights from {hf_dir}")
    learner.load_full_state_dict(full)


def export_hf_dir(learner, tokenizer, out_dir: Path) -> None:
    """Write an HF directory (config, safetensors, tokenizer) of the learner's weights on the controller."""
    from safetensors.torch import save_file

    from megatron_rl.models.presets import hf_config
    from megatron_rl.phases.weights import export_hf_state_dict

    hf_sd = export_hf_state_dict(learner)
    if state.is_controller():
        out_dir.mkdir(parents=True, exist_ok=True)
        config = hf_config(learner.arch, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
        config.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
        tmp = out_dir / "model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(out_dir / "model.safetensors")
    barrier()
