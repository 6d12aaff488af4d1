"""Learner step time under parallel layouts vs world size 1, and peak memory of chunked vocab log-probs, in one run.

    python benchmarks/bench_parallel_layouts.py [--rows 32] [--seq 64] [--micro-batch-size 4] [--steps 4]
        [--rounds 2] [--world4] [--recipe none] [--mem-vocab 32768 151936] [--mem-tokens 2048]
        [--mem-chunks 256 1024 all] [--mem-backward-max-vocab 32768] [--skip-layouts] [--skip-memory]

Part 1 (layouts): the tiny model (preset tiny + examples/configs/tiny_base.yaml overrides) runs
`Learner.train_step` (forward + backward + optimizer through megatron's schedules, gloo) on one
fixed global batch under world 1 and under TP2, PP2, DP2, CP2, TP2+SP and DP2 with the distributed
optimizer (with --world4 also TP2xPP2, TP2xDP2, DP4, PP2xDP2, TP2xCP2+SP). All layouts of one world
size share one `torch.distributed.run` job (megatron's groups are rebuilt per layout), visited
--rounds times in turn so machine load spreads over them; each visit times --steps steps after one
warm-up step, one CPU thread per process, and rank 0 reports the median. The world-1 reference runs
in this process before and after the jobs (their spread shows how much the shared box drifted);
ratios are to their mean. On a 2-core box a world-2 job has twice the cores of world 1 and world 4
oversubscribes them: the ratios measure the code paths' overhead here, not GPU scaling.

Part 2 (memory): `trainer.logprobs.vocab_parallel_logprobs_entropy` on [--mem-tokens, V] logits for
each V and chunk size, forward only (no grad, as in forward_logprobs) and forward + backward (as in
train_step; it includes the logits' gradient, and by default only for V <= 32768 because it costs
~5x the forward). The peak is Linux's VmHWM after the call minus VmRSS before it, with the
high-water mark reset through /proc/self/clear_refs, all in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

# name -> (world, layout); DP is whatever the world leaves after TP * PP * CP
LAYOUTS_2 = {
    "TP2": (2, {"tp": 2}),
    "PP2": (2, {"pp": 2}),
    "DP2": (2, {}),
    "CP2": (2, {"cp": 2}),
    "TP2+SP": (2, {"tp": 2, "sp": True}),
    "DP2+distopt": (2, {"distopt": True}),
}
LAYOUTS_4 = {
    "TP2xPP2": (4, {"tp": 2, "pp": 2}),
    "TP2xDP2": (4, {"tp": 2}),
    "DP4": (4, {}),
    "PP2xDP2": (4, {"pp": 2}),
    "TP2xCP2+SP": (4, {"tp": 2, "cp": 2, "sp": True}),
}


# ---------------------------------------------------------------------------- part 1: layouts
def time_layout(args, layout: dict) -> list[float]:
    """Build the Learner under `layout` (re-initialising megatron's groups), time train_step on this DP rank's rows."""
    import gc

    import torch
    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.config.model import ParallelConfig
    from megatron_rl.parallel import state
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.types import TrainBatch

    cfg = load_config(ROOT / "examples/configs/tiny_base.yaml", [f"precision.recipe={args.recipe}"])
    pcfg = ParallelConfig(
        tensor_model_parallel_size=layout.get("tp", 1), pipeline_model_parallel_size=layout.get("pp", 1),
        context_parallel_size=layout.get("cp", 1), sequence_parallel=layout.get("sp", False),
        use_distributed_optimizer=layout.get("distopt", False),
    )
    state.init_distributed(pcfg, seed=5)
    learner = Learner(cfg.model, pcfg, cfg.optim, cfg.precision, vocab_size=args.vocab, seed=5,
                      total_steps=cfg.train.optimizer_steps)

    g = torch.Generator().manual_seed(7)
    rows, seq, vocab = args.rows, args.seq, learner.arch.vocab_size
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    pos = torch.arange(seq)[None]
    mask = ((pos >= seq // 4) & (pos < torch.randint(seq // 2, seq + 1, (rows, 1), generator=g))).float()
    adv = torch.randn(rows, 1, generator=g) * mask
    batch = TrainBatch(ids, torch.roll(ids, -1, 1), mask, adv.contiguous(), torch.zeros(rows, seq),
                       token_weight=mask / mask.sum())
    dp, r = state.dp_size(), state.dp_rank()
    mine = batch.select(slice(r * rows // dp, (r + 1) * rows // dp))

    def loss_fn(lp, ent, mb, ctx):
        """Sum-form policy-gradient loss with a small entropy bonus (both gradients flow)."""
        return (mb.token_weight * (-mb.advantages * lp - 0.01 * ent)).sum(), {}

    times = []
    for i in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        learner.train_step(mine, loss_fn, args.micro_batch_size)
        dist.barrier()
        if i:  # the first step is warm-up
            times.append(time.perf_counter() - t0)
    del learner
    gc.collect()
    return times


def layouts_worker(args) -> None:
    """One torchrun job running every layout of --layouts in turn (one process-group start-up); rank 0 writes JSON."""
    import torch

    from megatron_rl.parallel import state

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, layout in json.loads(args.layouts):
            times.setdefault(name, []).extend(time_layout(args, layout))
    results = {name: {"median_s": statistics.median(t), "times": t} for name, t in times.items()}
    rank = state.global_rank()
    state.destroy_distributed()
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(results))


def run_layouts(args, world: int, names: list[str], layouts: dict) -> dict[str, Any]:
    """Spawn one torch.distributed.run job of `world` processes for `names`; {name: timings} (empty on failure)."""
    with tempfile.TemporaryDirectory(prefix="bench_layout_") as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
               "--layouts", json.dumps([[n, layouts[n][1]] for n in names]), "--worker-out", str(out),
               "--rows", str(args.rows), "--seq", str(args.seq), "--micro-batch-size", str(args.micro_batch_size),
               "--steps", str(args.steps), "--rounds", str(args.rounds), "--recipe", args.recipe, "--vocab", str(args.vocab)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"world-{world} job timed out after {args.timeout:.0f}s")
            return {}
        if proc.returncode != 0 or not out.exists():
            print(f"world-{world} job failed (rc={proc.returncode})\n{proc.stderr[-3000:]}")
            return {}
        return json.loads(out.read_text())


def world1_median(args) -> float:
    """World-1 reference in this process (a process group of one), median step seconds."""
    import torch

    from megatron_rl.parallel import state

    torch.set_num_threads(1)
    try:
        return statistics.median([t for _ in range(args.rounds) for t in time_layout(args, {})])
    finally:
        state.destroy_distributed()


def bench_layouts(args) -> None:
    """World 1 (before and after), then one job per world size with its layouts; print per-step times and ratios."""
    layouts = dict(LAYOUTS_2, **(LAYOUTS_4 if args.world4 else {}))
    print(f"\n== per-step time of Learner.train_step, global batch {args.rows} x {args.seq} tokens, micro-batch "
          f"{args.micro_batch_size}, recipe {args.recipe}, median of {args.rounds} x {args.steps} steps (1 warm-up per visit) ==")
    first = world1_median(args)
    results: dict[str, Any] = {}
    for world in sorted({w for w, _ in layouts.values()}):
        results.update(run_layouts(args, world, [n for n, (w, _) in layouts.items() if w == world], layouts))
    last = world1_median(args)
    base = (first + last) / 2
    print(f"{'layout':>14} {'world':>6} {'step ms':>9} {'x world1':>9}")
    print(f"{'world1':>14} {1:>6} {base * 1e3:>9.1f} {1.0:>9.2f}   (first {first * 1e3:.1f} ms, last {last * 1e3:.1f} ms:"
          " the drift of the shared box)")
    for name, (world, _) in layouts.items():
        res = results.get(name)
        if res is None:
            print(f"{name:>14} {world:>6} {'failed':>9}")
            continue
        print(f"{name:>14} {world:>6} {res['median_s'] * 1e3:>9.1f} {res['median_s'] / base:>9.2f}")


# ---------------------------------------------------------------------------- part 2: memory
def _proc_kib(field: str) -> int:
    """A KiB field of /proc/self/status (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def mem_case(vocab: int, tokens: int, chunk: int, backward: bool, dtype) -> dict[str, float]:
    """Extra peak RSS (bytes) and seconds of one log-prob call on fresh [tokens, vocab] logits (+ backward)."""
    import gc

    import torch

    from megatron_rl.trainer.logprobs import vocab_parallel_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    # fill in row blocks so no full-size fp32 temporary exists outside the measured call
    logits = torch.empty(tokens, vocab, dtype=dtype)
    for s in range(0, tokens, 128):
        logits[s:s + 128] = torch.randn(min(128, tokens - s), vocab, generator=g).to(dtype) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    weight = torch.rand(tokens, generator=g)
    gc.collect()
    reset_peak_rss()
    before = _proc_kib("VmRSS")
    t0 = time.perf_counter()
    if backward:
        logits.requires_grad_(True)
        lp, ent = vocab_parallel_logprobs_entropy(logits, labels, None, chunk)
        (weight * (lp + 0.01 * ent)).sum().backward()
    else:
        with torch.no_grad():
            vocab_parallel_logprobs_entropy(logits, labels, None, chunk)
    seconds = time.perf_counter() - t0
    peak = (_proc_kib("VmHWM") - before) * 1024
    del logits
    gc.collect()
    return {"peak_bytes": peak, "seconds": seconds}


def bench_memory(args) -> None:
    """Every (vocab, chunk) case forward-only, and forward+backward up to --mem-backward-max-vocab; print peaks and ratios."""
    import torch

    torch.set_num_threads(1)
    if not reset_peak_rss():
        print("\n(memory part skipped: /proc/self/clear_refs cannot reset the peak RSS on this system)")
        return
    dtype = torch.bfloat16 if args.mem_dtype == "bf16" else torch.float32
    itemsize = 2 if args.mem_dtype == "bf16" else 4
    tokens = args.mem_tokens
    chunks = sorted({tokens if c == "all" else min(int(c), tokens) for c in args.mem_chunks})
    print(f"\n== extra peak RSS of vocab_parallel_logprobs_entropy on [{tokens}, V] {args.mem_dtype} logits (VmHWM reset "
          "before each call; fwd+bwd includes the logits' gradient; ratios to the unchunked call) ==")
    print(f"{'vocab':>8} {'chunk':>6} {'logits MiB':>11} {'fwd MiB':>9} {'x all':>6} {'fwd ms':>8}"
          f" {'fwd+bwd MiB':>12} {'x all':>6} {'fwd+bwd ms':>11}")
    for vocab in args.mem_vocab:
        rows = {c: {bwd: mem_case(vocab, tokens, c, bwd, dtype) if (not bwd or vocab <= args.mem_backward_max_vocab) else None
                    for bwd in (False, True)}
                for c in chunks}
        for chunk, row in rows.items():
            cells = []
            for bwd, width in ((False, (9, 8)), (True, (12, 11))):
                cell, ref = row[bwd], rows[tokens][bwd]
                if cell is None:
                    cells.append(f"{'-':>{width[0]}} {'-':>6} {'-':>{width[1]}}")
                    continue
                cells.append(f"{cell['peak_bytes'] / 2**20:>{width[0]}.0f} {cell['peak_bytes'] / max(ref['peak_bytes'], 1):>6.3f}"
                             f" {cell['seconds'] * 1e3:>{width[1]}.0f}")
            name = "all" if chunk == tokens else str(chunk)
            print(f"{vocab:>8} {name:>6} {tokens * vocab * itemsize / 2**20:>11.0f} {cells[0]} {cells[1]}")


def main() -> None:
    """Parse flags and run both parts (or one worker case)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help="global batch rows (split over DP)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per row (<= the tiny model's max_seq_len 64)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed train steps per layout (after 1 warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="visits of each layout (steps are timed on every visit)")
    ap.add_argument("--recipe", default="none", help="precision.recipe (blockwise etc. add FP8 emulation cost)")
    ap.add_argument("--vocab", type=int, default=50, help="model vocabulary (the tiny task's tokenizer: 50)")
    ap.add_argument("--world4", action="store_true", help="also run the world-4 layouts")
    ap.add_argument("--mem-vocab", type=int, nargs="+", default=[32768, 151936])
    ap.add_argument("--mem-tokens", type=int, default=2048)
    ap.add_argument("--mem-chunks", nargs="+", default=["256", "1024", "all"])
    ap.add_argument("--mem-dtype", choices=["bf16", "fp32"], default="bf16", help="logits dtype")
    ap.add_argument("--mem-backward-max-vocab", type=int, default=32768,
                    help="run forward+backward cases only for vocabularies up to this (they cost ~5x the forward)")
    ap.add_argument("--skip-layouts", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per spawned job")
    ap.add_argument("--layouts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layouts is not None:
        return layouts_worker(args)
    if not args.skip_layouts:
        bench_layouts(args)
    if not args.skip_memory:
        bench_memory(args)


if __name__ == "__main__":
    main()
