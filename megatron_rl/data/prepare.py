"""Write a synthetic task's train/eval JSONL and the character tokenizer into a directory (idempotent)."""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config.data import DataConfig
from megatron_rl.data.jsonl import write_jsonl
from megatron_rl.data.tasks import generate
from megatron_rl.data.tokenizer import build_char_tokenizer


def prepare_task_data(cfg: DataConfig, out_dir: str | Path) -> dict[str, str]:
    """Paths {'train', 'eval', 'tokenizer'}; files that already exist are kept (same config -> same content)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": str(out / "train.jsonl"), "eval": str(out / "eval.jsonl"), "tokenizer": str(out / "tokenizer")}
    if not (out / "eval.jsonl").exists() or not (out / "train.jsonl").exists():
        evals = generate(cfg.task, cfg.num_eval_prompts, seed=cfg.seed + 1, **cfg.task_options)
        train = generate(cfg.task, cfg.num_train_prompts, seed=cfg.seed, exclude={r.prompt for r in evals}, **cfg.task_options)
        write_jsonl(out / "eval.jsonl", evals)
        write_jsonl(out / "train.jsonl", train)
    if not (out / "tokenizer" / "tokenizer.json").exists():
        build_char_tokenizer(out / "tokenizer")
    return paths
