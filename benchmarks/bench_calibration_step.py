"""What Calibrated Clipping costs per RL step: off vs targeted (the default) vs decision vs the bound-moving rules, side by side.

    python benchmarks/bench_calibration_step.py [--rows 64] [--seq 32] [--micro-batch-size 16]
        [--minibatches 2] [--reps 5] [--recipe blockwise] [--no-world2] [--config examples/configs/tiny_fp8_grpo.yaml]

Runs the loop's real training phase, `megatron_rl.loop.train_on_batch` (old log-probs, the shadow
forwards the CalibrationPlan names, every mini-batch update, the step's solve), on the tiny model of
examples/configs (default tiny_fp8_grpo.yaml: blockwise FP8 emulation, TIS on) and one synthetic step
batch (random tokens and per-sequence advantages, rollout log-probs = the policy's own +- noise), for:

    off                 calibration disabled (plain PPO clip at 1 -/+ eps): vanilla low precision
    decision            strength=decision: every clip decided on its high-precision ratio, so every
                        step forwards pi_old in high precision on the rows an off-policy update trains and the
                        current policy before every off-policy update; calibration events only measure
    targeted            strength=targeted (the default): the decision's forwards for the targeted_fraction (0.1) of
                        off-policy rows whose rollout and FP8 pi_old log-probs disagree most, summed over the row
    per_step            strength=full (the paper's bounds) with bounds_update=per_step: shadow forwards on
                        calibration steps (shadow_fraction 0.5), and on every step one pooled solve over the FP8
                        ratios the training forwards computed (no extra forward)
    per_step@1          the same with every off-policy row in the shadow (shadow_fraction 1)
    per_calibration     the paper: shadow forwards (shadow_fraction 1) + one pooled solve on calibration steps only
    per_calibration@f   the same with algo.calibration.shadow_fraction = f (--fraction, default 0.25)
    per_minibatch       plus a no-grad FP8 pre-pass and a solve before every off-policy mini-batch

Each variant runs a calibration step (step 0) and an ordinary step (step 1), variants interleaved
round by round (rotated order) so machine load hits them alike; every variant has its own learner
built from the same seed (the same initial weights). It prints medians per variant of the process's
CPU time (on a shared machine wall time mostly measures the other jobs; the wall-time ratio is printed
too) for a calibration step and an ordinary step, their ratio to `off`, and the cost per step amortised
over calibrate_every (calibration step + (calibrate_every - 1) ordinary steps), plus the bytes one rank
receives per step for the ratio statistics (counted on the collectives that ran). Step-to-step noise on a
loaded box is several percent, more than the per-step work of per_step, so it also prints the CPU time
spent inside the calibration code paths themselves (CalibrationClock: shadow forwards, the high-precision clip
decision's forwards, pre-passes, the loss's statistics tap, solves) as a share of off's step. World 1 runs in this process; unless
--no-world2 the same global batch then runs as DP=2 on two gloo processes (torch.distributed.run),
where the statistics really travel. One CPU thread per process.
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


class CollectiveCounter:
    """Stand-in for `torch.distributed` inside parallel/collectives.py that counts the bytes a rank receives (ring algorithms)."""

    def __init__(self, dist_module: Any) -> None:
        """Forward everything to `dist_module`; count every call."""
        self._dist = dist_module
        self.received = 0

    def __getattr__(self, name: str) -> Any:
        """Everything not overridden goes to torch.distributed."""
        return getattr(self._dist, name)

    def all_gather(self, outputs, tensor, group=None, **kw):
        """Count (world - 1) copies of the payload, then gather."""
        self.received += (len(outputs) - 1) * tensor.numel() * tensor.element_size()
        return self._dist.all_gather(outputs, tensor, group=group, **kw)

    def all_reduce(self, tensor, op=None, group=None, **kw):
        """Count 2 (w - 1) / w of the buffer, then reduce."""
        w = self._dist.get_world_size(group)
        self.received += int(2 * (w - 1) * tensor.numel() * tensor.element_size() // w)
        kw = dict(kw, group=group)
        if op is not None:
            kw["op"] = op
        return self._dist.all_reduce(tensor, **kw)


class CalibrationClock:
    """Process CPU time spent inside the calibration code paths (shadow forwards, pre-passes, statistics, solves):
    the extra work itself, measured where it runs, so it does not drown in the step-to-step noise of a loaded box."""

    def __init__(self) -> None:
        """Start at zero."""
        self.total = 0.0
        self._depth = 0

    def wrap(self, fn):
        """`fn` with its CPU time added to `total` (outermost call only: the wrapped paths call each other)."""
        clock = self

        def timed(*args, **kwargs):
            if clock._depth:
                return fn(*args, **kwargs)
            clock._depth += 1
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.total += time.process_time() - c0
                clock._depth -= 1
        return timed

    def install(self) -> None:
        """Wrap the calibration code paths of one step: the shadow pi_old forward, the high-precision clip decision's
        forwards (pi_old and every off-policy update's policy), StepCalibration's per-update work (shadow pi_theta
        forwards, per_minibatch pre-pass and solve) and end-of-step solve, the loss's statistics tap. Each is looked
        up by name, so a rename fails here instead of timing nothing."""
        from megatron_rl.phases import calibrate, error_scale, logprobs, loss

        logprobs.shadow_old_logprobs = self.wrap(logprobs.shadow_old_logprobs)
        error_scale.with_old_logprobs_hp = self.wrap(error_scale.with_old_logprobs_hp)
        error_scale.with_logprobs_hp = self.wrap(error_scale.with_logprobs_hp)
        calibrate.StepCalibration.before_update = self.wrap(calibrate.StepCalibration.before_update)
        calibrate.StepCalibration.finish = self.wrap(calibrate.StepCalibration.finish)
        loss.RLLoss._collect = self.wrap(loss.RLLoss._collect)


def variants(fraction: float) -> dict[str, list[str]]:
    """Config overrides of each variant (on top of --config's calibration settings, e.g. calibrate_every)."""
    on = "algo.calibration.enabled=true"
    full = [on, "algo.calibration.strength=full"]
    paper = [*full, "algo.calibration.shadow_fraction=1.0"]
    return {
        "off": ["algo.calibration.enabled=false"],
        "decision": [on, "algo.calibration.strength=decision"],
        "targeted": [on, "algo.calibration.strength=targeted"],
        "per_step": [*full, "algo.calibration.bounds_update=per_step"],
        "per_step@1": [*full, "algo.calibration.bounds_update=per_step", "algo.calibration.shadow_fraction=1.0"],
        "per_calibration": [*paper, "algo.calibration.bounds_update=per_calibration"],
        f"per_calibration@{fraction:g}": [*paper, "algo.calibration.bounds_update=per_calibration",
                                          f"algo.calibration.shadow_fraction={fraction}"],
        "per_minibatch": [*paper, "algo.calibration.bounds_update=per_minibatch"],
    }


def load_cfg(args, extra: list[str]):
    """The run config of --config with the benchmark's overrides."""
    from megatron_rl.config import load_config

    overrides = [f"precision.recipe={args.recipe}", f"train.micro_batch_size={args.micro_batch_size}",
                 f"train.num_minibatches={args.minibatches}", "train.ppo_epochs=1", *extra]
    path = ROOT / args.config if not Path(args.config).is_absolute() else Path(args.config)
    return load_config(path, overrides)


def synthetic_batch(rows: int, seq: int, vocab: int, seed: int = 0):
    """One global step batch: random tokens, per-sequence advantages, a response span per row."""
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    prompt = torch.randint(seq // 4, seq // 2, (rows, 1), generator=g)
    length = torch.randint(3 * seq // 4, seq + 1, (rows, 1), generator=g)
    pos = torch.arange(seq)[None]
    mask = ((pos >= prompt) & (pos < length)).float()
    adv = (torch.randn(rows, 1, generator=g) * mask).contiguous()
    return TrainBatch(ids, labels, mask, adv, torch.zeros(rows, seq), sample_index=torch.arange(rows))


def measure(args) -> dict[str, Any]:
    """Time every variant's calibration and ordinary step on this process's share; returns medians (same on every rank)."""
    import torch.distributed as dist

    from megatron_rl.config.model import ParallelConfig
    from megatron_rl.loop import train_on_batch
    from megatron_rl.parallel import collectives, state
    from megatron_rl.runtime import RunSession, make_clipper
    from megatron_rl.tracking import Timers
    from megatron_rl.trainer.learner import Learner

    names = variants(args.fraction)
    cfgs = {v: load_cfg(args, o) for v, o in names.items()}
    base = cfgs["off"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pcfg = ParallelConfig(logprob_chunk_size=base.parallel.logprob_chunk_size)
    state.init_distributed(pcfg, base.train.seed)
    unit = world * args.minibatches * args.micro_batch_size
    if args.rows % unit != 0:
        raise SystemExit(f"--rows {args.rows} must be a multiple of world {world} x --minibatches x --micro-batch-size = {unit}")
    learner = Learner(base.model, pcfg, base.optim, base.precision, vocab_size=args.vocab, seed=base.train.seed,
                      total_steps=base.train.optimizer_steps)
    batch = synthetic_batch(args.rows, args.seq, learner.arch.vocab_size)
    from megatron_rl.phases.logprobs import _global_forward

    lp, _ = _global_forward(learner, batch, args.micro_batch_size)
    g = torch.Generator().manual_seed(1)
    batch = batch.with_fields(rollout_logprobs=(lp + 0.05 * torch.randn(lp.shape, generator=g)) * batch.loss_mask)
    # one learner per variant, all built from the same seed: the same weights and optimizer state
    sessions = {}
    for v, cfg in cfgs.items():
        lr = learner if v == "off" else Learner(cfg.model, pcfg, cfg.optim, cfg.precision, vocab_size=args.vocab,
                                                seed=cfg.train.seed, total_steps=cfg.train.optimizer_steps)
        # the loop's own session type: a field the training phase starts reading has its default here, not an
        # AttributeError (no engines, prompts or tokenizer: nothing outside the training phase runs)
        sessions[v] = RunSession(cfg=cfg, run_dir=Path(tempfile.gettempdir()), tokenizer=None, train_rows=[], eval_rows=[],
                                 reward_fn=None, learner=lr, clipper=make_clipper(cfg), hf_dir="")
    counter = CollectiveCounter(collectives.dist)
    collectives.dist = counter
    clock = CalibrationClock()
    clock.install()
    # process CPU time is the primary measure: on a shared, loaded machine wall time mostly measures the neighbours
    times: dict[str, dict[str, list[float]]] = {v: {"event": [], "plain": [], "event_wall": [], "plain_wall": [],
                                                    "event_calib": [], "plain_calib": []} for v in names}
    bytes_per_step: dict[str, dict[str, int]] = {v: {} for v in names}
    order = list(names)
    for rep in range(args.reps + 1):  # round 0 warms up
        rotated = order[rep % len(order):] + order[:rep % len(order)]
        for v in rotated:
            for kind, step in (("event", 0), ("plain", 1)):
                dist.barrier()
                counter.received = 0
                clock.total = 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                train_on_batch(sessions[v], batch, step, Timers())
                if rep:
                    times[v][kind].append(time.process_time() - c0)
                    times[v][f"{kind}_calib"].append(clock.total)
                    times[v][f"{kind}_wall"].append(time.perf_counter() - t0)
                    bytes_per_step[v][kind] = counter.received
    collectives.dist = counter._dist
    every = base.algo.calibration.calibrate_every
    out = {"world": world, "rows": args.rows, "seq": args.seq, "micro_batch_size": args.micro_batch_size,
           "minibatches": args.minibatches, "recipe": base.precision.recipe, "calibrate_every": every,
           "tokens": float(batch.loss_mask.sum()), "step_s": {}, "bytes": bytes_per_step}
    for v in names:
        ev, pl = statistics.median(times[v]["event"]), statistics.median(times[v]["plain"])
        evw, plw = statistics.median(times[v]["event_wall"]), statistics.median(times[v]["plain_wall"])
        evc, plc = statistics.median(times[v]["event_calib"]), statistics.median(times[v]["plain_calib"])
        out["step_s"][v] = {"event": ev, "plain": pl, "amortised": (ev + (every - 1) * pl) / every,
                            "amortised_wall": (evw + (every - 1) * plw) / every, "event_calib": evc, "plain_calib": plc}
    out["every_list"] = list(args.every)
    state.destroy_distributed()
    return out


def report(r: dict[str, Any]) -> None:
    """Print one world size's table."""
    s = r["step_s"]
    off = s["off"]
    print(f"\nworld {r['world']} (DP={r['world']}): {r['rows']} rows x {r['seq']} tokens (~{r['tokens']:.0f} loss tokens), "
          f"{r['minibatches']} mini-batches ({r['minibatches'] - 1} off-policy), micro-batch {r['micro_batch_size']}, "
          f"recipe {r['recipe']}, calibrate_every {r['calibrate_every']}")
    print("CPU ms of this process per step (medians); wall x off for comparison; bytes one rank receives per step")
    print(f"{'variant':>20} {'calib step':>11} {'x off':>7} {'other step':>11} {'x off':>7}"
          f" {'amortised':>10} {'x off':>7} {'extra %':>8} {'wall x off':>11} {'B/rank calib':>13} {'B/rank other':>13}")
    for v, t in s.items():
        extra = 100 * (t["amortised"] - off["amortised"]) / off["amortised"]
        b = r["bytes"][v]
        print(f"{v:>20} {t['event'] * 1e3:>11.1f} {t['event'] / off['event']:>7.3f} {t['plain'] * 1e3:>11.1f}"
              f" {t['plain'] / off['plain']:>7.3f} {t['amortised'] * 1e3:>10.1f} {t['amortised'] / off['amortised']:>7.3f}"
              f" {extra:>8.1f} {t['amortised_wall'] / off['amortised_wall']:>11.3f} {b.get('event', 0):>13,} {b.get('plain', 0):>13,}")
    print("CPU ms inside the calibration code paths (shadow forwards, pre-passes, statistics, solves; medians), "
          "and as % of off's step:")
    for v, t in s.items():
        if v == "off":
            continue
        parts = [f"calib step {t['event_calib'] * 1e3:6.1f} ms ({100 * t['event_calib'] / off['event']:5.1f}%)",
                 f"other step {t['plain_calib'] * 1e3:6.1f} ms ({100 * t['plain_calib'] / off['plain']:5.2f}%)"]
        for e in r.get("every_list") or [r["calibrate_every"]]:
            amort = (t["event_calib"] + (e - 1) * t["plain_calib"]) / e
            parts.append(f"every {e}: {100 * amort / off['amortised']:.2f}%")
        print(f"{v:>20}  " + "  ".join(parts))
    every = r.get("every_list") or []
    if every:
        print("extra CPU % per step over off, amortised over other calibrate_every values:")
        for v, t in s.items():
            if v == "off":
                continue
            cells = []
            for e in every:
                amort = (t["event"] + (e - 1) * t["plain"]) / e
                base = (off["event"] + (e - 1) * off["plain"]) / e
                cells.append(f"every {e}: {100 * (amort - base) / base:+.1f}%")
            print(f"{v:>20}  " + "  ".join(cells))


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
    ap.add_argument("--rows", type=int, default=64, help="sequences per RL step (global, split over DP)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch and DP rank")
    ap.add_argument("--minibatches", type=int, default=2, help="train.num_minibatches (all but the first are off-policy)")
    ap.add_argument("--fraction", type=float, default=0.25, help="shadow_fraction of the per_calibration@f variant")
    ap.add_argument("--vocab", type=int, default=50, help="vocabulary size (the tiny task's character tokenizer: 50)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (each runs every variant's two steps)")
    ap.add_argument("--every", type=int, nargs="*", default=[5, 10, 20],
                    help="also print the cost amortised over these calibrate_every values")
    ap.add_argument("--no-world2", action="store_true", help="skip the 2-process gloo run")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds allowed for the world-2 run")
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.worker_out:
        r = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.worker_out).write_text(json.dumps(r))
        return
    print(f"torch {torch.__version__}, 1 thread per process; medians of {args.reps} interleaved rounds per variant")
    report(measure(args))
    if not args.no_world2:
        r2 = run_world2(args)
        if r2 is not None:
            report(r2)


if __name__ == "__main__":
    main()
