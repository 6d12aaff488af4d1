"""Calibrated Clipping inside a full Learner.train_step: plain PPO loss vs calibrated loss, measured side by side.

    python benchmarks/bench_calibration_step.py [--rows 64] [--seq 32] [--micro-batch-size 32]
        [--reps 10] [--recipe blockwise] [--no-world2] [--config examples/configs/tiny_fp8_grpo.yaml]

The tiny model of examples/configs (preset tiny + tiny_base.yaml overrides; default config
tiny_fp8_grpo.yaml, i.e. blockwise FP8 emulation, TIS on) runs `Learner.train_step` (forward,
backward and optimizer step over the micro-batches of one mini-batch) on one synthetic batch
(random tokens, random per-sequence advantages, old log-probs = the current policy's +- noise).
Three loss functions, interleaved round by round so machine load hits them alike:
`plain` (phases.loss.RLLoss without a clipper) and `allgather` / `histogram` (RLLoss with a
CalibratedClipper, bounds_update=per_microbatch, targets set by one shadow micro-batch first).
It prints, per backend: the calibration share of a full training step (time inside
clipper.update / step time, and the step-time difference to plain), the calibrated/plain time of
the loss function per micro-batch, the amortised cost of the high-precision shadow forwards, and
the bytes one rank receives per micro-batch for the ratio statistics (counted on the collectives
that ran, and algo.calibration.calibration_bytes for larger groups).

World size 1 runs in this process (the DP x CP group of size 1 still takes the collectives code
path); unless --no-world2 it then runs the same global batch as DP=2 on two gloo processes via
torch.distributed.run, where the statistics really travel. One CPU thread per process.
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
from typing import Any, Optional

import torch

# runnable from a checkout without installing the package
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

VARIANTS = ("plain", "allgather", "histogram")


class CollectiveCounter:
    """Stand-in for `torch.distributed` inside parallel/collectives.py that counts the bytes a rank receives (ring algorithms)."""

    def __init__(self, dist_module: Any) -> None:
        """Forward everything to `dist_module`; count only while `active`."""
        self._dist = dist_module
        self.active = False
        self.received = 0

    def __getattr__(self, name: str) -> Any:
        """Everything not overridden goes to torch.distributed."""
        return getattr(self._dist, name)

    def all_gather(self, outputs, tensor, group=None, **kw):
        """Count (world - 1) copies of the payload, then gather."""
        if self.active:
            self.received += (len(outputs) - 1) * tensor.numel() * tensor.element_size()
        return self._dist.all_gather(outputs, tensor, group=group, **kw)

    def all_reduce(self, tensor, op=None, group=None, **kw):
        """Count 2 (w - 1) / w of the buffer, then reduce."""
        if self.active:
            w = self._dist.get_world_size(group)
            self.received += int(2 * (w - 1) * tensor.numel() * tensor.element_size() // w)
        kw = dict(kw, group=group)
        if op is not None:
            kw["op"] = op
        return self._dist.all_reduce(tensor, **kw)


def load_cfg(args):
    """The run config of --config with the benchmark's overrides."""
    from megatron_rl.config import load_config

    overrides = [f"precision.recipe={args.recipe}", "algo.calibration.enabled=true",
                 "algo.calibration.bounds_update=per_microbatch", "algo.calibration.target_source=shadow",
                 f"train.micro_batch_size={args.micro_batch_size}"]
    return load_config(ROOT / args.config if not Path(args.config).is_absolute() else args.config, overrides)


