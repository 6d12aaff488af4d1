"""The faster quantizers give the old implementations' bits (tests/precision/quantizer_reference.py).

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
    # the layout too: a GEMM reading an operand in another layout may accumulate in another order
    assert new.stride() == old.stride() or new.numel() <= 1, (new.stride(), old.stride())
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
        assert_same_bits(nx.round_to_fp8(x.to(torch.bfloat16), fmt), ref.cast_to_fp8(x.to(torch.bfloat16), fmt).float())
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
        yield special_tensor(shape[1], shape[0], seed + 1).t()  # a non-contiguous view (a transposed gradient)
        yield special_tensor(shape[0], 2 * shape[1], seed + 2)[:, ::2]  # a non-dense view


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


# ----------------------------------------------------------------- checkpoint-convention quantizers (rollout side)
@pytest.mark.parametrize("shape", [(64, 64), (256, 64), (136, 200), (128, 256), (1, 1), (300, 128)])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_checkpoint_weight_quantizers(shape, scale_fmt):
    """quantize_blockwise (128x128, tiled, cut to a small tensor, ragged), per-channel and dequantize_blockwise keep their bits."""
    from megatron_rl.precision import blockwise as bw

    for w in _inputs(shape, sum(shape) + 5):
        w = w.float()
        for block in ((128, 128), (1, shape[1]), (32, 16)):
            q, s = bw._quantize_2d(w, block, scale_fmt)
            rq, rs = ref._quantize_2d(w, block, scale_fmt)
            assert_same_bits(q, rq)
            assert_same_bits(s, rs)
            assert_same_bits(bw.dequantize_blockwise(q, s, block), ref.dequantize_blockwise(rq, rs, block))
        q, s = bw.quantize_blockwise(w, (128, 128), scale_fmt)
        rq, rs = ref.quantize_blockwise(w, (128, 128), scale_fmt)
        assert_same_bits(q, rq)
        assert_same_bits(s, rs)


@pytest.mark.parametrize("cols, group", [(64, 128), (128, 128), (256, 128), (200, 128), (32, 16), (100, 128), (7, 128)])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_activation_fake_quant(cols, group, scale_fmt, rows):
    """The engine's per-token 1 x group activation fake-quant: both paths, fp32 and bf16, 3-D inputs, specials."""
    from megatron_rl.precision import blockwise as bw

    for x in _inputs((rows, cols), rows + cols + group):
        for shaped in (x, x.reshape(1, rows, cols)):
            assert_same_bits(bw.fake_quantize_activation_groups(shaped, group, scale_fmt),
                             ref.fake_quantize_activation_groups(shaped, group, scale_fmt))
        q, s = bw.quantize_activation_groups(x, group, scale_fmt)
        rq, rs = ref.quantize_activation_groups(x, group, scale_fmt)
        assert_same_bits(q, rq)
        assert_same_bits(s, rs)


# ----------------------------------------------------------------- the engine's W8A8 model: one fake-quant per shared input
def _w8a8_qwen3(hidden: int, mode: str):
    """A 2-layer HF Qwen3 with its transformer linears converted to W8A8 (the embedded engine's FP8 model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_rl.precision.w8a8 import convert_to_w8a8

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64)
    model = Qwen3ForCausalLM(cfg).eval()
    convert_to_w8a8(model, mode)
    return model


@pytest.mark.parametrize("hidden, mode", [(64, "fp8-blockwise"), (160, "fp8-blockwise"), (64, "fp8-channel")])
def test_w8a8_siblings_quantize_a_shared_input_once(hidden, mode, monkeypatch):
    """q/k/v and gate/up reuse one fake-quant of their input: 4 instead of 7 per layer, logits bitwise those without sharing."""
    from megatron_rl.precision import w8a8

    model = _w8a8_qwen3(hidden, mode)
    linears = [m for m in model.modules() if isinstance(m, w8a8.W8A8Linear)]
    assert all(m.shared_input is not None for m in linears)
    calls = []
    original = w8a8.fake_quantize_activation_groups
    monkeypatch.setattr(w8a8, "fake_quantize_activation_groups", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        shared = model(ids).logits
    assert len(calls) == 4 * 2  # per layer: q/k/v once, o_proj, gate/up once, down_proj
    for m in linears:
        m.shared_input = None
    calls.clear()
    with torch.no_grad():
        alone = model(ids).logits
    assert len(calls) == 7 * 2
    assert_same_bits(shared, alone)
    assert w8a8.share_sibling_inputs(model) == 2 * 2  # idempotent: the hooks are not registered twice
    assert all(len(m._forward_pre_hooks) == 1 for m in model.modules() if hasattr(m, "_w8a8_shared_input"))


def test_w8a8_shared_input_is_recomputed_for_a_changed_input():
    """An input modified in place between two siblings (its version moves), or a different tensor, is quantized afresh."""
    from megatron_rl.precision import w8a8

    model = _w8a8_qwen3(64, "fp8-blockwise")
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        attn._w8a8_shared_input.clear()
        q1 = attn.q_proj(x)
        x.mul_(3.0)
        k_after = attn.k_proj(x)
        attn._w8a8_shared_input.clear()
        k_fresh = attn.k_proj(x)
        y = x.clone()
        v_other = attn.v_proj(y)
        attn.v_proj.shared_input = None
        v_alone = attn.v_proj(y)
    assert_same_bits(k_after, k_fresh)
    assert_same_bits(v_other, v_alone)
    assert not torch.equal(q1, attn.q_proj(x))  # q1 came from the input before it was scaled


# ----------------------------------------------------------------- FP4 (NVFP4, MXFP4)
def e2m1_ties_and_neighbours() -> torch.Tensor:
    """Every E2M1 value and midpoint (the ties), one fp32 ulp either side, beyond the max, signed."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mid = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mid, torch.tensor([6.5, 7.0, 8.0, 1e30, math.inf, math.nan, 1e-41, 1e-30])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, math.inf)), torch.nextafter(pts, torch.zeros_like(pts))])
    return torch.cat([pts, -pts])


