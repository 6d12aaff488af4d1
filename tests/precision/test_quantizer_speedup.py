"""The faster quantizers of issue 27 give the old implementations' bits (tests/precision/quantizer_reference.py).

Every comparison is bitwise: equal int32 patterns wherever the old result is a number (so -0.0 and
+0.0 differ), NaN exactly where the old result is NaN. Inputs mix random magnitudes over many
binades with zeros, NaN, +-inf, fp32 subnormals, values at and beyond each format's max, and exact
rounding ties; hypothesis adds arbitrary fp32 bit patterns.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.precision import numerics as nx

from . import quantizer_reference as ref

FMTS = ("e4m3", "e5m2")


def assert_same_bits(new: torch.Tensor, old: torch.Tensor) -> None:
    """Same shape and dtype, NaN at the same places, identical bit patterns everywhere else."""
    assert new.shape == old.shape and new.dtype == old.dtype, (new.shape, old.shape, new.dtype, old.dtype)
    if old.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        new, old = new.float(), old.float()
    nan = torch.isnan(old)
    assert torch.equal(torch.isnan(new), nan), "NaN positions differ"
    if old.dtype.is_floating_point:
        bits = {4: torch.int32, 2: torch.int16, 8: torch.int64}[old.element_size()]
        mismatch = (new.view(bits) != old.view(bits)) & ~nan
    else:
        mismatch = new != old
    assert not bool(mismatch.any()), f"{int(mismatch.sum())} elements differ, first at {mismatch.nonzero()[0].tolist()}"


def fp8_grid(fmt: str) -> torch.Tensor:
    """All non-negative finite values of the FP8 format, ascending, as fp32."""
    dtype = nx.fp8_dtype(fmt)
    codes = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return codes[torch.isfinite(codes)].sort().values


def ties_and_neighbours(fmt: str) -> torch.Tensor:
    """Midpoints of consecutive grid values (exact rounding ties), one fp32 ulp either side, signed."""
    g = fp8_grid(fmt).double()
    mid = ((g[1:] + g[:-1]) / 2).float()  # exact in fp32: one extra bit
    up = torch.nextafter(mid, torch.full_like(mid, math.inf))
    down = torch.nextafter(mid, torch.zeros_like(mid))
    v = torch.cat([mid, up, down, g.float(), torch.tensor([nx.fp8_max(fmt) * 1.03, nx.fp8_max(fmt) * 1.5, 1e30])])
    return torch.cat([v, -v])


def special_tensor(rows: int, cols: int, seed: int, specials: bool = True) -> torch.Tensor:
    """Random values over ~24 binades, with zeros, NaN, +-inf, subnormals and an all-zero row mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, cols), generator=g).float())
    if not specials or x.numel() < 8:
        return x
    flat = x.view(-1)
    pick = torch.randperm(flat.numel(), generator=g)
    k = max(1, flat.numel() // 40)
    flat[pick[:k]] = 0.0
    flat[pick[k:2 * k]] = -0.0
    flat[pick[2 * k:2 * k + 1]] = float("nan")
    flat[pick[2 * k + 1:2 * k + 2]] = 1e-41  # an fp32 subnormal
    flat[pick[2 * k + 2:2 * k + 3]] = -3e-39
    if rows > 1:
        x[rows // 2] = 0.0
    return x


def random_bits(n: int, seed: int) -> torch.Tensor:
    """n arbitrary fp32 bit patterns (every class of float: NaNs, infs, subnormals, normals)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ----------------------------------------------------------------- the FP8 cast emulation
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("arithmetic", [False, True])
def test_round_to_fp8_is_the_cast(fmt, arithmetic, monkeypatch):
    """Both paths of round_to_fp8 (torch's cast for small tensors, fp32 arithmetic for large) equal cast_to_fp8(x).float()."""
    monkeypatch.setattr(nx, "_NATIVE_CAST_BELOW", 0 if arithmetic else 1 << 40)
    m = nx.fp8_max(fmt)
    for x in (ties_and_neighbours(fmt), random_bits(200_000, 1),
              special_tensor(64, 300, 4), torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, m, -m, 2.0 ** -149])):
        assert_same_bits(nx.round_to_fp8(x, fmt), ref.cast_to_fp8(x, fmt).float())
        for scale in (2.0 ** -20, 1 / 3, 7.0, 2.0 ** 40):  # the rescaled values cover other binades and subnormals
            y = x * scale
            assert_same_bits(nx.round_to_fp8(y, fmt), ref.cast_to_fp8(y, fmt).float())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1, max_size=64),
       st.sampled_from(FMTS))
