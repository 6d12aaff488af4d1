"""Where the policy starts: an HF directory (config + safetensors + tokenizer) the learner loads
through the HF -> Megatron mapping and the engines serve.

`model.init_checkpoint` names an existing HF directory; when it is unset, the supervised warm start
(`megatron_rl.sft`) trains the model on the task once and exports <run_dir>/sft/hf, reused later.
"""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import barrier


def sft_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Output directory of the warm start."""
    return Path(cfg.sft.output_dir) if cfg.sft.output_dir else run_dir / "sft"


def ensure_warm_start(cfg: RunConfig, run_dir: Path, tokenizer, train_rows) -> str:
    """The HF directory the run starts from (running the SFT warm start first if needed)."""
    if cfg.model.init_checkpoint:
        path = Path(cfg.model.init_checkpoint)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.init_checkpoint={path} is not an HF directory (no config.json)")
        return str(path)
    out = sft_dir(cfg, run_dir) / "hf"
    if not (out / "model.safetensors").exists():
        from megatron_rl.sft import run_sft

        run_sft(cfg, tokenizer, train_rows, sft_dir(cfg, run_dir))
    barrier()
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
