"""One-shot FP8 device check (one GPU, < 10 min): TE numerics vs the CPU emulation, TE recipes through a
megatron GPTModel (TE spec) compared with BF16 on the same weights (logits and gradients within a stated tolerance,
and a deliberately broken recipe outside it), high_precision() on GPU, and the FP8/BF16 step-time ratio.
The training-level comparison (an FP8 Learner trained on a learnable task against BF16) is te_training_check.py.

Run:  python tests/gpu/fp8_device_check.py   (prints one line per check and a JSON summary; exit 1 on failure)

This script is its own launcher, so it exports NVTE_FP8_BLOCK_SCALING_FP32_SCALES before TE is
imported (what `megatron_rl.precision.te.launcher_env` tells a real launcher to do); the quantizer
comparisons pass force_pow_2_scales explicitly and so cover both scale kinds.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

os.environ.setdefault("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.precision import numerics as nx  # noqa: E402
from megatron_rl.precision.linear import ModuleQuantizer, fake_quant_linear  # noqa: E402

RESULTS: list[dict] = []


def check(name: str, ok: bool, **detail) -> None:
    """Record and print one check."""
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {json.dumps(detail, default=str)}", flush=True)


def guarded(fn):
    """Run one section; an exception is a failed check, not an aborted script."""
    try:
        fn()
    except Exception as e:  # reported, then the next section runs
        traceback.print_exc()
        check(fn.__name__, False, error=repr(e))


def _tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[:, :5] = 0.0
    x[0, 7:10] = torch.tensor([448.0, -1000.0, 3e4])
    return x


def te_quantizer_numerics() -> None:
    """TE's Float8CurrentScaling / Float8Block / MXFP8 quantizers vs the CPU emulation, bit for bit."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import Float8BlockQuantizer, Float8CurrentScalingQuantizer

    dtypes = {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}
    for shape in ((256, 512), (200, 384)):
        x = _tensor(*shape, seed=shape[0])
        xc = x.cuda()
        for fmt in ("e4m3", "e5m2"):
            for pow2 in (False, True):
                q = Float8CurrentScalingQuantizer(dtypes[fmt], torch.device("cuda"), rowwise=True, columnwise=False,
                                                  force_pow_2_scales=pow2)
                got = q(xc).dequantize(dtype=torch.float32).cpu()
                want = nx.quantize_current(x, fmt, power_of_two=pow2).dequantize()
                check(f"current {fmt} pow2={pow2} {shape}", torch.equal(got, want), max_diff=(got - want).abs().max().item())
                for dim, block in ((1, (1, 128)), (2, (128, 128))):
                    q = Float8BlockQuantizer(dtypes[fmt], rowwise=True, columnwise=True, amax_epsilon=0.0,
                                             force_pow_2_scales=pow2, block_scaling_dim=dim)
                    t = q(xc)
                    got = t.dequantize(dtype=torch.float32).cpu()
                    want = nx.quantize_blockwise_te(x, block, fmt, power_of_two=pow2).dequantize()
                    check(f"block{dim}d rowwise {fmt} pow2={pow2} {shape}", torch.equal(got, want),
                          max_diff=(got - want).abs().max().item())
                    t.update_usage(rowwise_usage=False, columnwise_usage=True)
                    got = t.dequantize(dtype=torch.float32).cpu()
                    col_block = (128, 1) if dim == 1 else (128, 128)
                    want = nx.quantize_blockwise_te(x, col_block, fmt, power_of_two=pow2).dequantize()
                    check(f"block{dim}d columnwise {fmt} pow2={pow2} {shape}", torch.equal(got, want),
                          max_diff=(got - want).abs().max().item())
    if torch.cuda.get_device_capability() >= (10, 0):
        from transformer_engine.pytorch import MXFP8Quantizer

        x = _tensor(256, 512, seed=3)
        for fmt in ("e4m3", "e5m2"):
            t = MXFP8Quantizer(dtypes[fmt], rowwise=True, columnwise=False)(x.cuda())
            got = t.dequantize(dtype=torch.float32).cpu()
            want = nx.quantize_mxfp8(x, fmt).dequantize()
            check(f"mxfp8 {fmt}", torch.equal(got, want), max_diff=(got - want).abs().max().item())
    else:
        print("[SKIP] MXFP8 quantizer needs Blackwell (sm100+)", flush=True)


