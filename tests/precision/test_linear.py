"""The fake-quant FP8 linear: forward/backward equal hand-computed references, high_precision() is exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import high_precision, high_precision_active, layer_uses_fp8, linear_classes_for_layer
from megatron_rl.precision.linear import FakeQuantLinear, ModuleQuantizer, fake_quant_linear

from .fp8_reference import F32, mxfp8_quantize, ref_cast, te_quantize

TOKENS, K, N = 6, 160, 136  # ragged against 128 and 32 blocks


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, K, generator=g) * torch.logspace(-2, 1, K)
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(2, 3, N, generator=g) * 1e-3
    return x, w, dy


def _deq(x2d: np.ndarray, recipe: str, role: str, fmt: str, pow2: bool) -> np.ndarray:
    """Reference dequantized operand for one GEMM role (independent of the project's code)."""
    if recipe == "tensorwise":
        return te_quantize(x2d, x2d.shape, fmt, False)[2]
    blocks = {
        "blockwise": {"x_row": (1, 128), "x_col": (128, 1), "w_fprop": (128, 128), "w_dgrad": (128, 128)},
        "mxfp8": {"x_row": (1, 32), "x_col": (32, 1), "w_fprop": (1, 32), "w_dgrad": (32, 1)},
    }[recipe][role]
    if recipe == "mxfp8":
        return mxfp8_quantize(x2d, blocks, fmt)[2]
    return te_quantize(x2d, blocks, fmt, pow2)[2]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("bias", [False, True])
def test_fake_quant_linear_matches_hand_reference(recipe, fp8_format, bias):
    pow2 = recipe == "blockwise" and fp8_format == "e4m3"  # exercise both block-scale kinds
    cfg = PrecisionConfig(recipe=recipe, fp8_format=fp8_format, power_of_two_scales=pow2)
    x, w, dy = _inputs()
    b = torch.randn(N) if bias else None
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    bg = b.clone().requires_grad_() if bias else None
    out = fake_quant_linear(xg, wg, bg, ModuleQuantizer(cfg))
    out.backward(dy)

    gfmt = "e5m2" if fp8_format == "hybrid" else "e4m3"
    x2, dy2, wn = x.reshape(TOKENS, K).numpy(), dy.reshape(TOKENS, N).numpy(), w.numpy()
    t = torch.from_numpy
    want = t(_deq(x2, recipe, "x_row", "e4m3", pow2)) @ t(_deq(wn, recipe, "w_fprop", "e4m3", pow2)).t()
    if bias:
        want = want + b
    assert torch.equal(out.reshape(TOKENS, N), want)
    dgrad = t(_deq(dy2, recipe, "x_row", gfmt, pow2)) @ t(_deq(wn, recipe, "w_dgrad", "e4m3", pow2))
    wgrad = t(_deq(dy2, recipe, "x_col", gfmt, pow2)).t() @ t(_deq(x2, recipe, "x_col", "e4m3", pow2))
    assert torch.equal(xg.grad.reshape(TOKENS, K), dgrad)
    assert torch.equal(wg.grad, wgrad)
    if bias:
        assert torch.equal(bg.grad, dy.reshape(TOKENS, N).sum(0))  # bias grad from unquantized dY, as TE
    # and it is really quantized: differs from the high-precision linear by FP8-sized noise
    ref = torch.nn.functional.linear(x, w, b)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 5e-2


def test_delayed_recipe_uses_previous_amax_and_e5m2_grads():
    cfg = PrecisionConfig(recipe="delayed", fp8_format="hybrid", amax_history_len=2, amax_compute_algo="max")
    quant = ModuleQuantizer(cfg)
    scales = {"x": F32(1.0), "w": F32(1.0), "g": F32(1.0)}
    hist = {"x": [], "w": [], "g": []}
    for step in range(3):
        x, w, dy = _inputs(seed=step)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fake_quant_linear(xg, wg, None, quant)
        out.backward(dy)
        x2, dy2, wn = x.reshape(TOKENS, K).numpy(), dy.reshape(TOKENS, N).numpy(), w.numpy()

        def deq(a, key, fmt):
            s = scales[key]
            return ref_cast((a * s).astype(np.float32), fmt).astype(np.float32) * (F32(1) / s)

        xq, wq, gq = (torch.from_numpy(deq(x2, "x", "e4m3")), torch.from_numpy(deq(wn, "w", "e4m3")),
                      torch.from_numpy(deq(dy2, "g", "e5m2")))
        assert torch.equal(out.reshape(TOKENS, N), xq @ wq.t()), step
        assert torch.equal(xg.grad.reshape(TOKENS, K), gq @ wq), step
        assert torch.equal(wg.grad, gq.t() @ xq), step
        for key, a, fmax in (("x", x2, 448.0), ("w", wn, 448.0), ("g", dy2, 57344.0)):
            hist[key] = ([float(np.abs(a).max())] + hist[key])[:2]
            scales[key] = F32(fmax) / F32(max(hist[key]))


def test_high_precision_removes_quantization_exactly():
    cfg = PrecisionConfig(recipe="blockwise")
    x, w, dy = _inputs()
    lin = FakeQuantLinear(K, N, cfg)
    with torch.no_grad():
        lin.weight.copy_(w)
    ref = torch.nn.Linear(K, N)
    ref.load_state_dict(lin.state_dict(), strict=False)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert not high_precision_active()
    with high_precision():
        assert high_precision_active()
        out = lin(xa)
    out.backward(dy)
    want = ref(xb)
    want.backward(dy)
    assert torch.equal(out, want)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(lin.weight.grad, ref.weight.grad)
    assert not torch.equal(lin(x), want)  # outside the context it quantizes again


def test_first_last_layers_stay_high_precision():
    cfg = PrecisionConfig(recipe="tensorwise", first_last_layers_high_precision=2)
    assert [layer_uses_fp8(cfg, i, 6) for i in range(6)] == [False, False, True, True, False, False]
    assert not any(layer_uses_fp8(PrecisionConfig(), i, 4) for i in range(4))
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    col, row = linear_classes_for_layer(cfg, 2, 6)
    assert issubclass(col, ColumnParallelLinear) and issubclass(row, RowParallelLinear)
    assert col is not ColumnParallelLinear and col.fp8_policy == cfg
    assert linear_classes_for_layer(cfg, 0, 6) == (ColumnParallelLinear, RowParallelLinear)
    assert linear_classes_for_layer(cfg, 3, 6) == (col, row)  # classes are shared per policy
    with pytest.raises(ValueError):
        layer_uses_fp8(cfg, 6, 6)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_empty_micro_batch(recipe):
    x = torch.zeros(0, 3, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    y = fake_quant_linear(x, w, None, ModuleQuantizer(PrecisionConfig(recipe=recipe)))
    y.sum().backward()
    assert y.shape == (0, 3, N) and torch.equal(w.grad, torch.zeros_like(w))
