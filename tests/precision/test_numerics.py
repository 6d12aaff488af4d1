"""Bit-exact checks of every FP8 recipe's CPU emulation against the independent numpy reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.precision import numerics as nx
from megatron_rl.precision.blockwise import (
    dequantize_blockwise,
    quantize_activation_groups,
    quantize_blockwise,
    quantize_per_channel,
)

from .fp8_reference import (
    F32,
    FLT_MAX,
    ckpt_dequantize,
    ckpt_quantize,
    fp8_grid,
    mxfp8_quantize,
    ref_cast,
    te_quantize,
    te_scale,
)


def _edge_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows of very different magnitudes plus an all-zero block, saturating, negative and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[:, :7] = 0.0  # part of a block is zero
    if rows > 130 and cols > 130:
        x[128:, 128:] = 0.0  # a whole ragged block is zero
    if rows >= 2 and cols >= 14:
        x[0, 10:14] = torch.tensor([448.0, -448.0, 1000.0, -5e4])
        x[1, 10:14] = torch.tensor([1e-30, -2.0**-9, 2.0**-10, -1e-7])
    return x


def _bits_equal(a: torch.Tensor, b: np.ndarray) -> bool:
    """Same values (NaN == NaN) compared in float64: exact for FP8 and fp32 payloads."""
    return np.array_equal(a.double().numpy(), np.asarray(b, dtype=np.float64), equal_nan=True)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_is_saturating_rne_on_the_fp8_grid(fmt):
    m = nx.fp8_max(fmt)
    assert m == {"e4m3": 448.0, "e5m2": 57344.0}[fmt] == fp8_grid(fmt)[-1]
    g = fp8_grid(fmt)
    mids = (g[1:] + g[:-1]) / 2  # exact ties between neighbours
    x = np.concatenate([g, -g, mids, -mids, [m * 1.01, m * 2, -m * 4, 1e30, np.inf, -np.inf, np.nan]]).astype(np.float32)
    q = nx.cast_to_fp8(torch.from_numpy(x), fmt)
    assert q.dtype == nx.fp8_dtype(fmt)
    assert _bits_equal(q.float(), ref_cast(x, fmt))
    assert q.float()[-3:-1].tolist() == [m, -m]  # inf saturates like TE's satfinite cast


def test_te_scale_rule_edge_amaxes():
    amax = [0.0, float("inf"), float("nan"), 1e-45, 3.0, 448.0, 1e-3, 7e5]
    for pow2 in (False, True):
        got = nx.te_scale_from_amax(torch.tensor(amax), 448.0, power_of_two=pow2)
        want = [te_scale(a, 448.0, pow2) for a in amax]
        assert got.numpy().tolist() == [float(w) for w in want]
    got = nx.te_scale_from_amax(torch.tensor([0.0, 1e-45, 3.0]), 448.0)
    assert got.tolist() == [1.0, FLT_MAX, float(F32(448.0) / F32(3.0))]
    # power-of-two scales round DOWN: 448/3 = 149.33 -> 128
    assert nx.te_scale_from_amax(torch.tensor([3.0]), 448.0, power_of_two=True).item() == 128.0
    # eps floors amax: amax 0 with eps 1e-4 gives 448/1e-4, not 1
    assert nx.te_scale_from_amax(torch.tensor([0.0]), 448.0, eps=1e-4).item() == float(F32(448.0) / F32(1e-4))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_bit_exact(fmt, pow2):
    x = _edge_matrix(5, 70)
    q = nx.quantize_current(x, fmt, power_of_two=pow2)
    rq, rs, rd = te_quantize(x.numpy(), tuple(x.shape), fmt, pow2)
    assert _bits_equal(q.data.float(), rq)
    assert _bits_equal(q.scale_inv, rs)
    assert _bits_equal(q.dequantize(), rd)


@pytest.mark.parametrize("amax", [0.0, float("inf"), float("nan")])
def test_current_scaling_degenerate_amax_uses_scale_one(amax):
    x = torch.tensor([[0.5, -3.0, 1000.0, 2.0**-12]])
    q = nx.quantize_current(x, "e4m3", amax=torch.tensor(amax))
    assert q.scale_inv.item() == 1.0
    assert _bits_equal(q.data.float(), ref_cast(x.numpy(), "e4m3"))


def test_current_scaling_ignores_nan_elements_in_amax():
    x = torch.tensor([[float("nan"), 2.0, -4.0]])
    q = nx.quantize_current(x, "e4m3")
    assert q.scale_inv.item() == float(F32(1.0) / (F32(448.0) / F32(4.0)))
    assert math.isnan(q.data.float()[0, 0].item())


@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_te_blockwise_bit_exact_ragged(block, pow2, fmt):
    x = _edge_matrix(131, 200)  # neither dim a multiple of 128
    q = nx.quantize_blockwise_te(x, block, fmt, power_of_two=pow2)
    rq, rs, rd = te_quantize(x.numpy(), block, fmt, pow2)
    assert q.scale_inv.shape == rs.shape == (math.ceil(131 / block[0]), math.ceil(200 / block[1]))
    assert _bits_equal(q.data.float(), rq)
    assert _bits_equal(q.scale_inv, rs)
    assert _bits_equal(q.dequantize(), rd)


def test_te_blockwise_flattens_leading_dims():
    x = _edge_matrix(6, 130).reshape(2, 3, 130)
    q = nx.quantize_blockwise_te(x, (1, 128), "e4m3", power_of_two=False)
    rq, _, rd = te_quantize(x.reshape(6, 130).numpy(), (1, 128), "e4m3", False)
    assert q.dequantize().shape == x.shape
    assert _bits_equal(q.dequantize().reshape(6, 130), rd)


@pytest.mark.parametrize("block", [(1, 32), (32, 1)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_bit_exact(block, fmt):
    x = _edge_matrix(40, 70)
    x[1, 10] = 0.0  # keep block amaxes normal fp32 numbers (the reference's frexp domain)
    q = nx.quantize_mxfp8(x, fmt, block)
    rq, rs, rd = mxfp8_quantize(x.numpy(), block, fmt)
    assert _bits_equal(q.data.float(), rq)
    assert _bits_equal(q.scale_inv, rs)
    assert _bits_equal(q.dequantize(), rd)
    # scale_inv are powers of two and the scaled amax never exceeds fp8_max (exponent rounded UP)
    m, _ = np.frexp(rs[rs > 0])
    assert np.all(m == 0.5)


def test_float_to_e8m0_special_values():
    v = torch.tensor([0.0, float("inf"), float("nan"), 1.0, 1.5, 2.0**-127, 2.0**-126 * 1.5, 2.0**127 * 1.5])
    assert nx.float_to_e8m0(v).tolist() == [0, 254, 255, 127, 128, 0, 2, 254]
    assert math.isnan(nx.e8m0_to_scale(torch.tensor([255])).item())
    assert nx.e8m0_to_scale(torch.tensor([127, 0, 254])).tolist() == [1.0, 2.0**127, 2.0**-127]


def _delayed_reference(amaxes, history_len, algo, margin, fp8_max=448.0):
    """Scale used for each step: computed from the amaxes of earlier steps only."""
    scale, hist, used = F32(1.0), [], []
    for a in amaxes:
        used.append(scale)
        hist = ([a] + hist)[:history_len]
        if algo == "most_recent":
            h = hist[0]
        else:
            finite = [v for v in hist if not math.isnan(v)]
            h = max([0.0] + finite)
        if math.isfinite(h) and h > 0:
            scale = F32(F32(fp8_max) / F32(2.0**margin)) / F32(h)
            if math.isinf(scale):
                scale = F32(FLT_MAX)
    return used


@pytest.mark.parametrize("history_len,algo,margin", [(1, "most_recent", 0), (3, "max", 0), (4, "max", 2), (2, "most_recent", 1)])
def test_delayed_scaling_history(history_len, algo, margin):
    peaks = [2.0, 10.0, 0.0, float("inf"), 0.5, float("nan"), 3.0, 1.0]
    scaler = nx.DelayedScaler("e4m3", history_len, algo, margin)
    want = _delayed_reference(peaks, history_len, algo, margin)
    for step, peak in enumerate(peaks):
        p = peak if math.isfinite(peak) else 1.0
        x = torch.tensor([[p, -p / 2, p / 3]])  # amax of x is the peak
        # non-finite amaxes (e.g. a TP-reduced amax) enter through the amax argument
        amax = None if math.isfinite(peak) else torch.tensor(peak)
        q = scaler.quantize(x, amax=amax)
        s = want[step]
        assert q.scale_inv.item() == float(F32(1.0) / s), step
        assert _bits_equal(q.data.float(), ref_cast((x.numpy() * s).astype(np.float32), "e4m3"))


def test_delayed_scaling_no_update_keeps_state():
    scaler = nx.DelayedScaler("e5m2", 2, "max", 0)
    scaler.quantize(torch.tensor([[4.0]]))
    before = scaler.state_dict()
    scaler.quantize(torch.tensor([[1e4]]), update=False)
    assert scaler.state_dict() == before
    assert before["scale"] == float(F32(57344.0) / F32(4.0))


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 5), (3, 20), (129, 127)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_rollout_blockwise_bit_exact(shape, ue8m0):
    w = _edge_matrix(*shape, seed=3)
    q, s = quantize_blockwise(w, (128, 128), "ue8m0" if ue8m0 else "fp32")
    rq, rs = ckpt_quantize(w.numpy(), (128, 128), ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert _bits_equal(q.float(), rq)
    assert _bits_equal(s, rs)
    assert _bits_equal(dequantize_blockwise(q, s), ckpt_dequantize(rq, rs, (128, 128)))


def test_rollout_blockwise_zero_block_and_pow2_round_up():
    w = torch.zeros(130, 130)
    w[0, 0] = 3.0  # amax 3 -> scale_inv 3/448; ue8m0 rounds UP to 2^-7
    q, s = quantize_blockwise(w, scale_fmt="fp32")
    assert s[0, 0].item() == float(F32(3.0) / F32(448.0))
    assert s[1, 1].item() == float(F32(1e-10) / F32(448.0))
    assert q.float().abs().sum().item() == 448.0
    _, s2 = quantize_blockwise(w, scale_fmt="ue8m0")
    assert s2[0, 0].item() == 2.0**-7
    assert s2[0, 0].item() >= s[0, 0].item()


def test_per_channel_and_activation_groups():
    w = _edge_matrix(9, 50, seed=5)
    q, s = quantize_per_channel(w)
    rq, rs = ckpt_quantize(w.numpy(), (1, 50))
    assert s.shape == (9, 1)
    assert _bits_equal(q.float(), rq) and _bits_equal(s, rs)
    x = _edge_matrix(4, 300, seed=6).reshape(2, 2, 300)
    q, s = quantize_activation_groups(x, 128)
    rq, rs = ckpt_quantize(x.reshape(4, 300).numpy(), (1, 128))
    assert s.shape == (2, 2, 3)
    assert _bits_equal(q.reshape(4, 300).float(), rq) and _bits_equal(s.reshape(4, 3), rs)


def _row_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the relative error of each row (small rows count as much as large ones)."""
    return ((a - b).norm(dim=1) / b.norm(dim=1)).mean().item()