def uniforms_for(v: torch.Tensor, seed: int) -> torch.Tensor:
    """Uniforms in [0, 1) with the edge draws mixed in: 0, the largest float below 1, and exactly frac(|v| / step)."""
    u = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed))
    flat = u.view(-1)
    flat[::7] = 0.0
    flat[3::11] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    a = v.abs().clamp(max=6.0).view(-1)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    frac = (a / step) - torch.floor(a / step)
    flat[5::13] = torch.nan_to_num(frac[5::13], nan=0.5)  # u == frac: not below it, so no step up
    return u


@pytest.mark.parametrize("stochastic", [False, True])
def test_round_e2m1(stochastic):
    """Nearest-even and stochastic rounding (same uniforms -> same bits) on ties, every fp32 class and random values."""
    from megatron_rl.precision import fp4

    for i, v in enumerate((e2m1_ties_and_neighbours(), random_bits(100_000, 21), special_tensor(64, 96, 22) * 1e-3,
                           special_tensor(64, 96, 23), special_tensor(1, 1, 24))):
        u = uniforms_for(v, i) if stochastic else None
        assert_same_bits(fp4.round_e2m1(v, u), ref.round_e2m1(v, u))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                          st.floats(min_value=0.0, max_value=1.0, exclude_max=True, width=32)), min_size=1, max_size=64))
def test_round_e2m1_on_arbitrary_floats(pairs):
    """hypothesis' floats and uniforms (boundaries favoured) through both E2M1 rounding modes."""
    from megatron_rl.precision import fp4

    v = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    u = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    assert_same_bits(fp4.round_e2m1(v), ref.round_e2m1(v))
    assert_same_bits(fp4.round_e2m1(v, u), ref.round_e2m1(v, u))


def nvfp4_inputs(shape, seed):
    """Random-with-specials inputs, one with blocks that the encode scale flushes to s_b = 0 (tiny values, signed zeros, NaN)."""
    yield from _inputs(shape, seed)
    rows, cols = shape
    if rows * cols >= 32:
        x = special_tensor(rows, cols, seed + 3, specials=False) * 1e-30
        x.view(-1)[0] = 1e6  # the tensor amax: s_enc so small that every other block's s_b underflows to 0
        x.view(-1)[[1, 2, 3, 5]] = torch.tensor([-0.0, 0.0, math.nan, -1e-35])
        yield x


FP4_SHAPES = [(16, 64), (64, 256), (30, 40), (128, 16), (1, 1), (17, 33)]
FP4_BLOCKS = [(1, 16), (16, 1), (16, 16), (1, 32), (32, 1)]


@pytest.mark.parametrize("shape", FP4_SHAPES)
@pytest.mark.parametrize("block", FP4_BLOCKS)
def test_fp4_quantizers(shape, block):
    """quantize_nvfp4 (codes, s_b, s_enc; with an amax override) and fake_quantize nvfp4/mxfp4, RNE and stochastic."""
    from megatron_rl.precision import fp4

    for j, x in enumerate(nvfp4_inputs(shape, sum(shape) + block[0])):
        u = torch.rand(fp4.padded_shape(tuple(x.shape), block), generator=torch.Generator().manual_seed(j))
        for uniforms in (None, u):
            for amax in (None, torch.tensor(0.0), torch.tensor(3.0), torch.tensor(math.inf), torch.tensor(1e-40)):
                new = fp4.quantize_nvfp4(x, block, uniforms, amax)
                old_q, old_sb, old_senc = ref.quantize_nvfp4(x, block, uniforms, amax)
                assert_same_bits(new.q, old_q)
                assert_same_bits(new.block_scale, old_sb)
                assert_same_bits(new.global_scale, old_senc)
            for fmt in ("nvfp4", "mxfp4"):
                assert_same_bits(fp4.fake_quantize(x, fmt, block, uniforms), ref.fp4_fake_quantize(x, fmt, block, uniforms))


@pytest.mark.parametrize("rows", [16, 48, 20, 1])
def test_hadamard_along_rows(rows):
    """The wgrad Hadamard transform: same bits and layout, padded or not, contiguous input or a transposed view."""
    from megatron_rl.precision import fp4

    x = special_tensor(rows, 24, rows, specials=False)
    wide = special_tensor(rows, 48, rows + 2, specials=False)
    for variant in (x, special_tensor(24, rows, rows + 1, specials=False).t(), x.to(torch.bfloat16), wide[:, ::2]):
        assert_same_bits(fp4.hadamard_along_rows(variant), ref.hadamard_along_rows(variant))
