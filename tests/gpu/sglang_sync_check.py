"""One-shot check of the weight sync into a real SGLang server, as a run wires it, and of what the engine then serves:
its log-probs against the learner's own.

    python tests/gpu/sglang_sync_check.py [--sglang-python PATH]   # CUDA, SGLang in the Docker image (run_image.sh)
    python tests/gpu/sglang_sync_check.py --cpu     # the same code path on CPU: tests/fixtures/fake_sglang's
                                                    # `sglang.launch_server` (the embedded engine), gloo for NCCL

Cases (each builds the run's own objects: runtime.start_rollout, runtime.attach_weight_senders, phases/placement's
EngineMemory, phases/weights.sync_weights, so the transports send exactly what a run sends, FP8 blockwise weights
inside SGLang's weight-update sessions):
- tensor: one GPU, `rollout.placement=colocated` (SGLang's memory saver and CPU weight backup; CUDA-IPC handles).
- distributed: two GPUs, the engine on GPU 1 and the learner on GPU 0 in one NCCL group (needs the one NCCL of the
  image's one environment); a SKIP with the reason on one GPU.
Each case: a random Qwen3-shaped model (dimensions multiples of 128, as SGLang's FP8 kernels need) starts the engine;
the learner, loaded from it, is trained on a permutation task (next token = (5 x token + 3) mod 256) while a colocated
engine has released its memory; then
- <case>_before_sync: the engine still serves the initial weights, so its greedy log-probs differ from the trained
  learner's by a lot (mean |d logp| > 0.5; otherwise the comparison below could not fail);
- <case>_sync: after sync_weights the engine reports weight version 1, its greedy continuations follow the learnt
  permutation (>= 90% of tokens) and its log-probs of those tokens match the learner's teacher-forced ones: mean
  |d logp| <= 0.1 nats (the engine runs FP8 weights and activations, the learner BF16: FP8 noise only) and at most a
  tenth of the mismatch before the sync.
Prints one [PASS] / [FAIL] / [SKIP] line per check (tests/gpu/checks_lib.sh relays them); exit 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

RESULTS: list[dict] = []
VOCAB, PROMPT, NEW, ROWS = 256, 8, 16, 4
MODEL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, max_position_embeddings=512, initializer_range=0.05)
MATCH_TOL = 0.1
BEFORE_MIN = 0.5


def check(name: str, ok: bool, **detail) -> None:
    """Record and print one check."""
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {json.dumps(detail, default=str)}", flush=True)


def skip(name: str, reason: str) -> None:
    """Record and print a check that cannot run here, with why (never a PASS)."""
    RESULTS.append({"check": name, "ok": True, "skipped": reason})
    print(f"[SKIP] {name} {reason}", flush=True)


def task(first: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of the permutation task from their first tokens."""
    ids = [first.view(-1, 1)]
    for _ in range(length - 1):
        ids.append((5 * ids[-1] + 3) % VOCAB)
    return torch.cat(ids, 1)


def train(learner, steps: int) -> float:
    """`steps` next-token steps of the permutation task; the last loss."""
    from megatron_rl.types import TrainBatch

    loss = float("nan")
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = task(torch.randint(3, VOCAB, (16,), generator=g), 64)
        mask = torch.ones(16, 64)
        mask[:, -1] = 0.0
        batch = TrainBatch(ids, torch.roll(ids, -1, 1), mask, torch.zeros(16, 64), torch.zeros(16, 64),
                           token_weight=mask / mask.sum())
        loss = learner.train_step(batch, lambda lp, ent, mb, ctx: (-(mb.token_weight * lp).sum(), {}), 16)["loss"]
    return loss


def served_vs_learner(client, learner) -> dict:
    """Greedy continuations of ROWS task prompts from the engine, and their log-probs there and in the learner."""
    from megatron_rl.types import TrainBatch

    prompts = task(torch.tensor([11, 40, 97, 200]), PROMPT)
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    results = [client.generate_sync(p.tolist(), params)[0] for p in prompts]
    full = torch.tensor([p.tolist() + r.output_ids[:NEW] for p, r in zip(prompts, results)])
    mask = torch.zeros(ROWS, PROMPT + NEW)
    mask[:, PROMPT - 1:-1] = 1.0
    batch = TrainBatch(full, torch.roll(full, -1, 1), mask, torch.zeros_like(mask), torch.zeros_like(mask))
    lp, _ = learner.forward_logprobs(batch, ROWS)
    learner_lp = lp[:, PROMPT - 1:-1]
    served = torch.tensor([r.logprobs[:NEW] for r in results])
    diff = (served - learner_lp).abs()
    follows = (full[:, PROMPT:] == (5 * full[:, PROMPT - 1:-1] + 3) % VOCAB).float().mean().item()
    return {"mean_abs_dlogp": diff.mean().item(), "max_abs_dlogp": diff.max().item(), "tokens_follow_task": follows,
            "versions": sorted({r.weight_version for r in results})}


