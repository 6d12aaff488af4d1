"""The quantizers before and after their speed-up, side by side in one run: old/new ratios per operation.

    PYTHONPATH=. python benchmarks/bench_quantizers.py [--tokens 512 --hidden 64 --ffn 256 --rows 16 --rounds 7]

"old" is the pre-speed-up code kept in tests/precision/quantizer_reference.py (the oracle of
tests/precision/test_quantizer_speedup.py, which checks both give the same bits); "new" is the
package. Sizes default to the deep miniature (tiny-deep: width 64, FFN 256; a learner micro-batch
of 8 x 64 tokens; the engine decoding 16 rows). Rows:
  - learner operands: the dequantized copy a fake-quant GEMM reads (FP8 per recipe, NVFP4/MXFP4 RNE and stochastic);
  - fake-quant linear forward+backward per recipe (the GEMMs included), old = a ModuleQuantizer on the old functions;
  - E2M1 rounding alone;
  - engine: the W8A8 activation fake-quant, and a W8A8 Qwen3 layer stack forward (old: every projection quantizes
    its input; new: q/k/v and gate/up share one);
  - learner train step of tiny-deep (tensorwise) with the CPU compat mode active in the transformer blocks (old)
    and lifted there (new), with how many torch calls reached the mode (skip with --no-step).
Each timing is the median over --rounds rounds of per-call thread CPU time, old and new interleaved
round by round; the box is shared, so compare the ratios, and report the load average printed at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.precision import blockwise as bw  # noqa: E402
from megatron_rl.precision import fp4  # noqa: E402
from megatron_rl.precision import numerics as nx  # noqa: E402
from megatron_rl.precision.fp4_linear import Fp4ModuleQuantizer  # noqa: E402
from megatron_rl.precision.linear import ModuleQuantizer, fake_quant_linear, make_quantizer  # noqa: E402
from tests.precision import quantizer_reference as ref  # noqa: E402


def timed(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float = 0.05) -> dict[str, float]:
    """Median per-call thread CPU microseconds of each callable, interleaved round by round."""
    calls = {}
    for k, f in fns.items():
        f()
        t0 = time.thread_time()
        f()
        calls[k] = max(1, int(budget_s / max(time.thread_time() - t0, 1e-6)))
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.thread_time_ns()
            for _ in range(calls[k]):
                f()
            samples[k].append((time.thread_time_ns() - t0) / calls[k] / 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def row(name: str, old: Callable[[], object], new: Callable[[], object], rounds: int) -> float:
    """Time old and new, print one line, return old/new."""
    t = timed({"old": old, "new": new}, rounds)
    ratio = t["old"] / t["new"]
    print(f"  {name:<46} old {t['old']:9.1f} us   new {t['new']:9.1f} us   old/new {ratio:5.2f}x", flush=True)
    return ratio


class OldModuleQuantizer(ModuleQuantizer):
    """The FP8 operand rules on the old quantizers (QuantizedTensor round trip with expanded scales)."""

    def _per_tensor(self, role, x, fmt, update, amax):
        """Old current / delayed scaling."""
        if self.recipe == "delayed":
            scaler = self.delayed[role]
            out = ref.dequantize(ref.delayed_quantize(scaler.scale, x, scaler.fmt))
            if update:
                scaler.update(float(ref.tensor_amax(ref._as_2d(x)) if amax is None else amax))
            return out
        return ref.dequantize(ref.quantize_current(x, fmt, amax=amax))

    def _blocks(self, x, block, fmt):
        """Old blockwise / MXFP8."""
        if self.recipe == "mxfp8":
            return ref.dequantize(ref.quantize_mxfp8(x, fmt, block))
        return ref.dequantize(ref.quantize_blockwise_te(x, block, fmt, power_of_two=self.power_of_two))


class OldFp4ModuleQuantizer(Fp4ModuleQuantizer):
    """The FP4 operand rules on the old quantizer and Hadamard transform (same streams of uniforms)."""

    def _quantize(self, x2d, block, stream):
        """Old fp4.fake_quantize."""
        uniforms = None
        if stream is not None:
            g = torch.Generator(device=x2d.device)
            from megatron_rl.precision.fp4_linear import _mix

            g.manual_seed(_mix(self.seed, self.salt, self.backward_calls, stream))
            uniforms = torch.rand(fp4.padded_shape(tuple(x2d.shape), block), generator=g, device=x2d.device)
        return ref.fp4_fake_quantize(x2d, self.recipe, block, uniforms)

    def operand_pair(self, role, x2d, fmt=None, update=True, amax=None, columnwise=True):
        """As Fp4ModuleQuantizer.operand_pair, with the old Hadamard transform."""
        n = self.block_len
        sr = role == "grad" and self.stochastic
        row_copy = self._quantize(x2d, (1, n), 0 if sr else None)
        col = None
        if columnwise:
            col = self._quantize(ref.hadamard_along_rows(x2d) if self.hadamard else x2d, (n, 1), 1 if sr else None)
        if role == "grad":
            self.backward_calls += 1
        return row_copy, col


def learner_operands(args) -> None:
    """Dequantized operand copies of an activation [tokens, hidden] and weights [ffn, hidden]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    w = torch.randn(args.ffn, args.hidden, generator=g) * 0.05
    dy = torch.randn(args.tokens, args.ffn, generator=g) * 1e-3
    print(f"learner operands (activation {tuple(x.shape)}, weight {tuple(w.shape)}, gradient {tuple(dy.shape)}):")
    r = args.rounds
    row("tensorwise activation e4m3", lambda: ref.dequantize(ref.quantize_current(x)), lambda: nx.fake_quantize_current(x), r)
    row("tensorwise gradient e5m2", lambda: ref.dequantize(ref.quantize_current(dy, "e5m2")),
        lambda: nx.fake_quantize_current(dy, "e5m2"), r)
    row("tensorwise weight", lambda: ref.dequantize(ref.quantize_current(w)), lambda: nx.fake_quantize_current(w), r)
    for block in ((1, 128), (128, 1), (128, 128)):
        row(f"blockwise {block[0]}x{block[1]} activation", lambda b=block: ref.dequantize(ref.quantize_blockwise_te(x, b)),
            lambda b=block: nx.fake_quantize_blockwise_te(x, b), r)
    row("mxfp8 1x32 activation", lambda: ref.dequantize(ref.quantize_mxfp8(x)), lambda: nx.fake_quantize_mxfp8(x), r)
    u = torch.rand(fp4.padded_shape(tuple(dy.shape), (1, 16)), generator=g)
    for name, t, block, uniforms in (("nvfp4 1x16 activation RNE", x, (1, 16), None), ("nvfp4 16x1 activation RNE", x, (16, 1), None),
                                     ("nvfp4 16x16 weight RNE", w, (16, 16), None), ("nvfp4 1x16 gradient stochastic", dy, (1, 16), u)):
        row(name, lambda t=t, b=block, u=uniforms: ref.fp4_fake_quantize(t, "nvfp4", b, u),
            lambda t=t, b=block, u=uniforms: fp4.fake_quantize(t, "nvfp4", b, u), r)
    row("mxfp4 1x32 activation RNE", lambda: ref.fp4_fake_quantize(x, "mxfp4", (1, 32)),
        lambda: fp4.fake_quantize(x, "mxfp4", (1, 32)), r)
    row("wgrad Hadamard (16-token chunks)", lambda: ref.hadamard_along_rows(x), lambda: fp4.hadamard_along_rows(x), r)
    v = x * 3.0
    uv = torch.rand(v.shape, generator=g)
    row("round_e2m1 nearest-even", lambda: ref.round_e2m1(v), lambda: fp4.round_e2m1(v), r)
    row("round_e2m1 stochastic", lambda: ref.round_e2m1(v, uv), lambda: fp4.round_e2m1(v, uv), r)

    print(f"fake-quant linear forward + backward ({tuple(x.shape)} @ {tuple(w.shape)}^T):")
    for recipe, extra in (("tensorwise", {}), ("delayed", {}), ("blockwise", {}), ("mxfp8", {}),
                          ("nvfp4", {"fp4_hadamard_wgrad": True, "fp4_stochastic_rounding": True})):
        cfg = PrecisionConfig(recipe=recipe, **extra)
        new_q = make_quantizer(cfg)
        old_q = OldFp4ModuleQuantizer(cfg) if cfg.fp4_enabled else OldModuleQuantizer(cfg)

        def step(q):
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            fake_quant_linear(xg, wg, None, q).backward(dy)

        row(f"{recipe}{' (RHT + SR)' if extra else ''}", lambda q=old_q: step(q), lambda q=new_q: step(q), r)


