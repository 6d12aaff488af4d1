"""Prepare the tiny math example: a printable-character tokenizer with a ChatML chat template, and the DAPO-layout
sample as Parquet (the format DAPO-Math-17k ships in), under OUT (default runs/tiny_math/base).

    python examples/data/math_sample/prepare.py [OUT]
    megatron-rl train examples/configs/tiny_math.yaml

The sample rows (dapo_math.jsonl: DAPO-Math-17k layout; math.jsonl: MATH layout) are hand-written here.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def prepare(out: Path) -> dict[str, str]:
    """Write OUT/tokenizer and OUT/dapo_math.parquet; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_rl.data.sources import iter_records
    from megatron_rl.data.tokenizer import CHATML_TEMPLATE, PRINTABLE_ALPHABET, build_char_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(out / "tokenizer", PRINTABLE_ALPHABET, chat_template=CHATML_TEMPLATE)
    records = [rec for _, rec in iter_records(HERE / "dapo_math.jsonl")]
    pq.write_table(pa.Table.from_pylist(records), str(out / "dapo_math.parquet"))
    return {"tokenizer": str(out / "tokenizer"), "train": str(out / "dapo_math.parquet")}


if __name__ == "__main__":
    for name, path in prepare(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny_math/base")).items():
        print(f"{name}: {path}")
