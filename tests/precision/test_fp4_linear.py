"""The FP4 fake-quant linear: forward RNE against the reference, stochastic-rounding gradients that are
reproducible and unbiased, the wgrad Hadamard transform, stream state and high_precision()."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import fp4, high_precision
from megatron_rl.precision.fp4_linear import Fp4ModuleQuantizer, stream_salt
from megatron_rl.precision.linear import FakeQuantLinear, ModuleQuantizer, fake_quant_linear, make_quantizer

from .fp4_reference import ref_mxfp4, ref_nvfp4

TOKENS, K, N = 6, 160, 136  # ragged against 16- and 32-blocks in N; tokens ragged against 16


def _inputs(seed: int = 0, tokens: int = TOKENS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=g) * torch.logspace(-2, 1, K)
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(tokens, N, generator=g) * 1e-3
    return x, w, dy


def _run(cfg: PrecisionConfig, x, w, dy, quant=None):
    quant = quant or make_quantizer(cfg)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fake_quant_linear(xg, wg, None, quant)
    out.backward(dy)
    return out.detach(), xg.grad, wg.grad, quant


def _ref(fmt: str, a: np.ndarray, block) -> torch.Tensor:
    return torch.from_numpy(ref_nvfp4(a, block) if fmt == "nvfp4" else ref_mxfp4(a, block))


def test_make_quantizer_registry():
    assert isinstance(make_quantizer(PrecisionConfig(recipe="nvfp4")), Fp4ModuleQuantizer)
    assert isinstance(make_quantizer(PrecisionConfig(recipe="mxfp4")), Fp4ModuleQuantizer)
    assert isinstance(make_quantizer(PrecisionConfig(recipe="blockwise")), ModuleQuantizer)
    with pytest.raises(ValueError):
        Fp4ModuleQuantizer(PrecisionConfig(recipe="blockwise"))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_all_three_gemms_match_the_reference_with_rne(fmt):
    """Deterministic rounding (SR and Hadamard off): every GEMM operand equals the independent reference."""
    cfg = PrecisionConfig(recipe=fmt, fp4_stochastic_rounding=False, fp4_hadamard_wgrad=False)
    x, w, dy = _inputs()
    out, gx, gw, _ = _run(cfg, x, w, dy)
    n = 16 if fmt == "nvfp4" else 32
    xn, wn, dyn = x.numpy(), w.numpy(), dy.numpy()
    w_f = _ref(fmt, wn, (16, 16) if fmt == "nvfp4" else (1, 32))
    w_d = w_f if fmt == "nvfp4" else _ref(fmt, wn, (32, 1))
    assert torch.equal(out, _ref(fmt, xn, (1, n)) @ w_f.t())
    assert torch.equal(gx, _ref(fmt, dyn, (1, n)) @ w_d)
    assert torch.equal(gw, _ref(fmt, dyn, (n, 1)).t() @ _ref(fmt, xn, (n, 1)))
    rel = ((out - x @ w.t()).norm() / (x @ w.t()).norm()).item()
    assert 0.02 < rel < 0.4  # FP4-sized noise: far above FP8's (~1e-2), far from garbage


def test_hadamard_wgrad_quantizes_the_transformed_operands():
    cfg = PrecisionConfig(recipe="nvfp4", fp4_stochastic_rounding=False, fp4_hadamard_wgrad=True)
    x, w, dy = _inputs(tokens=37)
    out, gx, gw, _ = _run(cfg, x, w, dy)
    xt, dyt = fp4.hadamard_along_rows(x), fp4.hadamard_along_rows(dy)
    assert xt.shape[0] == 48
    assert torch.equal(gw, _ref("nvfp4", dyt.numpy(), (16, 1)).t() @ _ref("nvfp4", xt.numpy(), (16, 1)))
    # fprop and dgrad are untouched by the wgrad transform
    off = _run(PrecisionConfig(recipe="nvfp4", fp4_stochastic_rounding=False, fp4_hadamard_wgrad=False), x, w, dy)
    assert torch.equal(out, off[0]) and torch.equal(gx, off[1]) and not torch.equal(gw, off[2])


def test_stochastic_rounding_streams_are_seeded_and_advance():
    cfg = PrecisionConfig(recipe="nvfp4", fp4_seed=3)
    x, w, dy = _inputs()
    a = _run(cfg, x, w, dy)
    b = _run(cfg, x, w, dy)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])          # same seed, fresh state: same draws
    assert torch.equal(a[0], b[0])                                       # forward is RNE
    c = _run(PrecisionConfig(recipe="nvfp4", fp4_seed=4), x, w, dy)
    assert not torch.equal(a[1], c[1])                                   # another seed: other draws
    quant = a[3]
    assert quant.state_dict() == {"fp4_backward_calls": 1}
    d = _run(cfg, x, w, dy, quant=quant)                                 # the stream advanced
    assert not torch.equal(a[1], d[1]) and quant.state_dict() == {"fp4_backward_calls": 2}
    fresh = make_quantizer(cfg)
    fresh.load_state_dict({"fp4_backward_calls": 1})                     # restored position repeats the draw
    assert torch.equal(_run(cfg, x, w, dy, quant=fresh)[1], d[1])
    salted = make_quantizer(cfg)
    salted.salt = stream_salt(2, "mlp.linear_fc1")
    assert not torch.equal(_run(cfg, x, w, dy, quant=salted)[1], a[1])  # modules draw different streams


def _saturated(a: torch.Tensor, fmt: str, block) -> torch.Tensor:
    """a with every element clipped to +-6 * its block's decode scale: what unbiased rounding can reach."""
    d = fp4.quantize_fp4(a, fmt, block).decode_scale()
    d = d.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: a.shape[0], : a.shape[1]]
    return torch.maximum(torch.minimum(a, 6 * d), -6 * d)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_stochastic_gradients_are_unbiased_in_expectation(fmt):
    """E[dX] = sat(dY) @ W_q and E[dW] = sat(dY')^T Q_rne(X') (' = Hadamard, sat = clip at 6 d): the rounding noise averages out."""
    cfg = PrecisionConfig(recipe=fmt, fp4_seed=0)
    x, w, dy = _inputs(tokens=32)
    n = 16 if fmt == "nvfp4" else 32
    quant = make_quantizer(cfg)
    draws = 120
    gx_sum, gw_sum = torch.zeros(32, K), torch.zeros(N, K)
    for _ in range(draws):
        _, gx, gw, _ = _run(cfg, x, w, dy, quant=quant)
        gx_sum += gx
        gw_sum += gw
    _, w_dgrad = quant.weight_pair(w)
    want_gx = _saturated(dy, fmt, (1, n)) @ w_dgrad
    _, x_col = quant.operand_pair("input", x)
    want_gw = _saturated(fp4.hadamard_along_rows(dy), fmt, (n, 1)).t() @ x_col
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    rne = _run(PrecisionConfig(recipe=fmt, fp4_stochastic_rounding=False), x, w, dy)
    # one SR draw is about as far off as RNE; the mean of n draws ~sqrt(n) times closer, RNE's bias stays
    assert rel(gx_sum / draws, want_gx) < 0.3 * rel(rne[1], want_gx)
    assert rel(gw_sum / draws, want_gw) < 0.3 * rel(rne[2], want_gw)
    assert rel(gx, want_gx) > 4 * rel(gx_sum / draws, want_gx)


