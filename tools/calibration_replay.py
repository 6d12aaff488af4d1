"""Replay Calibrated Clipping bounds-update rules offline over recorded runs: which rule keeps the low-precision
clip fraction of negative-advantage tokens (clipfrac_lower_neg) at high precision's between shadow events, and why.

    # 1. record: a calibrated run with a shadow pass on every step and every off-policy row, saving every update's
    #    tokens (FP8 and high-precision log-ratios, advantages, update index) to RUN_DIR/replay/step_NNNNNN.npz
    python tools/calibration_replay.py record examples/configs/calibration_tracking_base.yaml run_dir=runs/replay/nvfp4_s1 \\
        precision.recipe=nvfp4 algo.calibration.enabled=true algo.calibration.strength=full \\
        algo.calibration.bounds_update=per_calibration algo.calibration.calibrate_every=1 algo.calibration.shadow_fraction=1 \\
        train.seed=1 rollout.seed=1 precision.fp4_seed=1 model.init_checkpoint=... data.train_file=...
    # 2. replay: every rule on the recorded tokens, against the run's own shadow and a high-precision run's metrics
    python tools/calibration_replay.py replay runs/replay/nvfp4_s1 runs/replay/nvfp4_s2 ... --hp runs/hp_s1 runs/hp_s2 ...

A rule decides the lower bound L of every update of step s from what it would have seen by then; the replay counts
the negative tokens of step s below it (all updates, the on-policy first one included, as clipfrac_lower_neg does)
and averages over steps >= --from-step. The bounds do not feed back into the recorded trajectory (an approximation:
the recorded run trained with its own bounds). Rules (docs/calibration.md):
per_calibration (hold the event's L, EMA), per_minibatch (re-solve each off-policy update on its own tokens at the
held pooled target), per_step variants (re-solve at the end of every step on its off-policy FP8 ratios at the held
target, for the next step) and per-update-index targets and bounds. Only the lower bound is replayed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

LOG_LO = math.log(0.8)  # log(1 - eps_low) at eps_low = 0.2 (the replay assumes it; record checks it)


def record(argv: list[str]) -> int:
    """`megatron-rl train` with every update's tokens saved to RUN_DIR/replay (the loop is patched, not changed)."""
    import megatron_rl.loop as loop
    import megatron_rl.phases.calibrate as calibrate
    import megatron_rl.phases.loss as loss
    from megatron_rl.algo.losses import log_ratio

    state: dict = {"update": 0, "records": []}
    run_train, before, call = loop.train_on_batch, calibrate.StepCalibration.before_update, loss.RLLoss.__call__

    def train_on_batch(session, batch, step, timers):
        if abs(session.cfg.algo.policy_loss.eps_low - 0.2) > 1e-12:
            raise SystemExit("error: the replay assumes algo.policy_loss.eps_low=0.2")
        state["records"] = []
        out = run_train(session, batch, step, timers)
        recs, d = state["records"], Path(session.run_dir) / "replay"
        d.mkdir(parents=True, exist_ok=True)
        np.savez(d / f"step_{step:06d}.npz", **{k: np.concatenate([r[k] for r in recs]) for k in recs[0]})
        return out

    def before_update(self, learner, mb, epoch, k):
        state["update"] = self.plan.update_index(epoch, k)
        return before(self, learner, mb, epoch, k)

    def __call__(self, logprobs, entropy, mb, ctx):
        clamp, valid = self.algo.policy_loss.log_ratio_clamp, mb.loss_mask > 0
        lr = log_ratio(logprobs.detach(), mb.old_logprobs, clamp)[valid]
        if mb.logprobs_hp is not None and mb.old_logprobs_hp is not None:
            lr_hp = log_ratio(mb.logprobs_hp, mb.old_logprobs_hp, clamp)[valid]
        else:  # the on-policy first update: pi_theta = pi_old, the high-precision log-ratio is 0
            lr_hp = lr * 0 if state["update"] == 0 else lr * math.nan
        n = int(valid.sum())
        state["records"].append({"lr": lr.double().cpu().numpy(), "lr_hp": lr_hp.double().cpu().numpy(),
                                 "adv": mb.advantages[valid].double().cpu().numpy(),
                                 "update": np.full(n, state["update"], np.int64)})
        return call(self, logprobs, entropy, mb, ctx)

    loop.train_on_batch = train_on_batch
    calibrate.StepCalibration.before_update = before_update
    loss.RLLoss.__call__ = __call__
    from megatron_rl.cli import main

    return main(["train", *argv])


