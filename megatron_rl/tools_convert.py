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