def synthetic_batch(learner, cfg, rows: int, seq: int, vocab: int, noise: float, seed: int = 0):
    """One global mini-batch: random tokens, per-sequence advantages, old = current log-probs +- noise (shadow fields too)."""
    from megatron_rl.parallel import state
    from megatron_rl.phases.batching import dp_shard, with_token_weights
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    prompt = torch.randint(seq // 4, seq // 2, (rows, 1), generator=g)
    length = torch.randint(3 * seq // 4, seq + 1, (rows, 1), generator=g)
    pos = torch.arange(seq)[None]
    mask = ((pos >= prompt) & (pos < length)).float()
    adv = (torch.randn(rows, 1, generator=g) * mask).contiguous()
    batch = TrainBatch(ids, labels, mask, adv, torch.zeros(rows, seq), sample_index=torch.arange(rows))
    batch = with_token_weights(batch, cfg.algo.policy_loss.agg_mode)
    shard = dp_shard(batch, state.dp_rank(), state.dp_size())
    lp, _ = learner.forward_logprobs(shard, cfg.train.micro_batch_size)

    def jitter(scale: float) -> torch.Tensor:
        """The current log-probs plus Gaussian noise of std `scale`, zero off the loss mask."""
        return (lp + scale * torch.randn(lp.shape, generator=g)) * shard.loss_mask

    return shard.with_fields(old_logprobs=jitter(noise), rollout_logprobs=jitter(noise / 2),
                             old_logprobs_hp=jitter(noise), logprobs_hp=jitter(noise / 4))


def timed_loss(loss_fn, clock: dict):
    """Wrap an RLLoss (and its clipper.update) so wall times accumulate in `clock`."""
    clipper = loss_fn.clipper
    if clipper is not None:
        if not hasattr(clipper, "_bench_update"):
            clipper._bench_update = clipper.update

            def update(*a, **kw):
                """clipper.update, timed."""
                t0 = time.perf_counter()
                out = clipper._bench_update(*a, **kw)
                clipper._bench_clock["update"] += time.perf_counter() - t0
                return out

            clipper.update = update
        clipper._bench_clock = clock

    def call(lp, ent, mb, ctx):
        """The loss function, timed."""
        t0 = time.perf_counter()
        out = loss_fn(lp, ent, mb, ctx)
        clock["loss"] += time.perf_counter() - t0
        clock["calls"] += 1
        return out

    return call


def measure(args) -> dict[str, Any]:
    """Run the variants side by side on this process's share of the batch; returns medians and byte counts (same on every rank)."""
    import torch.distributed as dist

    from megatron_rl.algo.calibration import calibration_bytes
    from megatron_rl.algo.clipper import make_clipper
    from megatron_rl.config.model import ParallelConfig
    from megatron_rl.parallel import collectives, state
    from megatron_rl.phases.loss import RLLoss
    from megatron_rl.precision import high_precision
    from megatron_rl.trainer.learner import Learner

    cfg = load_cfg(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pcfg = ParallelConfig(logprob_chunk_size=cfg.parallel.logprob_chunk_size)
    state.init_distributed(pcfg, cfg.train.seed)
    learner = Learner(cfg.model, pcfg, cfg.optim, cfg.precision, vocab_size=args.vocab, seed=cfg.train.seed)
    mbs = cfg.train.micro_batch_size
    if args.rows % (world * mbs) != 0:
        raise SystemExit(f"--rows {args.rows} must be a multiple of world {world} x --micro-batch-size {mbs}")
    warm = synthetic_batch(learner, cfg, args.rows, args.seq, learner.arch.vocab_size, args.noise)
    timed = warm.with_fields(logprobs_hp=None, old_logprobs_hp=None)  # no shadow on timed steps
    counter = CollectiveCounter(collectives.dist)
    collectives.dist = counter

    clippers: dict[str, Optional[Any]] = {"plain": None}
    for backend in VARIANTS[1:]:
        c = cfg.algo.model_copy(update={"calibration": cfg.algo.calibration.model_copy(update={"backend": backend})})
        clippers[backend] = make_clipper(c)
    clocks = {v: {"loss": 0.0, "update": 0.0, "calls": 0} for v in VARIANTS}
    step_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    bytes_per_mb: dict[str, float] = {}

    def one_step(variant: str, batch, step: int, record: bool) -> None:
        """One train_step with `variant`'s loss; when `record`, keep its time, loss clock and byte count."""
        clipper = clippers[variant]
        if clipper is not None:
            clipper.begin_step(step)
        clock = clocks[variant] if record else {"loss": 0.0, "update": 0.0, "calls": 0}
        calls_before = clock["calls"]
        loss = timed_loss(RLLoss(cfg.algo, clipper, step), clock)
        counter.active, counter.received = record, 0
        dist.barrier()
        t0 = time.perf_counter()
        learner.train_step(batch, loss, mbs)
        if record:
            step_times[variant].append(time.perf_counter() - t0)
            bytes_per_mb[variant] = counter.received / max(clock["calls"] - calls_before, 1)
        counter.active = False

    # warm-up: step 0 is a calibration step (shadow micro-batches set alpha and rho), then one plain round
    for v in VARIANTS:
        one_step(v, warm, 0, record=False)
    for v in VARIANTS:
        one_step(v, timed, 1, record=False)
    for rep in range(args.reps):
        order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]  # rotate so no variant always runs first
        for v in order:
            one_step(v, timed, 2 + rep, record=True)

    # shadow cost: the two high-precision forwards of a calibration step (pi_old and current, whole batch)
    shadow = []
    for _ in range(max(2, args.reps // 2)):
        dist.barrier()
        t0 = time.perf_counter()
        with high_precision():
            learner.forward_logprobs(timed, mbs)
            learner.forward_logprobs(timed, mbs)
        shadow.append(time.perf_counter() - t0)

    tokens_per_mb = float(timed.loss_mask.sum()) / (timed.batch_size // mbs)
    med = {v: statistics.median(step_times[v]) for v in VARIANTS}
    out = {
        "world": world, "rows": args.rows, "seq": args.seq, "micro_batch_size": mbs,
        "micro_batches_per_rank": timed.batch_size // mbs, "tokens_per_microbatch": tokens_per_mb,
        "recipe": cfg.precision.recipe, "calibrate_every": cfg.algo.calibration.calibrate_every,
        "step_s": med, "shadow_s": statistics.median(shadow),
        "loss_per_mb_s": {v: clocks[v]["loss"] / max(clocks[v]["calls"], 1) for v in VARIANTS},
        "update_per_step_s": {v: clocks[v]["update"] / args.reps for v in VARIANTS},
        "bytes_counted_per_mb": bytes_per_mb,
        "bytes_formula_per_mb": {
            b: {str(w): calibration_bytes(b, world_size=w, tokens_per_rank=int(tokens_per_mb),
                                          max_samples_per_rank=cfg.algo.calibration.max_samples_per_rank,
                                          hist_spec=clippers[b].hist_spec)
                for w in sorted({world, 2, 8, 64})}
            for b in VARIANTS[1:]
        },
    }
    collectives.dist = counter._dist
    state.destroy_distributed()
    return out


def report(r: dict[str, Any]) -> None:
    """Print one world size's table."""
    s, plain = r["step_s"], r["step_s"]["plain"]
    print(f"\nworld {r['world']} (DP={r['world']}): {r['rows']} rows x {r['seq']} tokens per train_step, "
          f"{r['micro_batches_per_rank']} micro-batch(es) of {r['micro_batch_size']} per rank, "
          f"~{r['tokens_per_microbatch']:.0f} loss tokens per micro-batch, recipe {r['recipe']}")
    print(f"{'variant':>10} {'step ms':>9} {'x plain':>8} {'calib % step':>13} {'diff % step':>12}"
          f" {'loss ms/mb':>11} {'loss x plain':>13} {'B/rank/mb counted':>18}")
    for v in VARIANTS:
        share = 100 * r["update_per_step_s"][v] / s[v]
        diff = 100 * (s[v] - plain) / s[v]
        lm = r["loss_per_mb_s"][v]
        print(f"{v:>10} {s[v] * 1e3:>9.1f} {s[v] / plain:>8.3f} {share:>13.2f} {diff:>12.2f}"
              f" {lm * 1e3:>11.2f} {lm / r['loss_per_mb_s']['plain']:>13.2f} {r['bytes_counted_per_mb'].get(v, 0):>18,.0f}")
    print(f"shadow pass (2 high-precision forwards of the batch): {r['shadow_s'] * 1e3:.1f} ms = "
          f"{100 * r['shadow_s'] / plain:.1f}% of a plain step; amortised over calibrate_every={r['calibrate_every']}: "
          f"{100 * r['shadow_s'] / plain / r['calibrate_every']:.1f}% per step")
    f = r["bytes_formula_per_mb"]
    print("bytes one rank receives per micro-batch (calibration_bytes): "
          + "; ".join(f"world {w}: allgather {f['allgather'][w]:,} / histogram {f['histogram'][w]:,}" for w in f["allgather"]))


def run_world2(args) -> Optional[dict[str, Any]]:
    """The same benchmark as DP=2 on two gloo processes (torch.distributed.run); rank 0's result, None on failure."""
    with tempfile.TemporaryDirectory(prefix="bench_calib_") as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker-out", str(out), *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not out.exists():
            print(f"\nworld 2 run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
            return None
        return json.loads(out.read_text())


def main() -> None:
    """Parse flags; world 1 here, then world 2 under torch.distributed.run; print both."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/tiny_fp8_grpo.yaml", help="run config (model/optim/algo taken from it)")
    ap.add_argument("--recipe", default="blockwise", help="precision.recipe of the learner (none = no FP8 emulation)")
    ap.add_argument("--rows", type=int, default=64, help="sequences per train_step (global, split over DP)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50, help="vocabulary size (the tiny task's character tokenizer: 50)")
    ap.add_argument("--noise", type=float, default=0.1, help="std of old log-probs around the current ones")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--no-world2", action="store_true", help="skip the 2-process gloo run")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds allowed for the world-2 run")
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.worker_out:
        r = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.worker_out).write_text(json.dumps(r))
        return
    print(f"torch {torch.__version__}, 1 thread per process; medians of {args.reps} interleaved steps per variant")
    report(measure(args))
    if not args.no_world2:
        r2 = run_world2(args)
        if r2 is not None:
            report(r2)


if __name__ == "__main__":
    main()