def _steps(run: Path) -> list[dict]:
    files = sorted((run / "replay").glob("step_*.npz"))
    if not files:
        raise SystemExit(f"error: {run}/replay holds no step_*.npz (record the run first)")
    return [dict(np.load(f)) for f in files]


def _neg(d: dict, updates) -> np.ndarray:
    return (d["adv"] < 0) & np.isin(d["update"], list(updates))


def _hp_below(d: dict, m: np.ndarray) -> int:
    return int((np.nan_to_num(d["lr_hp"][m], nan=0.0) < LOG_LO).sum())


def order_statistic(x: np.ndarray, alpha: float) -> float:
    """log L of the same-tokens solve: the k-th smallest, k = floor(alpha n) + 1 (just above the largest when k > n)."""
    x = np.sort(x)
    k = int(math.floor(alpha * x.size + 1e-6)) + 1
    return float(x[k - 1]) if k <= x.size else float(x[-1]) + 1e-6


def type6(x: np.ndarray, alpha: float) -> float:
    """log L of the next-tokens solve: position alpha (n + 1), linear in between; -inf below the first position."""
    x = np.sort(x)
    h = alpha * (x.size + 1)
    if h < 1 - 1e-6:
        return -math.inf
    if h > x.size + 1e-6:
        return float(x[-1]) + 1e-6
    k = int(math.floor(h + 1e-6))
    t = h - k
    return float(x[k - 1]) if abs(t) <= 1e-6 else float(x[k - 1] + t * (x[k] - x[k - 1]))


def simulate(steps: list[dict], rule: str, *, every: int = 5, fraction: float = 1.0, relax: bool = True,
             smoothing: float = 0.5, seed: int = 0) -> np.ndarray:
    """Per-step clipfrac_lower_neg under `rule` (per_calibration | per_minibatch | per_step | per_step_held_on_policy
    | per_step_order_statistic | per_index); events every `every` steps from step 0, their targets from a seeded
    `fraction` of the negative off-policy tokens."""
    updates = sorted({int(u) for d in steps for u in np.unique(d["update"])})
    off = [u for u in updates if u > 0]
    rng = np.random.default_rng(seed)
    clamp = (lambda v: min(v, LOG_LO)) if relax else (lambda v: v)
    target, held, out = None, LOG_LO, []
    for s, d in enumerate(steps):
        lower = {u: LOG_LO for u in updates}
        if target is not None:
            if rule == "per_calibration":
                lower = {u: held for u in updates}
            elif rule == "per_minibatch":
                lower = {u: clamp(order_statistic(d["lr"][_neg(d, [u])], target["pool"])) if u else held for u in updates}
            elif rule in ("per_step", "per_step_held_on_policy", "per_step_order_statistic"):
                q = order_statistic if rule == "per_step_order_statistic" else type6
                L = clamp(q(steps[s - 1]["lr"][_neg(steps[s - 1], off)], target["pool"]))
                lower = {u: L for u in off}
                lower[0] = -math.inf if rule == "per_step" else L
            elif rule == "per_index":
                p = steps[s - 1]
                lower = {u: clamp(type6(p["lr"][_neg(p, [u])], target[u])) for u in off}
                lower[0] = -math.inf
        m = _neg(d, updates)
        bound = np.array([lower[int(u)] for u in d["update"][m]])
        out.append(float((d["lr"][m] < bound).sum() / max(m.sum(), 1)))
        if s % every == 0:  # an event: new targets (from a fraction of the tokens), the same-tokens solve for held L
            keep = rng.random(d["lr"].size) < fraction
            target = {u: _hp_below(d, _neg(d, [u]) & keep) / max((_neg(d, [u]) & keep).sum(), 1) for u in off}
            pooled = _neg(d, off) & keep
            target["pool"] = _hp_below(d, pooled) / max(pooled.sum(), 1)
            solved = clamp(order_statistic(d["lr"][_neg(d, off)], target["pool"]))
            held = solved if s == 0 else math.log(smoothing * math.exp(held) + (1 - smoothing) * math.exp(solved))
            if rule == "per_minibatch":
                held = solved
    return np.array(out)


