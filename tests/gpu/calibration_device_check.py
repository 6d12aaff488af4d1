"""One-shot CUDA check of the RL loss path with Calibrated Clipping and of one tiny RL train step (one GPU, ~1 min).

Run:  python tests/gpu/calibration_device_check.py   (one PASS/FAIL line per check and a JSON summary; exit 1 on failure)
      python tests/gpu/calibration_device_check.py --device cpu   (the same checks on CPU: keeps the script honest in CI)

All prepared checks run together with `bash tests/gpu/run_all.sh` (which also installs the wheels below). What it
needs, and how to bring it to a GPU machine without network (the lent H200 has Python 3.12 and a CUDA
torch, but no pydantic, megatron-core or transformer-engine):
  here (with pip):       bash tests/gpu/fetch_wheels.sh          # cp312 wheels into .whl/ (git-excluded)
  there (carry ".whl"):  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                             --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; \
                         python3 tests/gpu/calibration_device_check.py
The loss checks need only pydantic (megatron_rl's configs); the train step needs megatron-core. Without
transformer-engine the Learner itself builds megatron's local layer spec on CUDA in high precision (its
device facts: trainer/spec.py uses_te_spec, as every GPU Learner without TE does; the TE / FP8 side is
tests/gpu/fp8_device_check.py's); the calibration machinery runs all the same.

Checks (each reported on its own; an exception fails that check only):
- loss_<backend>: RLLoss with a calibration tap over 3 CUDA micro-batches of an event step (shadow rows drawn at
  shadow_fraction 0.5), backward: the loss, every metric sum and the gradient stay on CUDA; the step's pooled
  statistics stay on CUDA; the solve from them equals the solve from CPU copies of the same tokens.
- train_<mode>_<backend>: megatron_rl.loop.train_on_batch on a tiny model on CUDA (NCCL world of 1) for a
  calibration step and an ordinary one, per_step, per_calibration and per_minibatch: finite loss, calibrated bounds that
  moved off 1 -/+ eps, the ratio dumps of the calibration steps written and matching their logged solves
  (exactly for allgather, within a bin for histogram).
- train_targeted: the default strength=targeted's phases on the device: rows ranked by the engine-vs-learner log-prob
  gap, the decision's high-precision pi_old forward on a quarter of the off-policy rows; the rows, the log-probs and
  the metric on the device, a targeted token share in (0, 0.5).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

RESULTS: list[dict] = []


def check(name: str, ok: bool, **detail) -> None:
    """Record and print one check."""
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {json.dumps(detail, default=str)}", flush=True)


def guarded(name: str, fn) -> None:
    """Run one section; an exception is a failed check, not an aborted script."""
    try:
        fn()
    except Exception as e:  # reported, then the next section runs
        traceback.print_exc()
        check(name, False, error=repr(e))


def _micro_batches(device: torch.device, n: int = 3, rows: int = 8, seq: int = 24):
    """n RL micro-batches of an 8-row shard (token weights, shadow fields, sample indices) on `device`."""
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        mask = (torch.arange(seq)[None] >= 6).float().expand(rows, seq).contiguous()
        old = -torch.rand(rows, seq, generator=g) * 2
        adv = torch.randn(rows, 1, generator=g).expand(rows, seq) * mask
        hp = old + 0.01 * torch.randn(rows, seq, generator=g)
        mb = TrainBatch(torch.zeros(rows, seq, dtype=torch.long), torch.zeros(rows, seq, dtype=torch.long), mask, adv,
                        old + 0.02 * torch.randn(rows, seq, generator=g), old_logprobs=old, old_logprobs_hp=hp,
                        logprobs_hp=hp + 0.2 * torch.randn(rows, seq, generator=g),
                        token_weight=mask / (n * mask.sum()), sample_index=torch.arange(i * rows, (i + 1) * rows))
        cur = old + 0.25 * torch.randn(rows, seq, generator=g)
        out.append((cur, mb))
    return [(cur.to(device), mb.with_fields(**{k: v.to(device) for k, v in mb.tensors().items()})) for cur, mb in out]


DEVICE = "cuda"


def loss_path(backend: str) -> None:
    """RLLoss + tap + solve on DEVICE vs the same on CPU."""
    from megatron_rl.algo.calibration_plan import CalibrationPlan
    from megatron_rl.algo.clipper import CalibratedClipper
    from megatron_rl.config.algo import AlgoConfig
    from megatron_rl.config.train import TrainConfig
    from megatron_rl.phases.loss import CalibrationTap, RLLoss

    # strength=full: an event step whose shadow statistics are solved (the default targeted gathers none)
    algo = AlgoConfig.model_validate({"calibration": {"enabled": True, "strength": "full", "backend": backend,
                                                      "calibrate_every": 1, "shadow_fraction": 0.5, "smoothing": 0.0}})
    plan = CalibrationPlan.build(0, algo.calibration, TrainConfig(num_minibatches=2), batch_size=24)
    results = {}
    for key, dev in (("dev", torch.device(DEVICE)), ("cpu", torch.device("cpu"))):
        clipper = CalibratedClipper(algo.calibration, eps_low=0.2, eps_high=0.2)
        stats = clipper.new_stats(reference=True, record=True)
        loss_fn = RLLoss(algo, clipper.bounds(), CalibrationTap(plan, stats, update=1))
        grads, losses = [], []
        for cur, mb in _micro_batches(dev):
            lp = cur.clone().requires_grad_(True)
            loss, _ = loss_fn(lp, torch.zeros_like(lp), mb, None)
            loss.backward()
            grads.append(lp.grad.device.type)
            losses.append(loss.device.type)
        sums_devices = {v.device.type for v in loss_fn.sums.values()}
        stat_devices = {p.device.type for p in stats.parts} | {stats.reference.device.type}
        sol = clipper.solve(stats)
        results[key] = dict(sol=sol, grads=set(grads), losses=set(losses), sums=sums_devices, stats=stat_devices,
                                 alpha=clipper.targets.alpha, rho=clipper.targets.rho, tokens=stats.num_tokens)
    g, c = results["dev"], results["cpu"]
    on_device = g["grads"] == g["losses"] == g["sums"] == g["stats"] == {DEVICE}
    same = (abs(g["sol"].lower - c["sol"].lower) <= 1e-6 * c["sol"].lower and abs(g["sol"].upper - c["sol"].upper) <= 1e-6 * c["sol"].upper
            and abs(g["alpha"] - c["alpha"]) <= 1e-12 and abs(g["rho"] - c["rho"]) <= 1e-6 * max(c["rho"], 1e-12))
    check(f"loss_{backend}", on_device and same and g["tokens"] == c["tokens"] > 0, devices={k: sorted(g[k]) for k in ("grads", "losses", "sums", "stats")},
          device=[g["sol"].lower, g["sol"].upper, g["alpha"], g["rho"]], cpu=[c["sol"].lower, c["sol"].upper, c["alpha"], c["rho"]],
          tokens=g["tokens"])


def train_steps() -> None:
    """loop.train_on_batch on CUDA for each bounds_update and backend: a calibration step and an ordinary one."""
    from calibration_spec import check_run_dumps
    from megatron_rl.config import load_config
    from megatron_rl.loop import train_on_batch
    from megatron_rl.parallel import state
    from megatron_rl.runtime import make_clipper
    from megatron_rl.tracking import Timers
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.types import TrainBatch

    base = ["precision.recipe=none", "precision.rollout_quantization=none", "train.micro_batch_size=8",
            "train.num_minibatches=2", "algo.calibration.enabled=true", "algo.calibration.calibrate_every=2",
            "algo.calibration.relax_only=false", "algo.calibration.smoothing=0.0", "tracking.dump_ratios=true",
            # the solve's mechanics: the solved bounds applied (strength=decision keeps the vanilla ones)
            "algo.calibration.strength=full"]
    cfg0 = load_config(ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml", base)
    state.init_distributed(cfg0.parallel, cfg0.train.seed)
    g = torch.Generator().manual_seed(0)
    rows, seq, vocab = 32, 24, 50
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = (torch.arange(seq)[None] >= 8).float().expand(rows, seq).contiguous()
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq) * mask
    batch = TrainBatch(ids, torch.roll(ids, -1, 1), mask, adv, torch.zeros(rows, seq), sample_index=torch.arange(rows))
    for mode in ("per_step", "per_calibration", "per_minibatch"):
        for backend in ("allgather", "histogram"):
            name = f"train_{mode}_{backend}"

            def one(mode=mode, backend=backend, name=name):
                cfg = load_config(ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml",
                                  [*base, f"algo.calibration.bounds_update={mode}", f"algo.calibration.backend={backend}"])
                learner = Learner(cfg.model, cfg.parallel, cfg.optim, cfg.precision, vocab_size=vocab, seed=cfg.train.seed,
                                  total_steps=cfg.train.optimizer_steps)
                on_device = next(learner.model[0].parameters()).device.type == DEVICE
                with tempfile.TemporaryDirectory() as run_dir:
                    session = SimpleNamespace(cfg=cfg, learner=learner, clipper=make_clipper(cfg), reference=None, kv_cache=None,
                                              run_dir=run_dir)
                    rows_out = []
                    for step in range(3):  # event, ordinary, event
                        m = train_on_batch(session, batch, step, Timers())
                        rows_out.append({"step": step, **{k: v for k, v in m.items() if isinstance(v, float)}})
                    width = session.clipper.hist_spec.width if backend == "histogram" else 0.0
                    quantile = "next_tokens" if mode == "per_step" else "same_tokens"
                    checked = check_run_dumps(run_dir, rows_out, ranks=1, eps_low=0.2, eps_high=0.2, relax_only=False,
                                              hist_width=width, quantile=quantile)
                finite = all(abs(r["learner/loss"]) < 1e6 for r in rows_out)
                moved = any(abs(r["calib/lower"] - 0.8) > 1e-4 or abs(r["calib/upper"] - 1.2) > 1e-4 for r in rows_out[1:])
                solves = [0, 1, 2] if mode == "per_step" else [0, 2]
                check(name, on_device and finite and moved and checked == solves, on_device=on_device, finite=finite, moved=moved,
                      dumps_checked=checked, bounds=[(r["calib/lower"], r["calib/upper"]) for r in rows_out])

            guarded(name, one)

    def targeted():
        """The default rule's phases on the device (gate open, as an FP8 learner's step opens it): the
        engine-vs-learner gap ranks the rows, the decision's high-precision forwards run on them and the clip decision
        uses their high-precision ratios; everything stays on the device."""
        from megatron_rl.phases import batching, error_scale

        cfg = load_config(ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml",
                          [*base[:2], "train.micro_batch_size=8", "train.num_minibatches=2", "algo.calibration.enabled=true",
                           "algo.calibration.strength=targeted", "algo.calibration.targeted_fraction=0.25"])
        learner = Learner(cfg.model, cfg.parallel, cfg.optim, cfg.precision, vocab_size=vocab, seed=cfg.train.seed,
                          total_steps=cfg.train.optimizer_steps)
        dev = next(learner.model[0].parameters()).device
        from megatron_rl.phases.logprobs import _global_forward

        old, _ = _global_forward(learner, batch, 8)
        g_engine = torch.Generator().manual_seed(1)
        engine = old + (0.1 * torch.rand(old.shape, generator=g_engine)).to(old.device) * mask.to(old.device)
        step_batch = batch.with_fields(old_logprobs=old, rollout_logprobs=engine)
        skip = batching.on_policy_only_rows(rows, 2, 1, cfg.train.seed, 0)
        step_batch = error_scale.with_targeted_rows(step_batch, make_clipper(cfg), True, skip)
        share = error_scale.targeted_metrics(step_batch, skip)["calib/targeted_token_share"]
        step_batch = error_scale.with_old_logprobs_hp(learner, step_batch, 8, cfg.algo, gate_open=True,
                                                      on_policy_only_rows=skip)
        devices = {t.device.type for t in (step_batch.hp_decision_rows, step_batch.old_logprobs_hp)}
        check("train_targeted", devices == {dev.type} == {DEVICE} and 0 < share < 0.5, devices=sorted(devices),
              targeted_token_share=share, rows=int(step_batch.hp_decision_rows.sum()))

    guarded("train_targeted", targeted)


def main(argv: list[str]) -> int:
    """Run every check; exit status 1 if any failed."""
    global DEVICE
    t0 = time.perf_counter()
    if argv[:2] == ["--device", "cpu"]:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("needs CUDA (or --device cpu)")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}", flush=True)
    for backend in ("allgather", "histogram"):
        guarded(f"loss_{backend}", lambda backend=backend: loss_path(backend))
    guarded("train", train_steps)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"passed": len(RESULTS) - len(failed), "failed": failed, "seconds": round(time.perf_counter() - t0, 1)}))
    return 1 if failed or not RESULTS else 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.exit(main(sys.argv[1:]))