def te_linear_vs_emulation() -> None:
    """te.pytorch.Linear under autocast vs the fake-quant linear: forward, dgrad and wgrad."""
    import transformer_engine.pytorch as tep

    from megatron_rl.precision.te import check_te_environment, te_autocast, te_recipe

    g = torch.Generator().manual_seed(0)
    tokens, k, n = 256, 512, 384
    x = torch.randn(tokens, k, generator=g) * torch.logspace(-1, 1, k)
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(tokens, n, generator=g) * 1e-3
    for recipe in ("tensorwise", "blockwise"):
        for fmt in ("hybrid", "e4m3"):
            cfg = PrecisionConfig(recipe=recipe, fp8_format=fmt, power_of_two_scales=False)
            check_te_environment(cfg)
            lin = tep.Linear(k, n, bias=False, params_dtype=torch.float32, device="cuda")
            with torch.no_grad():
                lin.weight.copy_(w.cuda())
            xg = x.cuda().requires_grad_()
            with te_autocast(True, te_recipe(cfg)):
                out = lin(xg)
            out.backward(dy.cuda())
            xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
            oe = fake_quant_linear(xe, we, None, ModuleQuantizer(cfg))
            oe.backward(dy)
            for name, a, b in (("fprop", out, oe), ("dgrad", xg.grad, xe.grad), ("wgrad", lin.weight.grad, we.grad)):
                a = a.detach().float().cpu()
                rel = ((a - b).norm() / b.norm()).item()
                # Hopper FP8 GEMMs may accumulate with reduced precision (no split accumulator in
                # tensorwise fprop); 1e-3 is still ~20x below the FP8 noise, so a wrong block shape or
                # gradient format fails it
                check(f"te.Linear vs emulation {recipe} {fmt} {name}", rel < 1e-3, rel_diff=rel)


def _init_dist() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def _gpt(cfg: PrecisionConfig, layers: int = 4, hidden: int = 2048, vocab: int = 32768, seq: int = 2048):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.precision.te import transformer_config_kwargs

    tc = TransformerConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=16,
                           bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                           **transformer_config_kwargs(cfg))
    torch.manual_seed(0)
    model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(), vocab_size=vocab,
                     max_sequence_length=seq, pre_process=True, post_process=True).cuda()
    return model, tc


def _batch(batch: int = 4, seq: int = 2048, vocab: int = 32768):
    """Random token ids, positions and next-token labels on CUDA (a fixed generator: the same batch every call)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
    return ids, pos, torch.roll(ids, -1, 1)


def _step(model, tc, cfg, ids, pos, labels) -> torch.Tensor:
    from megatron_rl.precision import fp8_forward_context

    with fp8_forward_context(cfg, tc):
        loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach()


LOGITS_TOL = 0.25
"""FP8 logits vs BF16 logits on the same weights, relative Frobenius: FP8 (E4M3, 3 mantissa bits) moves each GEMM's
output by a few percent; four layers compound it to ~0.05-0.15; a wrong scale or block layout gives O(1)."""
GRADS_TOL = 0.5
"""The same for all parameter gradients together (E5M2 gradients under `hybrid` double the noise)."""
BROKEN = PrecisionConfig(recipe="delayed", margin=16)
"""A recipe TE accepts but that is numerically broken: scales 2^16 below amax put every FP8 value into E4M3's
subnormal range (448 / 2^16 < 2^-6), so most round to zero. The deviation test must fail it."""


def _deviation(model, tc, cfg, ids, pos, labels, ref=None):
    """(logits, grads) of one forward/backward on `model`; with `ref` = the BF16 model's, their relative deviations."""
    from megatron_rl.precision import fp8_forward_context

    model.zero_grad(set_to_none=True)
    with fp8_forward_context(cfg, tc):
        logits = model(ids, pos, None)
    with fp8_forward_context(cfg, tc):
        loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad and p.grad is not None]
    model.zero_grad(set_to_none=True)
    if ref is None:
        return logits.detach(), grads
    ref_logits, ref_grads = ref
    rel_logits = ((logits.float() - ref_logits.float()).norm() / ref_logits.float().norm()).item()
    num = sum(((g.float() - r.float()) ** 2).sum() for g, r in zip(grads, ref_grads))
    den = sum((r.float() ** 2).sum() for r in ref_grads)
    return rel_logits, (num / den).sqrt().item(), len(grads) == len(ref_grads)