def test_high_precision_is_exact_and_empty_batches_work():
    cfg = PrecisionConfig(recipe="nvfp4")
    lin = FakeQuantLinear(K, N, cfg, bias=False)
    x, _, dy = _inputs()
    with torch.no_grad():
        want = torch.nn.functional.linear(x, lin.weight)
    with high_precision():
        assert torch.equal(lin(x), want)
    assert not torch.equal(lin(x), want)
    for recipe in ("nvfp4", "mxfp4"):
        xe = torch.zeros(0, 3, K, requires_grad=True)
        we = torch.randn(N, K, requires_grad=True)
        y = fake_quant_linear(xe, we, None, make_quantizer(PrecisionConfig(recipe=recipe)))
        y.sum().backward()
        assert y.shape == (0, 3, N) and torch.equal(we.grad, torch.zeros_like(we))


@pytest.mark.parametrize("recipe", ["nvfp4", "blockwise"])
def test_forward_only_passes_skip_the_wgrad_copy(recipe, monkeypatch):
    """No grad mode: the column-wise (wgrad) copy of the input is not built; the output is unchanged."""
    from megatron_rl.precision import fp4_linear, numerics

    calls = []
    if recipe == "nvfp4":
        real = fp4_linear.fp4.hadamard_along_rows
        monkeypatch.setattr(fp4_linear.fp4, "hadamard_along_rows", lambda x: calls.append(1) or real(x))
    else:
        real = numerics.fake_quantize_blockwise_te  # what ModuleQuantizer calls for its operands
        monkeypatch.setattr(numerics, "fake_quantize_blockwise_te", lambda x, block, *a, **k: calls.append(block) or real(x, block, *a, **k))
    x, w, _ = _inputs()
    w = w.requires_grad_()
    with torch.no_grad():
        y0 = fake_quant_linear(x, w, None, make_quantizer(PrecisionConfig(recipe=recipe)))
    n_no_grad = len(calls)
    y1 = fake_quant_linear(x, w, None, make_quantizer(PrecisionConfig(recipe=recipe)))
    assert torch.equal(y0, y1)
    if recipe == "nvfp4":
        assert (n_no_grad, len(calls)) == (0, 1)
    else:
        assert (128, 1) not in calls[:n_no_grad] and (128, 1) in calls[n_no_grad:]
