"""Checkpoint conversions offered by `megatron-rl convert`."""
from __future__ import annotations

import json
from pathlib import Path


def hf_to_fp8(src: str, dst: str, scale_fmt: str = "fp32") -> str:
    """Cast an HF checkpoint directory to an FP8 blockwise checkpoint SGLang/vLLM load (config + tokenizer copied)."""
    import shutil

    from safetensors.torch import load_file

    from megatron_rl.precision.hf_fp8 import save_fp8_checkpoint

    src_p, dst_p = Path(src), Path(dst)
    if not (src_p / "config.json").exists():
        raise FileNotFoundError(f"{src} is not an HF directory (no config.json)")
    tensors = {}
    for f in sorted(src_p.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    config = json.loads((src_p / "config.json").read_text())
    save_fp8_checkpoint(tensors, config, dst_p, scale_fmt=scale_fmt)
    for f in src_p.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")) and f.is_file():
            shutil.copyfile(f, dst_p / f.name)
    return str(dst_p)


def hf_to_megatron(src: str, dst: str, cfg) -> str:
    """Convert an HF directory to a megatron distributed checkpoint (weights only) under cfg's model and layout.

    Collective under torchrun; the result loads under any other parallel layout (dist_checkpointing reshards),
    so `model.init_checkpoint=DST` starts runs without every rank reading the whole HF checkpoint.
    """
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.parallel import state
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import load_initial_weights

    config_path = Path(src) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{src} is not an HF directory (no config.json)")
    vocab = json.loads(config_path.read_text()).get("vocab_size")
    state.init_distributed(cfg.parallel, cfg.train.seed)
    # Weights are converted at high precision; the FP8 policy applies when a run loads them.
    learner = Learner(cfg.model, cfg.parallel, cfg.optim, PrecisionConfig(), vocab_size=vocab, seed=cfg.train.seed)
    load_initial_weights(learner, src)
    return save_checkpoint(learner, dst, step=0, rl_state={"step": 0, "converted_from": str(src)}, keep_last=1)
