"""One-shot CUDA check of the learner on a bare GPU machine (torch and the carried wheels; no Transformer Engine):
a Learner step and a checkpoint save / resume with the distributed optimizer, and blockwise FP8 GEMM numerics of
torch's scaled matmul against the CPU emulation the learner uses.

Run:  python tests/gpu/learner_device_check.py               (one [PASS]/[FAIL]/[SKIP] line per check, JSON summary)
      python tests/gpu/learner_device_check.py --device cpu  (the same checks on CPU; the scaled matmul then reports
                                                              SKIP with torch's own refusal)

Checks:
- learner_step_distopt: a world-1 Learner (megatron's local spec on CUDA without TE, bf16 parameters, distributed
  optimizer, NCCL) takes two steps on CUDA: finite loss and grad norm, parameters on the device, the weights moved.
- checkpoint_resume_distopt: saved after step 1; step 2 taken (the reference); the checkpoint loaded back restores
  weights, Adam moments and fp32 main parameters and the LR schedule bit for bit, and step 2 repeated gives the
  reference's loss to 1e-6 relative, its grad norm to 1e-4 and its weights to 1% of the step's own change (bit for
  bit on CPU, reported as loss_bitwise; CUDA backward kernels may sum in another order, while a resume that lost any
  state changes the step by O(1)). A fresh learner with other initial weights resumes the same way.
- blockwise_gemm_fprop / blockwise_gemm_wgrad: torch._scaled_mm with DeepSeek-style block scales (1x128 activations x
  128x128 weights, Transformer Engine's fprop and dgrad; 1x128 x 1x128, its wgrad) on the FP8 data and scales of
  megatron_rl.precision.numerics.quantize_blockwise_te, against the emulation's dequantize-then-matmul (what the CPU
  learner computes): relative Frobenius error below 4e-3 (bf16 output rounding is ~2e-3; FP8 noise itself is ~3e-2,
  so a wrong block shape or scale layout fails). Negative control: the emulation with 128x128 activation blocks must
  differ from the GEMM by more than the tolerance, or the check could not tell recipes apart. torch supports these
  scales only where its scaled-mm dispatch has them (aten/src/ATen/native/cuda/ScaledBlas.cpp: is_blockwise_1x128_scaling,
  is_blockwise_128x128_scaling; SM90 and CUDA >= 12.9); elsewhere each is a SKIP with torch's error as the reason.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

RESULTS: list[dict] = []
DEVICE = "cuda"
VOCAB, B, S = 64, 4, 16
GEMM_TOL = 4e-3
RESUME_TOL = 1e-6
"""Repeated step 2 after the resume: its loss (a forward of restored weights) relative to the reference's."""
GRAD_NORM_TOL = 1e-4
"""Its grad norm, relative (CUDA attention backward kernels may accumulate in another order)."""
STEP_FRACTION = 1e-2
"""Its weights' distance from the reference's, as a fraction of what the step itself moved them (bf16 copies of fp32
main parameters a few ulps apart may round differently; a lost Adam moment or schedule changes the step by O(1))."""


def check(name: str, ok: bool, **detail) -> None:
    """Record and print one check."""
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {json.dumps(detail, default=str)}", flush=True)


def skip(name: str, reason: str) -> None:
    """Record and print a check that cannot run here, with why."""
    RESULTS.append({"check": name, "ok": True, "skipped": reason})
    print(f"[SKIP] {name} {reason}", flush=True)


def guarded(name: str, fn) -> None:
    """Run one section; an exception is a failed check, not an aborted script."""
    try:
        fn()
    except Exception as e:  # reported, then the next section runs
        traceback.print_exc()
        check(name, False, error=repr(e))


def _learner(seed: int):
    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.trainer.learner import Learner

    return Learner(ModelConfig(preset="tiny"), ParallelConfig(use_distributed_optimizer=True, logprob_chunk_size=8),
                   OptimConfig(lr=1e-2, lr_warmup_steps=1, lr_decay_style="cosine", min_lr=1e-3, clip_grad=1.0,
                               params_dtype="bf16"),
                   PrecisionConfig(), vocab_size=VOCAB, seed=seed, total_steps=10)