def engine(args) -> None:
    """The embedded engine's W8A8 activation fake-quant and a W8A8 Qwen3 layer stack (decode-sized batches)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_rl.precision import w8a8

    g = torch.Generator().manual_seed(1)
    print(f"engine (W8A8, {args.rows} rows):")
    for cols in (args.hidden, args.ffn):
        x = torch.randn(args.rows, cols, generator=g)
        row(f"activation fake-quant {args.rows}x{cols}", lambda x=x: ref.fake_quantize_activation_groups(x, 128),
            lambda x=x: bw.fake_quantize_activation_groups(x, 128), args.rounds)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, max_position_embeddings=128)
    model = Qwen3ForCausalLM(cfg).eval()
    w8a8.convert_to_w8a8(model, "fp8-blockwise")
    layers = [m for m in model.modules() if isinstance(m, w8a8.W8A8Linear)]
    shared = {id(m): m.shared_input for m in layers}
    h = torch.randn(args.rows, 1, args.hidden, generator=g)
    pos = torch.zeros(args.rows, 1, dtype=torch.long)
    emb = model.model.rotary_emb(h, pos)
    decoder_layers = model.model.layers

    def stack():
        with torch.inference_mode():
            y = h
            for layer in decoder_layers:
                y = layer(y, position_embeddings=emb, attention_mask=None)
                y = y[0] if isinstance(y, tuple) else y
            return y

    def old():
        for m in layers:
            m.shared_input = None
        real, w8a8.fake_quantize_activation_groups = w8a8.fake_quantize_activation_groups, ref.fake_quantize_activation_groups
        try:
            return stack()
        finally:
            w8a8.fake_quantize_activation_groups = real

    def new():
        for m in layers:
            m.shared_input = shared[id(m)]
        return stack()

    assert torch.equal(old(), new())
    row(f"8 W8A8 Qwen3 layers, one decode step", old, new, args.rounds)


def train_step(args) -> float:
    """tiny-deep train step (tensorwise FP8 emulation) with the compat mode active / lifted in the transformer blocks."""
    import warnings

    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.parallel import compat, state
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.trainer.model import unwrap
    from megatron_rl.types import TrainBatch

    warnings.filterwarnings("ignore", category=UserWarning)
    lrn = Learner(ModelConfig(preset="tiny-deep"), ParallelConfig(), OptimConfig(lr=1e-5, clip_grad=1.0),
                  PrecisionConfig(recipe="tensorwise"), vocab_size=64, seed=3)
    b, s = 4 * args.mbs, args.tokens // args.mbs
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (b, s), generator=gen), torch.randint(0, 64, (b, s), generator=gen)
    mask = torch.ones(b, s)
    batch = TrainBatch(ids, labels, mask, torch.randn(b, 1, generator=gen).expand(b, s).contiguous(), torch.zeros(b, s),
                       token_weight=mask / mask.sum())
    loss = lambda lp, ent, mb, ctx: (-(lp * mb.advantages * mb.token_weight).sum(), {})  # noqa: E731
    decoders = [unwrap(c).decoder for c in lrn.model]
    hooks = [(d, dict(d._forward_pre_hooks), dict(d._forward_hooks)) for d in decoders]

    def set_lift(on: bool) -> None:
        for d, pre, post in hooks:
            d._forward_pre_hooks.clear()
            d._forward_hooks.clear()
            if on:
                d._forward_pre_hooks.update(pre)
                d._forward_hooks.update(post)

    counted = [0]
    real = compat._CudaToCpuMode.__torch_function__

    def counting(self, func, types, a=(), kw=None):
        counted[0] += 1
        return real(self, func, types, a, kw)

    compat._CudaToCpuMode.__torch_function__ = counting
    calls = {}
    for lift in (False, True):
        set_lift(lift)
        counted[0] = 0
        lrn.train_step(batch, loss, args.mbs)
        calls[lift] = counted[0]
    compat._CudaToCpuMode.__torch_function__ = real
    print(f"learner train step (tiny-deep, tensorwise, {b} rows x {s} tokens, micro-batch {args.mbs}; lr 1e-5):")
    print(f"  torch calls through the compat mode per step: old {calls[False]}, new {calls[True]}")
    r = row("train_step", lambda: (set_lift(False), lrn.train_step(batch, loss, args.mbs)),
            lambda: (set_lift(True), lrn.train_step(batch, loss, args.mbs)), max(3, args.rounds // 2))
    set_lift(True)
    state.destroy_distributed()
    return r


def main() -> None:
    """Parse flags, run every section, print the load average."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="learner tokens per micro-batch (8 x 64 in the miniature)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16, help="engine rows per decoding step")
    ap.add_argument("--mbs", type=int, default=8, help="train-step micro-batch size (rows)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-step", action="store_true", help="skip the learner train step (it starts a world of one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    learner_operands(args)
    engine(args)
    if not args.no_step:
        train_step(args)
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
          f"({os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
