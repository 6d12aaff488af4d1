"""Bit-exact checks of the FP4 emulation (NVFP4, MXFP4) against the independent numpy reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.precision import fake_quant_fp4
from megatron_rl.precision import fp4

from .fp4_reference import GRID, ref_e2m1, ref_fake_quant, ref_mxfp4, ref_nvfp4


def _same(a: torch.Tensor, b: np.ndarray) -> bool:
    """Equal values, NaN == NaN (float64 comparison: exact for fp32 payloads)."""
    return np.array_equal(a.double().numpy(), np.asarray(b, dtype=np.float64), equal_nan=True)


def _edge_matrix(rows: int = 6, cols: int = 70, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, a zero block, saturating/tiny/subnormal-scale blocks, a ragged last block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[0, :16] = 0.0                      # an all-zero 16-block (and half of a 32-block)
    x[1, :16] = torch.randn(16, generator=g) * 3e-3   # E4M3 block scale lands in the subnormal range
    x[1, 16:32] = torch.randn(16, generator=g) * 1e-4  # E4M3 block scale rounds to zero: block is zeros
    x[2, 32:48] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # exact ties once scaled
    x[3, 5] = -400.0                     # the tensor's amax
    return x


def test_e2m1_rounding_ties_to_even_and_saturation():
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    v = torch.tensor(list(ties))
    assert fp4.round_e2m1(v).tolist() == list(ties.values())
    assert fp4.round_e2m1(-v).tolist() == [-t for t in ties.values()]
    mids = (GRID[1:] + GRID[:-1]) / 2
    probes = np.concatenate([GRID, -GRID, mids, -mids, mids + 1e-3, mids - 1e-3,
                             [6.5, 7.0, 1e30, 0.1, 1e-30, -1e-45]]).astype(np.float32)
    got = fp4.round_e2m1(torch.from_numpy(probes))
    assert _same(got, np.array([ref_e2m1(p) for p in probes]))
    special = fp4.round_e2m1(torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0]))
    assert special[:2].tolist() == [6.0, -6.0] and math.isnan(special[2]) and math.copysign(1, special[3]) == -1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fake_quant_bit_exact_against_reference(fmt, seed):
    x = _edge_matrix(seed=seed)
    got = fake_quant_fp4(x, fmt)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _same(got, ref_fake_quant(x.numpy(), fmt))
    assert not torch.equal(got, x)  # really quantized
    # every value is an E2M1 grid value times its block's decode scale: at most 8 magnitudes per block
    blk = 16 if fmt == "nvfp4" else 32
    assert len(torch.unique(got[4, :blk].abs())) <= 8


def test_nvfp4_edge_blocks():
    x = _edge_matrix()
    got = fake_quant_fp4(x, "nvfp4")
    assert torch.equal(got[0, :16], torch.zeros(16))           # zero block
    assert torch.equal(got[1, 16:32], torch.zeros(16))         # E4M3 scale underflows to 0: zeros, no NaN
    assert (got[1, :16] != 0).any()                            # subnormal E4M3 scale still represents the block
    s_enc = torch.tensor(2688.0) / x.abs().max()
    s_b = fp4.quantize_nvfp4(x).block_scale.float()
    assert s_b[1, 0] < 2.0 ** -6 and s_b[1, 0] > 0             # E4M3 subnormal
    assert torch.equal(fp4.quantize_nvfp4(x).global_scale, s_enc)
    assert got.abs().max() <= x.abs().max() * (1 + 2 ** -3)     # saturation at 6 * d keeps the amax's magnitude


def test_nvfp4_e4m3_scale_saturates_at_448():
    x = torch.tensor([[1000.0, 1.0] + [0.0] * 14, [3.0] * 16])
    # with a (TP-reduced) amax below the block's own, amax_b / 6 * s_enc exceeds 448 and saturates
    q = fp4.quantize_nvfp4(x, amax=torch.tensor(100.0))
    assert q.block_scale.float()[0, 0].item() == 448.0
    assert _same(q.dequantize(), ref_nvfp4(x.numpy(), amax_tensor=100.0))
    d = 448.0 / (2688.0 / 100.0)
    assert q.dequantize()[0, 0].item() == pytest.approx(6 * d)  # element saturates at 6


@pytest.mark.parametrize("scale", [1e-30, 1e-38, 1e-44, 1e38])
def test_tiny_and_huge_tensors(scale):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 48, generator=g).clamp(-3, 3) * scale
    for fmt in ("nvfp4", "mxfp4"):
        got = fake_quant_fp4(x, fmt)
        assert _same(got, ref_fake_quant(x.numpy(), fmt)), fmt
        assert torch.isfinite(got).all()


def test_special_values():
    x = torch.tensor([[float("nan"), 1.0, -2.0] + [0.5] * 13 + [float("inf")] + [1.0] * 15 + [3.0] * 16])
    nv = fake_quant_fp4(x, "nvfp4")
    assert _same(nv, ref_fake_quant(x.numpy(), "nvfp4"))
    assert math.isnan(nv[0, 0]) and not torch.isnan(nv[0, 1:]).any()   # NaN stays, amax skips it
    assert nv[0, 16].item() == 6.0 * 448.0                                # inf: s_enc = 1, s_b = 448, saturates at 6
    mx = fake_quant_fp4(x, "mxfp4")
    assert _same(mx, ref_fake_quant(x.numpy(), "mxfp4"))
    assert torch.isnan(mx[0, :32]).sum() == 32                            # OCP: a block holding inf has a NaN scale
    assert not torch.isnan(mx[0, 32:]).any()
    q = fp4.quantize_mxfp4(x)
    assert q.block_scale[0, 0].item() == 255


@pytest.mark.parametrize("shape,axis", [((5, 3, 40), -1), ((5, 3, 40), 0), ((37, 4), 0), ((21,), 0), ((2, 33, 3), 1)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_axis_and_ragged_last_block(shape, axis, fmt):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-1])
    got = fake_quant_fp4(x, fmt, axis=axis)
    assert got.shape == x.shape
    assert _same(got, ref_fake_quant(x.numpy(), fmt, axis=axis))


def test_non_float32_inputs_are_converted_first():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(fake_quant_fp4(x, "nvfp4"), fake_quant_fp4(x.float(), "nvfp4"))
    x64 = torch.randn(4, 32, dtype=torch.float64)
    assert torch.equal(fake_quant_fp4(x64, "mxfp4"), fake_quant_fp4(x64.float(), "mxfp4"))
    assert fake_quant_fp4(torch.tensor(2.4), "nvfp4").shape == ()
    with pytest.raises(ValueError, match="fmt"):
        fake_quant_fp4(x, "fp4")


def test_nvfp4_2d_weight_blocks_match_reference_and_transpose():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 56, generator=g) * torch.logspace(-2, 0, 56)
    q = fp4.quantize_nvfp4(w, (16, 16))
    assert q.block_scale.shape == (3, 4)
    assert _same(q.dequantize(), ref_nvfp4(w.numpy(), (16, 16)))
    # 16x16 blocks: quantizing W^T gives (W_q)^T, so fprop and dgrad share values
    assert torch.equal(fp4.quantize_nvfp4(w.t(), (16, 16)).dequantize(), q.dequantize().t())


def test_mxfp4_scale_codes():
    amaxes = [1.0, 6.0, 7.99, 8.0, 1e-40, 3e38, 2.0 ** -130]
    x = torch.zeros(len(amaxes), 32)
    x[:, 0] = torch.tensor(amaxes)
    q = fp4.quantize_mxfp4(x)
    want = [max(-127, min(127, math.frexp(a)[1] - 1 - 2)) + 127 for a in amaxes]
    assert q.block_scale[:, 0].tolist() == want
    assert _same(q.dequantize(), ref_mxfp4(x.numpy()))
    assert q.dequantize()[2, 0].item() == 6.0   # 7.99 / 1 saturates at 6 (the OCP scale never rounds up)


def test_stochastic_rounding_is_unbiased_and_picks_neighbours():
    v = torch.tensor([0.1, 0.3, 0.8, 1.2, 1.9, 2.2, 3.7, 4.5, 5.9, -2.6, 6.0, 0.0])
    g = torch.Generator().manual_seed(0)
    u = torch.rand(20000, v.numel(), generator=g)
    r = fp4.round_e2m1(v.expand_as(u), u)
    grid = torch.tensor(sorted(set(GRID.tolist()) | {-x for x in GRID.tolist()}))
    assert torch.isin(r, grid).all()
    lo_hi = [(max(gr for gr in GRID if gr <= abs(x)), min(gr for gr in GRID if gr >= abs(x))) for x in v.tolist()]
    for k, (lo, hi) in enumerate(lo_hi):
        assert set(r[:, k].abs().unique().tolist()) <= {lo, hi}
    gap = torch.tensor([hi - lo for lo, hi in lo_hi])
    # mean of n draws: std <= gap / (2 sqrt(n)); 5 sigma
    assert ((r.mean(0) - v).abs() <= 5 * gap / (2 * math.sqrt(u.shape[0])) + 1e-7).all()
    his, los = torch.tensor([hi for _, hi in lo_hi]), torch.tensor([lo for lo, _ in lo_hi])
    assert torch.equal(fp4.round_e2m1(v, torch.zeros_like(v)), torch.copysign(his, v))          # u = 0: always up
    assert torch.equal(fp4.round_e2m1(v, torch.full_like(v, 0.999999)), torch.copysign(los, v))  # u -> 1: down


def test_stochastic_block_quantization_is_unbiased_in_expectation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=g)
    shape = fp4.padded_shape(tuple(x.shape), (1, 16))
    draws = torch.stack([fp4.quantize_nvfp4(x, uniforms=torch.rand(shape, generator=g)).dequantize() for _ in range(4000)])
    q = fp4.quantize_nvfp4(x)
    d = q.decode_scale().repeat_interleave(16, dim=1)
    inside = x.abs() <= 6 * d  # elements beyond 6 * d saturate (an E4M3 scale rounded down): biased, as on TE
    assert inside.float().mean() > 0.9
    err_sr = (draws.mean(0) - x).abs()[inside]
    err_rne = (q.dequantize() - x).abs()[inside]
    # each draw is off by up to one E2M1 step (<= 2 d); the mean of n draws by ~d / sqrt(n)
    assert (err_sr <= 5 * d[inside] / math.sqrt(draws.shape[0])).all()
    assert err_sr.mean() < 0.1 * err_rne.mean()


def test_hadamard_is_te_random_sign_hadamard_and_orthogonal():
    r = fp4.hadamard16()
    assert torch.equal(r.abs(), torch.full((16, 16), 0.25))
    assert torch.allclose(r @ r.t(), torch.eye(16), atol=1e-7)
    assert fp4.WGRAD_SIGNS.tolist() == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(37, 5, generator=g), torch.randn(37, 7, generator=g)
    ta, tb = fp4.hadamard_along_rows(a), fp4.hadamard_along_rows(b)
    assert ta.shape == (48, 5)  # zero-padded to whole 16-token chunks
    torch.testing.assert_close(ta.t() @ tb, a.t() @ b, rtol=1e-5, atol=1e-5)