def _batch(seed: int):
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = (torch.arange(S)[None] >= 3).float().expand(B, S).contiguous()
    adv = torch.randn(B, 1, generator=g) * mask
    return TrainBatch(ids, torch.roll(ids, -1, 1), mask, adv, torch.zeros(B, S), token_weight=mask / mask.sum())


def _loss(lp, ent, mb, ctx):
    return (mb.token_weight * (-mb.advantages * lp - 0.01 * ent)).sum(), {}


def _weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in learner.gather_full_state_dict().items()}


def _adam(learner) -> list[torch.Tensor]:
    """Adam moments, step and fp32 main parameter of every optimizer parameter, flattened in optimizer order."""
    from megatron_rl.trainer import checkpoint as ckpt

    out = []
    for opt in ckpt._inner_optimizers(learner):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                st = opt.optimizer.state[p]
                # cloned: on CPU .float().cpu() returns the live tensor, which the next step updates in place
                out += [torch.as_tensor(st[k]).detach().float().cpu().flatten().clone() for k in sorted(st)]
                out.append(p.detach().float().cpu().flatten().clone())
    return out


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


def learner_and_checkpoint() -> None:
    """A Learner step and a save / load / repeated step with the distributed optimizer, on DEVICE."""
    from megatron_rl.parallel import state
    from megatron_rl.trainer import checkpoint as ckpt

    a = _learner(seed=3)
    on_device = {p.device.type for p in a.model[0].parameters()} == {DEVICE}
    w0 = _weights(a)
    m1 = a.train_step(_batch(0), _loss, 2)
    w1 = _weights(a)
    moved = _max_rel(w1, w0)
    finite = all(torch.isfinite(torch.tensor(m1[k])) for k in ("loss", "grad_norm"))
    check("learner_step_distopt", on_device and finite and moved > 1e-4 and m1["update_skipped"] == 0.0,
          on_device=on_device, loss=m1["loss"], grad_norm=m1["grad_norm"], weights_moved_rel=moved)

    with tempfile.TemporaryDirectory() as tmp:
        saved_adam, saved_sched = _adam(a), a.scheduler.state_dict()
        path = ckpt.save_checkpoint(a, tmp, step=1, rl_state={"step": 1})
        ref = a.train_step(_batch(1), _loss, 2)
        ref_w = _weights(a)
        step_change = _max_rel(ref_w, w1)
        ckpt.load_checkpoint(a, path)
        restored = (all(torch.equal(x, y) for x, y in zip(_weights(a).values(), w1.values()))
                    and all(torch.equal(x, y) for x, y in zip(_adam(a), saved_adam))
                    and a.scheduler.state_dict() == saved_sched and a.step_count == 1)
        again = a.train_step(_batch(1), _loss, 2)
        drift = _max_rel(_weights(a), ref_w)
        gn = abs(again["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-30)
        b = _learner(seed=99)
        ckpt.load_checkpoint(b, tmp)
        fresh_restored = all(torch.equal(x, y) for x, y in zip(_adam(b), saved_adam))
        fresh = b.train_step(_batch(1), _loss, 2)
        fresh_drift = _max_rel(_weights(b), ref_w)
        losses = [ref["loss"], again["loss"], fresh["loss"]]
        loss_rel = max(abs(x - ref["loss"]) for x in losses) / max(abs(ref["loss"]), 1e-30)
        ok = (restored and fresh_restored and loss_rel <= RESUME_TOL and gn <= GRAD_NORM_TOL
              and max(drift, fresh_drift) <= STEP_FRACTION * step_change)
        check("checkpoint_resume_distopt", ok, state_restored_bitwise=restored, fresh_learner_restored=fresh_restored,
              loss=losses, loss_bitwise=loss_rel == 0.0, grad_norm_rel_diff=gn, weights_rel_diff=[drift, fresh_drift],
              one_step_change_rel=step_change, tolerances=[RESUME_TOL, GRAD_NORM_TOL, STEP_FRACTION])
    state.destroy_distributed()


def _operands(m: int, k: int, n: int, seed: int):
    """Activations with rows of very different magnitudes (so block scales matter), weights, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, k).unsqueeze(0) * 0.05
    return x, w


def _scaled_mm(a_q, b_q, device: str) -> torch.Tensor:
    """torch._scaled_mm on a (M,K) x (N,K)^T pair of emulated FP8 tensors, scales laid out as torch's checks require."""
    a = a_q.data.to(device)
    b = b_q.data.to(device).t()  # (K, N), column-major: what _scaled_mm takes as its second operand
    # 1x128 scales: (rows, K/128) with stride (1, rows); 128x128 scales: (rows/128, K/128) row-major, given transposed
    # for the second operand (ScaledBlas.cpp checks b.t() with scale_b.t())
    def layout(q):
        s = q.scale_inv.to(device=device, dtype=torch.float32)
        return s.t().contiguous().t() if q.block == (1, 128) else s.contiguous()

    return torch._scaled_mm(a, b, scale_a=layout(a_q), scale_b=layout(b_q).t(), out_dtype=torch.bfloat16)


def blockwise_gemm(name: str, a_block: tuple[int, int], b_block: tuple[int, int], shape: tuple[int, int, int]) -> None:
    """One blockwise GEMM on DEVICE vs the emulation, and the negative control."""
    from megatron_rl.precision import numerics as nx

    m, k, n = shape
    x, w = _operands(m, k, n, seed=m + n)
    xq = nx.quantize_blockwise_te(x, a_block, "e4m3", power_of_two=False)
    wq = nx.quantize_blockwise_te(w, b_block, "e4m3", power_of_two=False)
    reference = (xq.dequantize().double() @ wq.dequantize().double().t())
    try:
        got = _scaled_mm(xq, wq, DEVICE).double().cpu()
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        skip(name, f"torch {torch.__version__} on {DEVICE} has no {a_block}x{b_block}-block scaled matmul: {reason}")
        return
    rel = ((got - reference).norm() / reference.norm()).item()
    wrong = nx.quantize_blockwise_te(x, (128, 128), "e4m3", power_of_two=False)
    control = ((got - wrong.dequantize().double() @ wq.dequantize().double().t()).norm() / reference.norm()).item()
    fp8_noise = ((reference - x.double() @ w.double().t()).norm() / reference.norm()).item()
    check(name, rel < GEMM_TOL < control, rel_diff=rel, tolerance=GEMM_TOL, wrong_activation_blocks_rel_diff=control,
          fp8_vs_full_precision=fp8_noise, shape=list(shape), blocks=[a_block, b_block])


def main(argv: list[str]) -> int:
    """Run every check; exit status 1 if any failed."""
    global DEVICE
    t0 = time.perf_counter()
    if argv[:2] == ["--device", "cpu"]:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("needs CUDA (or --device cpu)")
        return 1
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    cap = torch.cuda.get_device_capability() if DEVICE == "cuda" else None
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {where}, capability {cap}", flush=True)
    guarded("learner_and_checkpoint", learner_and_checkpoint)
    guarded("blockwise_gemm_fprop", lambda: blockwise_gemm("blockwise_gemm_fprop", (1, 128), (128, 128), (256, 512, 384)))
    guarded("blockwise_gemm_wgrad", lambda: blockwise_gemm("blockwise_gemm_wgrad", (1, 128), (1, 128), (256, 512, 384)))
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"passed": sum(r["ok"] and "skipped" not in r for r in RESULTS), "failed": failed,
                      "skipped": [r["check"] for r in RESULTS if "skipped" in r], "seconds": round(time.perf_counter() - t0, 1)}))
    return 1 if failed or not RESULTS else 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.exit(main(sys.argv[1:]))