RULES = {
    "vanilla (no calibration)": None,
    "per_calibration (paper: hold L, EMA 0.5)": dict(rule="per_calibration"),
    "per_minibatch (each update at the pooled target)": dict(rule="per_minibatch"),
    "per_step, same-tokens quantile, on-policy held": dict(rule="per_step_order_statistic"),
    "per_step, next-tokens quantile, on-policy held": dict(rule="per_step_held_on_policy"),
    "per_step, next-tokens quantile, on-policy open": dict(rule="per_step"),
    "  ... shadow_fraction 0.5 (the default)": dict(rule="per_step", fraction=0.5),
    "  ... relax_only off": dict(rule="per_step", relax=False),
    "  ... calibrate_every 10": dict(rule="per_step", every=10),
    "per-update-index targets and bounds": dict(rule="per_index"),
}


def replay(runs: list[Path], hp_runs: list[Path], from_step: int) -> None:
    """Print every rule's mean clipfrac_lower_neg (steps >= from_step) over `runs`, x their shadow and x the hp runs."""
    data = [_steps(r) for r in runs]
    hp = []
    for r in hp_runs:
        rows = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines() if x.strip()]
        hp.append(np.mean([x["clipfrac_lower_neg"] for x in rows if x["step"] >= from_step]))
    shadow = [np.mean([_hp_below(d, _neg(d, range(99))) / _neg(d, range(99)).sum() for d in ds[from_step:]]) for ds in data]
    print(f"{len(runs)} recorded runs, steps >= {from_step}; mean over runs of clipfrac_lower_neg, then x the runs' own "
          "shadow" + (f" and x the {len(hp)} high-precision runs" if hp else "") + " (per run in brackets)")

    def line(name, vals):
        rel = f"x shadow {np.mean(vals) / np.mean(shadow):.3f}"
        if hp:
            rel += f"  x hp {np.mean(vals) / np.mean(hp):.3f} {np.round(np.array(vals) / np.array(hp), 3).tolist()}"
        print(f"{name:>52}: {np.mean(vals):.4f}  {rel}")

    line("shadow (the runs' own high precision)", shadow)
    for name, kw in RULES.items():
        if kw is None:
            vals = [np.mean([(d["lr"][_neg(d, range(99))] < LOG_LO).mean() for d in ds[from_step:]]) for ds in data]
        else:
            vals = [simulate(ds, **kw)[from_step:].mean() for ds in data]
        line(name, vals)
    # off-policy depth: the high-precision fraction below 1 - eps_low per update index
    updates = sorted({int(u) for ds in data for d in ds for u in np.unique(d["update"])})
    depth = [np.mean([sum(_hp_below(d, _neg(d, [u])) for d in ds[from_step:]) /
                      max(sum(_neg(d, [u]).sum() for d in ds[from_step:]), 1) for ds in data]) for u in updates]
    low = [np.mean([sum(((d["lr"] < LOG_LO) & _neg(d, [u])).sum() for d in ds[from_step:]) /
                    max(sum(_neg(d, [u]).sum() for d in ds[from_step:]), 1) for ds in data]) for u in updates]
    print("per update index u: shadow fraction below 1 - eps_low", dict(zip(updates, np.round(depth, 4).tolist())),
          "| low precision", dict(zip(updates, np.round(low, 4).tolist())))


def main(argv: list[str]) -> int:
    """`record CONFIG overrides...` or `replay RUN... [--hp RUN...] [--from-step 5]`."""
    if argv and argv[0] == "record":
        return record(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["replay"])
    ap.add_argument("runs", nargs="+", type=Path, help="recorded run directories (RUN_DIR/replay/step_*.npz)")
    ap.add_argument("--hp", nargs="*", type=Path, default=[], help="high-precision run directories (metrics.jsonl), paired with runs")
    ap.add_argument("--from-step", type=int, default=5, help="first step averaged")
    args = ap.parse_args(argv)
    replay(args.runs, args.hp, args.from_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