def test_round_to_fp8_on_arbitrary_floats(values, fmt):
    """hypothesis' floats (it favours boundaries: 0, subnormals, max, inf) through the arithmetic path."""
    x = torch.tensor(values, dtype=torch.float32)
    x = x.repeat(-(-nx._NATIVE_CAST_BELOW // x.numel()))  # at least _NATIVE_CAST_BELOW elements: the arithmetic path
    assert_same_bits(nx.round_to_fp8(x, fmt), ref.cast_to_fp8(x, fmt).float())


# ----------------------------------------------------------------- TE-convention quantizers
AMAXES = [0.0, -0.0, 1e-45, 1e-39, 1e-30, 2688.0 / 3.4e38, 1.0, 448.0, 57344.0, 3.0e38, math.inf, math.nan, -1.0, -1e-40]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-12, 0.5])
def test_te_scale_from_amax(pow2, eps):
    """Every amax class (0, subnormal, overflowing quotient, inf, NaN, even negative) gives the old scale."""
    amax = torch.cat([torch.tensor(AMAXES), random_bits(4000, 7).abs(), random_bits(4000, 8)])
    for fmax in (448.0, 57344.0):
        assert_same_bits(nx.te_scale_from_amax(amax, fmax, pow2, eps), ref.te_scale_from_amax(amax, fmax, pow2, eps))


SHAPES = [(1, 1), (3, 7), (16, 64), (64, 64), (128, 256), (130, 200), (256, 128), (0, 16)]


def _inputs(shape, seed):
    """Random-with-specials, plus variants: a ties tensor with the format max as amax, all zeros, bf16."""
    x = special_tensor(*shape, seed)
    yield x
    yield special_tensor(*shape, seed, specials=False)
    if x.numel():
        yield torch.zeros(shape)
        yield x.to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_current_scaling(shape, fmt):
    """quantize_current / fake_quantize_current / DelayedScaler equal the old quantize_current path (payload, scale_inv, dequantized)."""
    for x in _inputs(shape, sum(shape)):
        for amax in (None, torch.tensor(3.5), torch.tensor(0.0)):
            old = ref.quantize_current(x, fmt, amax=amax)
            new = nx.quantize_current(x, fmt, amax=amax)
            assert_same_bits(new.data, old[0])
            assert_same_bits(new.scale_inv, old[1])
            assert_same_bits(new.dequantize(), ref.dequantize(old))
            assert_same_bits(nx.fake_quantize_current(x, fmt, amax=amax), ref.dequantize(old))
        scaler = nx.DelayedScaler(fmt)
        scaler.scale = torch.tensor(0.37)
        held = scaler.scale
        out = scaler.fake_quantize(x, update=True)
        assert_same_bits(out, ref.dequantize(ref.delayed_quantize(held, x, fmt)))
        assert scaler.history == [float(ref.tensor_amax(ref._as_2d(x)))]


@pytest.mark.parametrize("fmt", FMTS)
def test_current_scaling_on_exact_ties(fmt):
    """With the format max present the scale is exactly 1, so every tie of the grid reaches the cast unchanged."""
    x = ties_and_neighbours(fmt)
    x = torch.cat([x[x.abs() <= nx.fp8_max(fmt)], torch.full((4000,), 1.0)])  # large enough for the arithmetic path
    old = ref.quantize_current(x, fmt)
    assert float(old[1]) == 1.0
    assert_same_bits(nx.fake_quantize_current(x, fmt), ref.dequantize(old))


BLOCKS = [(1, 128), (128, 1), (128, 128), (1, 32), (32, 1)]


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0]])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("fmt", FMTS)
def test_block_scaling(shape, block, fmt):
    """Blockwise (pow2 and fp32 scales) and MXFP8, tiled and ragged shapes: same payload, scales and dequantized values."""
    for x in _inputs(shape, sum(shape) + block[0]):
        for pow2 in (True, False):
            old = ref.quantize_blockwise_te(x, block, fmt, power_of_two=pow2)
            new = nx.quantize_blockwise_te(x, block, fmt, power_of_two=pow2)
            assert_same_bits(new.data, old[0])
            assert_same_bits(new.scale_inv, old[1])
            assert_same_bits(new.dequantize(), ref.dequantize(old))
            assert_same_bits(nx.fake_quantize_blockwise_te(x, block, fmt, power_of_two=pow2), ref.dequantize(old))
        old = ref.quantize_mxfp8(x, fmt, block)
        new = nx.quantize_mxfp8(x, fmt, block)
        assert_same_bits(new.data, old[0])
        assert_same_bits(new.scale_inv, old[1])
        assert_same_bits(new.dequantize(), ref.dequantize(old))
        assert_same_bits(nx.fake_quantize_mxfp8(x, fmt, block), ref.dequantize(old))


def test_amax_helpers():
    """block_amax (tiled and padded) and tensor_amax skip NaN, count inf, and give 0 for empty tensors."""
    x = special_tensor(130, 200, 11)
    x[3, 5] = math.inf
    for block in BLOCKS + [(16, 16), (1, 16)]:
        assert_same_bits(nx.block_amax(x, block), ref.block_amax(x, block))
    assert_same_bits(nx.tensor_amax(x), ref.tensor_amax(x))
    assert_same_bits(nx.tensor_amax(torch.empty(0, 4)), ref.tensor_amax(torch.empty(0, 4)))
    assert_same_bits(nx.tensor_amax(torch.full((5,), math.nan)), ref.tensor_amax(torch.full((5,), math.nan)))