def test_quantization_noise_is_sane_and_shrinks_with_finer_blocks():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 256, generator=g)
    e4m3 = _row_rel_err(nx.quantize_current(x, "e4m3").dequantize(), x)
    e5m2 = _row_rel_err(nx.quantize_current(x, "e5m2").dequantize(), x)
    assert 1e-3 < e4m3 < 1e-1 and 1e-3 < e5m2 < 1e-1
    assert e4m3 < e5m2  # two mantissa bits are noisier than three
    # rows spanning six decades, more than E4M3's normal range: finer blocks keep small rows exact-ish
    y = torch.randn(256, 256, generator=g) * torch.logspace(-5, 1, 256).unsqueeze(1)
    errs = {
        "tensor": _row_rel_err(nx.quantize_current(y, "e4m3").dequantize(), y),
        "128x128": _row_rel_err(nx.quantize_blockwise_te(y, (128, 128), power_of_two=False).dequantize(), y),
        "1x128": _row_rel_err(nx.quantize_blockwise_te(y, (1, 128), power_of_two=False).dequantize(), y),
        "mxfp8": _row_rel_err(nx.quantize_mxfp8(y, "e4m3").dequantize(), y),
    }
    assert errs["1x128"] < errs["128x128"] < errs["tensor"], errs
    assert errs["tensor"] > 0.1 and all(1e-3 < errs[k] < 0.05 for k in ("128x128", "1x128", "mxfp8")), errs
