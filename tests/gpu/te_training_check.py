"""One-shot check that an FP8 Learner trains like BF16: a Transformer Engine blockwise Learner (the main job's recipe)
and a BF16 one, same initial weights and data, trained some steps on a learnable task; their loss curves must stay
close, and a deliberately broken FP8 recipe trained the same way must not.

Run:  python tests/gpu/te_training_check.py               (CUDA + Transformer Engine: the Docker image, run_image.sh)
      python tests/gpu/te_training_check.py --device cpu  (the same Learners on CPU, FP8 emulated: the control flow and
                                                           the emulation's own curves, in CI via run_image.sh --cpu)

Task: next token = (5 x token + 3) mod 256 (a permutation of the vocabulary: a bigram the model must learn; random
init scores ln 256 = 5.55 nats, a learnt one ~0). Model: 2 layers, hidden 256, SwiGLU 512, 2 heads of 128, 1 KV
group (every GEMM dimension a multiple of 128, as blockwise FP8 needs); 16 rows x 64 tokens per step (1024 tokens),
Adam at 3e-3, bf16 parameters, 40 steps. The CPU mode halves the width (hidden 128, heads of 64), the rows (8) and
takes 30 steps: the emulation costs minutes otherwise. Checks:
- bf16_learns: BF16's loss falls below half its initial value (the task is learnable in the steps given).
- blockwise_tracks_bf16: max over steps |loss_fp8 - loss_bf16| <= 5% of BF16's drop (its first minus last loss).
- broken_recipe_is_caught: the same test applied to precision.recipe=delayed with margin 16 (scales 2^16 below amax:
  E4M3 values all subnormal, most zero) must fail, or the tolerance could not tell a broken recipe from a good one.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.precision.te import launcher_env  # noqa: E402

FP8 = PrecisionConfig(recipe="blockwise")
BROKEN = PrecisionConfig(recipe="delayed", margin=16)
# What a launcher exports before Transformer Engine is imported (FP32 block scales on Hopper); this script is its own.
for key, value in launcher_env(FP8).items():
    os.environ.setdefault(key, value)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402

RESULTS: list[dict] = []
VOCAB, SEQ = 256, 64
ROWS, STEPS, WIDTH = 16, 40, 256
"""Rows per step, steps and hidden size on CUDA (main() lowers them for --device cpu)."""
TRACK_FRACTION = 0.05
"""Largest |loss_fp8 - loss_bf16| over the curve, as a fraction of BF16's total drop."""


def check(name: str, ok: bool, **detail) -> None:
    """Record and print one check."""
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {json.dumps(detail, default=str)}", flush=True)


def _batch(step: int):
    """16 rows of the permutation task, a fresh random start token per row and step."""
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
    ids = [start]
    for _ in range(SEQ - 1):
        ids.append((5 * ids[-1] + 3) % VOCAB)
    ids = torch.cat(ids, 1)
    mask = torch.ones(ROWS, SEQ)
    mask[:, -1] = 0.0  # the last position has no next token
    return TrainBatch(ids, torch.roll(ids, -1, 1), mask, torch.zeros(ROWS, SEQ), torch.zeros(ROWS, SEQ),
                      token_weight=mask / mask.sum())


def _nll(lp, ent, mb, ctx):
    return -(mb.token_weight * lp).sum(), {}


def curve(precision: PrecisionConfig) -> list[float]:
    """The loss of every step of a fresh Learner (seed 7) with `precision` on the task."""
    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.trainer.learner import Learner

    learner = Learner(ModelConfig(preset="tiny", num_layers=2, hidden_size=WIDTH, ffn_hidden_size=2 * WIDTH,
                                  num_attention_heads=2, num_query_groups=1, head_dim=WIDTH // 2, max_seq_len=SEQ),
                      ParallelConfig(logprob_chunk_size=512), OptimConfig(lr=3e-3, clip_grad=1.0, params_dtype="bf16"),
                      precision, vocab_size=VOCAB, seed=7)
    return [learner.train_step(_batch(step), _nll, ROWS)["loss"] for step in range(STEPS)]


def main(argv: list[str]) -> int:
    """Train the three Learners and report the checks; exit status 1 if any failed."""
    global ROWS, STEPS, WIDTH
    t0 = time.perf_counter()
    cpu = argv[:2] == ["--device", "cpu"]
    if cpu:
        ROWS, STEPS, WIDTH = 8, 30, 128
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --device cpu)")
            return 1
        from megatron_rl.precision.te import te_available

        if not te_available():
            print("[FAIL] transformer_engine needs Transformer Engine on CUDA (the Docker image has it)")
            return 1
    from megatron_rl.parallel import state

    try:
        curves = {"bf16": curve(PrecisionConfig()), "blockwise": curve(FP8), "broken": curve(BROKEN)}
    except Exception as exc:  # reported as the failed check it is
        traceback.print_exc()
        check("train", False, error=repr(exc))
        return 1
    finally:
        if state.is_initialized():
            state.destroy_distributed()
    bf16 = curves["bf16"]
    drop = bf16[0] - bf16[-1]
    print(json.dumps({k: [round(x, 4) for x in v] for k, v in curves.items()}), flush=True)
    check("bf16_learns", bf16[-1] < 0.5 * bf16[0], first=bf16[0], last=bf16[-1], steps=STEPS)

    def gap(name: str) -> float:
        return max(abs(a - b) for a, b in zip(curves[name], bf16))

    tol = TRACK_FRACTION * drop
    check("blockwise_tracks_bf16", gap("blockwise") <= tol, max_gap=gap("blockwise"), tolerance=tol,
          last=[curves["blockwise"][-1], bf16[-1]])
    check("broken_recipe_is_caught", gap("broken") > tol, max_gap=gap("broken"), tolerance=tol,
          last=[curves["broken"][-1], bf16[-1]], recipe="delayed, margin 16")
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"passed": len(RESULTS) - len(failed), "failed": failed, "seconds": round(time.perf_counter() - t0, 1)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