def run_case(name: str, args, work: Path) -> None:
    """One transport case end to end (see the module docstring)."""
    from megatron_rl.config import load_config
    from megatron_rl.engine.testing import make_tiny_model, make_tiny_tokenizer
    from megatron_rl.models.hf_arch import architecture_from_hf, read_hf_config
    from megatron_rl.parallel import state
    from megatron_rl.phases.placement import EngineMemory
    from megatron_rl.phases.weights import sync_weights
    from megatron_rl.runtime import attach_weight_senders, start_rollout
    from megatron_rl.tracking import Timers
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import load_initial_weights

    hf = work / f"hf_{name}"
    make_tiny_model(str(hf), seed=0, **MODEL)
    make_tiny_tokenizer(str(hf), vocab_size=VOCAB)
    colocated = name == "tensor"
    overrides = [f"run_dir={work / ('run_' + name)}", "rollout.engine=sglang", "rollout.num_engines=1",
                 f"rollout.sglang_python={args.sglang_python}", "rollout.startup_timeout_s=600",
                 "rollout.mem_fraction_static=0.3", "rollout.deterministic_inference=true",
                 f"rollout.placement={'colocated' if colocated else 'disaggregated'}",
                 f"rollout.weight_sync.transport={name}", "precision.recipe=none",
                 "precision.rollout_quantization=fp8-blockwise"]
    if args.cpu:
        overrides.append("rollout.engine_gpus=[0]")  # no CUDA view here: the fake engine takes the index as given
    elif not colocated:
        overrides.append("rollout.engine_gpus=[1]")  # the learner keeps GPU 0
    cfg = load_config(REPO / "examples" / "configs" / "tiny_base.yaml", overrides)
    arch = architecture_from_hf(read_hf_config(hf))
    state.init_distributed(cfg.parallel, 1)
    learner = Learner(cfg.model, cfg.parallel, cfg.optim.model_copy(update={"lr": 3e-3, "lr_decay_style": "constant"}),
                      cfg.precision, vocab_size=arch.vocab_size, seed=1, architecture=arch)
    load_initial_weights(learner, str(hf))
    cluster = None
    try:
        cluster, client, transport = start_rollout(cfg, str(hf), Path(cfg.run_dir))
        session = SimpleNamespace(cfg=cfg, learner=learner, transport=transport, hf_dir=str(hf), run_dir=Path(cfg.run_dir))
        attach_weight_senders(session)
        memory = EngineMemory(session.transport, cfg.rollout.placement, learner=learner)
        timers = Timers()
        memory.release(timers)  # colocated: the engine frees weights and KV cache while the learner trains
        loss = train(learner, 30)
        memory.resume(timers)
        before = served_vs_learner(client, learner)
        check(f"{name}_before_sync", before["mean_abs_dlogp"] > BEFORE_MIN, learner_loss=loss, minimum=BEFORE_MIN, **before)
        t0 = time.perf_counter()
        metrics = sync_weights(learner, session.transport, cfg.precision, 1)
        after = served_vs_learner(client, learner)
        ok = (after["versions"] == ["1"] and after["tokens_follow_task"] >= 0.9 and after["mean_abs_dlogp"] <= MATCH_TOL
              and after["mean_abs_dlogp"] <= 0.1 * before["mean_abs_dlogp"])
        check(f"{name}_sync", ok, sync_s=round(time.perf_counter() - t0, 2), sync_bytes=metrics.get("sync/bytes"),
              tolerance=MATCH_TOL, before_mean_abs_dlogp=before["mean_abs_dlogp"], **after)
    finally:
        if cluster is not None:
            cluster.stop()
        state.destroy_distributed()


def main() -> int:
    """Run both cases (or SKIP the one this machine cannot host); exit status 1 if a check failed."""
    p = argparse.ArgumentParser()
    p.add_argument("--sglang-python", default=sys.executable)
    p.add_argument("--cpu", action="store_true", help="fake SGLang (tests/fixtures/fake_sglang) on CPU")
    args = p.parse_args()
    if args.cpu:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "fixtures" / "fake_sglang"),
                                                    os.environ.get("PYTHONPATH", "")])
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu)")
        return 1
    work = Path(tempfile.mkdtemp(prefix="sglang_sync_"))
    for name in ("tensor", "distributed"):
        if name == "distributed" and not args.cpu and torch.cuda.device_count() < 2:
            skip(f"{name}_sync", f"the engine and the learner need a GPU each; {torch.cuda.device_count()} visible")
            continue
        try:
            run_case(name, args, work)
        except Exception as exc:  # reported, then the next case runs
            traceback.print_exc()
            check(f"{name}_sync", False, error=f"{type(exc).__name__}: {exc}"[:500])
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"failed": failed, "skipped": [r["check"] for r in RESULTS if "skipped" in r]}))
    return 1 if failed else 0


if __name__ == "__main__":
    torch.set_num_threads(4)
    sys.exit(main())