def gpt_recipes_and_step_time() -> None:
    """Forward/backward of each TE recipe through megatron's TE spec; FP8 vs BF16 on the same weights; step times.

    Every model gets the BF16 model's weights, so the only difference is the recipe: its logits and gradients on a
    fixed batch must stay within LOGITS_TOL / GRADS_TOL of BF16's, and BROKEN, run the same way, must not (a test that
    a broken recipe passes could not fail usefully: at random init every recipe's loss is ~ln V).
    """
    _init_dist()
    ids, pos, labels = _batch()
    small = _batch(batch=2, seq=512)
    recipes = ["none", "delayed", "tensorwise", "blockwise"]
    if torch.cuda.get_device_capability() >= (10, 0):
        recipes.append("mxfp8")
    times, losses, deviations = {}, {}, {}
    ref_sd, ref = None, None
    for recipe in recipes + ["broken"]:
        cfg = BROKEN if recipe == "broken" else PrecisionConfig(recipe=recipe)
        model, tc = _gpt(cfg)
        if ref_sd is None:
            ref_sd = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        else:
            model.load_state_dict(ref_sd, strict=False)
        for _ in range(3):  # also fills the delayed recipes' amax history before anything is measured
            loss = _step(model, tc, cfg, ids, pos, labels)
            model.zero_grad(set_to_none=True)
        if recipe != "broken":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps = 10
            for i in range(steps):
                if i:
                    model.zero_grad(set_to_none=True)
                loss = _step(model, tc, cfg, ids, pos, labels)
            torch.cuda.synchronize()
            times[recipe] = (time.perf_counter() - t0) / steps
            losses[recipe] = loss.item()
            grads = [p.grad for p in model.parameters() if p.requires_grad]
            grads_ok = bool(grads) and all(g is not None and torch.isfinite(g).all().item() for g in grads)
            check(f"gpt {recipe} fwd/bwd", torch.isfinite(loss).item() and grads_ok, loss=losses[recipe],
                  step_s=round(times[recipe], 4))
        if recipe == "none":
            ref = _deviation(model, tc, cfg, *small)
        else:
            deviations[recipe] = _deviation(model, tc, cfg, *small, ref=ref)
        del model
        torch.cuda.empty_cache()
    for recipe, (rel_logits, rel_grads, same_params) in deviations.items():
        within = rel_logits <= LOGITS_TOL and rel_grads <= GRADS_TOL and same_params
        if recipe == "broken":
            check("gpt broken recipe fails the deviation test", not within, rel_logits=rel_logits, rel_grads=rel_grads,
                  tolerances=[LOGITS_TOL, GRADS_TOL], recipe="delayed, margin 16")
        else:
            check(f"gpt {recipe} logits/grads near bf16 on the same weights", within, rel_logits=rel_logits,
                  rel_grads=rel_grads, tolerances=[LOGITS_TOL, GRADS_TOL])
            print(f"FP8/BF16 step-time ratio [{recipe}]: {times[recipe] / times['none']:.3f} "
                  f"(fp8 {times[recipe] * 1e3:.1f} ms, bf16 {times['none'] * 1e3:.1f} ms)", flush=True)


def gpu_high_precision_context() -> None:
    """Inside high_precision(), fp8_forward_context turns TE FP8 off: output equals a BF16 model's."""
    from megatron_rl.precision import fp8_forward_context, high_precision

    _init_dist()
    ids, pos, _ = _batch(batch=2, seq=512)
    cfg = PrecisionConfig(recipe="blockwise")
    model, tc = _gpt(cfg, layers=2, hidden=1024, seq=512)
    ref, ref_tc = _gpt(PrecisionConfig(), layers=2, hidden=1024, seq=512)
    ref.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        with fp8_forward_context(cfg, tc):
            fp8 = model(ids, pos, None)
        with high_precision(), fp8_forward_context(cfg, tc):
            hp = model(ids, pos, None)
        bf16 = ref(ids, pos, None)
    hp_diff = (hp - bf16).float().abs().max().item()
    fp8_diff = (fp8 - bf16).float().abs().max().item()
    # bit-equal expected; allow kernel nondeterminism far below the FP8 effect
    check("high_precision equals bf16 model", hp_diff <= 0.01 * fp8_diff, hp_vs_bf16=hp_diff, fp8_vs_bf16=fp8_diff)
    check("fp8 forward differs from bf16", fp8_diff > 0, max_diff=fp8_diff)
    check("config.fp8 restored after shadow pass", tc.fp8 == cfg.fp8_format, fp8=tc.fp8)


def main() -> int:
    """Run all sections and print a summary; non-zero exit on any failure."""
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()} capability={torch.cuda.get_device_capability()} torch={torch.__version__}")
    t0 = time.perf_counter()
    for section in (te_quantizer_numerics, te_linear_vs_emulation, gpt_recipes_and_step_time, gpu_high_precision_context):
        guarded(section)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"passed": len(RESULTS) - len(failed), "failed": failed, "seconds": round(time.perf_counter() - t0, 1)}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
