"""The quantizers as they were before their speed-up (megatron_rl/precision at commit 1870038), kept as the oracle.

tests/precision/test_quantizer_speedup.py checks that the faster implementations in
megatron_rl/precision give these functions' bits on random and special inputs, and
benchmarks/bench_quantizers.py times both side by side. Nothing in the package imports this
module: it is the old code path, copied unchanged (only renamed), so that "bit-identical to
before" stays checkable after the package moves on.
"""
from __future__ import annotations

from typing import Optional

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP32_MAX = torch.finfo(torch.float32).max
_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAXES = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}


# ----------------------------------------------------------------- numerics.py (TE convention)
def cast_to_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Old numerics.cast_to_fp8."""
    m = _MAXES[fmt]
    return torch.clamp(x.float(), -m, m).to(_DTYPES[fmt])


def te_scale_from_amax(amax: torch.Tensor, max_fp8: float, power_of_two: bool = False, eps: float = 0.0) -> torch.Tensor:
    """Old numerics.te_scale_from_amax."""
    amax = amax.float()
    amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    bad = torch.isinf(amax) | torch.isnan(amax) | (amax == 0)
    scale = torch.tensor(max_fp8, dtype=torch.float32) / torch.where(bad, torch.ones_like(amax), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if power_of_two:
        bits = scale.view(torch.int32) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)
        scale = bits.view(torch.float32)
    return scale


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """Old numerics._as_2d."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _expand_blocks(per_block: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Old numerics._expand_blocks."""
    br, bc = block
    full = per_block.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return full[:rows, :cols]


def _abs_no_nan(x: torch.Tensor) -> torch.Tensor:
    """Old numerics._abs_no_nan."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def block_amax(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Old numerics.block_amax."""
    br, bc = block
    rows, cols = x2d.shape
    pr, pc = -rows % br, -cols % bc
    a = torch.nn.functional.pad(_abs_no_nan(x2d), (0, pc, 0, pr))
    nr, nc = a.shape[0] // br, a.shape[1] // bc
    return a.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Old numerics.tensor_amax."""
    return _abs_no_nan(x).amax() if x.numel() else torch.zeros(())


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fmt: str):
    """Old numerics.quantize_with_scale: (fp8 data, scale_inv, block, shape)."""
    x2d = _as_2d(x).float()
    rows, cols = x2d.shape
    n_blocks = (-(-rows // block[0]), -(-cols // block[1]))
    scale = scale.float()
    if scale.numel() == n_blocks[0] * n_blocks[1]:
        scale = scale.reshape(n_blocks)
    q = cast_to_fp8(x2d * _expand_blocks(scale, block, rows, cols), fmt)
    return q, torch.reciprocal(scale), block, x.shape


def dequantize(qt, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Old numerics.QuantizedTensor.dequantize of a quantize_with_scale result."""
    data, scale_inv, block, shape = qt
    q = data.float()
    rows, cols = q.shape
    s = _expand_blocks(scale_inv, block, rows, cols)
    return (q * s).reshape(shape).to(dtype)


def _whole(x2d: torch.Tensor) -> tuple[int, int]:
    """Old numerics._whole."""
    return max(1, x2d.shape[0]), max(1, x2d.shape[1])


def quantize_current(x: torch.Tensor, fmt: str = "e4m3", power_of_two: bool = False, eps: float = 0.0,
                     amax: Optional[torch.Tensor] = None):
    """Old numerics.quantize_current."""
    x2d = _as_2d(x)
    if amax is None:
        amax = tensor_amax(x2d)
    scale = te_scale_from_amax(amax.reshape(1, 1), _MAXES[fmt], power_of_two, eps)
    return quantize_with_scale(x, scale, _whole(x2d), fmt)


def quantize_blockwise_te(x: torch.Tensor, block: tuple[int, int], fmt: str = "e4m3", power_of_two: bool = True,
                          eps: float = 0.0):
    """Old numerics.quantize_blockwise_te."""
    x2d = _as_2d(x)
    scale = te_scale_from_amax(block_amax(x2d, block), _MAXES[fmt], power_of_two, eps)
    return quantize_with_scale(x, scale, block, fmt)


def float_to_e8m0(v: torch.Tensor) -> torch.Tensor:
    """Old numerics.float_to_e8m0."""
    v = v.float()
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + bump.to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    return torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)


def e8m0_to_scale(e: torch.Tensor) -> torch.Tensor:
    """Old numerics.e8m0_to_scale."""
    scale = torch.exp2((127 - e).float())
    return torch.where(e == 0xFF, torch.full_like(scale, float("nan")), scale)


def quantize_mxfp8(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] = (1, 32)):
    """Old numerics.quantize_mxfp8."""
    x2d = _as_2d(x)
    rcp = torch.tensor(1.0 / _MAXES[fmt], dtype=torch.float32)
    e = float_to_e8m0(block_amax(x2d, block) * rcp)
    data, _, blk, shape = quantize_with_scale(x, e8m0_to_scale(e), block, fmt)
    return data, torch.exp2((e - 127).float()), blk, shape


def delayed_quantize(scale: torch.Tensor, x: torch.Tensor, fmt: str):
    """Old numerics.DelayedScaler.quantize's quantization with the held scale (the history update is unchanged)."""
    x2d = _as_2d(x)
    return quantize_with_scale(x, scale.reshape(1, 1), _whole(x2d), fmt)


# ----------------------------------------------------------------- blockwise.py (checkpoint convention)
AMAX_FLOOR = 1e-10


def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Old blockwise.round_up_pow2."""
    mant, exp = torch.frexp(s.float())
    exact = mant == 0.5
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), torch.where(exact, exp - 1, exp))


def _scale_inv(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """Old blockwise._scale_inv."""
    s = torch.clamp(amax.float(), min=AMAX_FLOOR) / torch.tensor(E4M3_MAX, dtype=torch.float32)
    if scale_fmt == "ue8m0":
        s = round_up_pow2(s)
    return s


def _quantize_2d(x2d: torch.Tensor, block: tuple[int, int], scale_fmt: str):
    """Old blockwise._quantize_2d."""
    rows, cols = x2d.shape
    s = _scale_inv(block_amax(x2d, block), scale_fmt)
    q = torch.clamp(x2d.float() / _expand_blocks(s, block, rows, cols), -E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), s


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str = "fp32"):
    """Old blockwise.quantize_blockwise."""
    return _quantize_2d(w, tuple(block), scale_fmt)


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Old blockwise.dequantize_blockwise."""
    rows, cols = q.shape
    return (q.float() * _expand_blocks(scale_inv.float(), tuple(block), rows, cols)).to(dtype)


def quantize_activation_groups(x: torch.Tensor, group: int = 128, scale_fmt: str = "fp32"):
    """Old blockwise.quantize_activation_groups."""
    x2d = x.reshape(-1, x.shape[-1])
    q, s = _quantize_2d(x2d, (1, group), scale_fmt)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], s.shape[-1])


def fake_quantize_activation_groups(x: torch.Tensor, group: int = 128, scale_fmt: str = "fp32") -> torch.Tensor:
    """Old blockwise.fake_quantize_activation_groups."""
    cols = x.shape[-1]
    if cols <= group or cols % group == 0:
        xg = x.reshape(-1, 1, cols) if cols <= group else x.reshape(-1, cols // group, group)
        s = _scale_inv(_abs_no_nan(xg).amax(dim=-1, keepdim=True), scale_fmt)
        q = torch.clamp(xg.float() / s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return (q.float() * s).reshape(x.shape).to(x.dtype)
    q, s = quantize_activation_groups(x, group, scale_fmt)
    x2d = q.reshape(-1, x.shape[-1])
    out = dequantize_blockwise(x2d, s.reshape(x2d.shape[0], -1), (1, group))
    return out.reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------- fp4.py
E2M1_MAX = 6.0
NVFP4_GLOBAL_NUMERATOR = 2688.0
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def round_e2m1(v: torch.Tensor, uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Old fp4.round_e2m1."""
    v = v.float()
    a = torch.clamp(v.abs(), max=E2M1_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0)).to(a.dtype)
    units = a / step
    if uniforms is None:
        r = torch.round(units) * step
    else:
        low = torch.floor(units)
        r = (low + (uniforms < units - low).to(a.dtype)) * step
    return torch.copysign(r, v)


def nvfp4_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """Old fp4.nvfp4_encode_scale."""
    amax = amax.float()
    s = torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=torch.float32, device=amax.device) / amax
    s = torch.clamp(s, max=FP32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _pad_blocks(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Old fp4._pad_blocks."""
    br, bc = block
    rows, cols = x2d.shape
    padded = torch.nn.functional.pad(x2d, (0, -cols % bc, 0, -rows % br))
    return padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)


def _block_amax4(xb: torch.Tensor) -> torch.Tensor:
    """Old fp4._block_amax."""
    return _abs_no_nan(xb).amax(dim=(1, 3))


def _as_blocks(uniforms: Optional[torch.Tensor], xb: torch.Tensor) -> Optional[torch.Tensor]:
    """Old fp4._as_blocks."""
    if uniforms is None:
        return None
    return uniforms.reshape(xb.shape)


def _crop(qb: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Old fp4._crop."""
    full = qb.reshape(qb.shape[0] * qb.shape[1], qb.shape[2] * qb.shape[3])
    return full[: shape[0], : shape[1]]


def _nvfp4_blocks(xf: torch.Tensor, block: tuple[int, int], uniforms: Optional[torch.Tensor], amax: Optional[torch.Tensor]):
    """Old fp4._nvfp4_blocks: (q, d, s_b, s_enc) in the block view."""
    xb = _pad_blocks(xf, block)
    amax_t = _abs_no_nan(xf).amax() if xf.numel() else torch.zeros((), device=xf.device)
    s_enc = nvfp4_encode_scale(amax_t if amax is None else amax.reshape(()))
    s_b = cast_to_fp8((_block_amax4(xb) / E2M1_MAX) * s_enc, "e4m3")
    d = (s_b.float() / s_enc)[:, None, :, None]
    q = round_e2m1(xb / d, _as_blocks(uniforms, xb))
    q = torch.where(d == 0, xb * 0.0, q)
    return q, d, s_b, s_enc


def _mxfp4_blocks(xf: torch.Tensor, block: tuple[int, int], uniforms: Optional[torch.Tensor]):
    """Old fp4._mxfp4_blocks: (q, d, code) in the block view."""
    xb = _pad_blocks(xf, block)
    amax_b = _block_amax4(xb)
    _, k = torch.frexp(amax_b)
    shared = torch.clamp(k.to(torch.int32) - 1 - 2, E8M0_MIN_EXP, E8M0_MAX_EXP)
    inf = torch.isinf(amax_b)
    code = torch.where(inf, torch.full_like(shared, 255), shared + 127)
    d = torch.exp2(shared.float())[:, None, :, None]
    q = round_e2m1(xb / d, _as_blocks(uniforms, xb))
    d = torch.where(inf[:, None, :, None], torch.full_like(d, float("nan")), d)
    return q, d, code


def quantize_nvfp4(x2d: torch.Tensor, block: tuple[int, int] = (1, 16), uniforms: Optional[torch.Tensor] = None,
                   amax: Optional[torch.Tensor] = None):
    """Old fp4.quantize_nvfp4: (E2M1 values q, s_b, s_enc)."""
    xf = x2d.float()
    q, _, s_b, s_enc = _nvfp4_blocks(xf, block, uniforms, amax)
    return _crop(q, xf.shape), s_b, s_enc


def fp4_fake_quantize(x2d: torch.Tensor, fmt: str, block: tuple[int, int], uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Old fp4.fake_quantize."""
    xf = x2d.float()
    if fmt == "nvfp4":
        q, d, _, _ = _nvfp4_blocks(xf, block, uniforms, None)
    else:
        q, d, _ = _mxfp4_blocks(xf, block, uniforms)
    return _crop(q * d, xf.shape)


def hadamard_along_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Old fp4.hadamard_along_rows (with fp4.hadamard16, which did not change)."""
    from megatron_rl.precision.fp4 import hadamard16

    rows, cols = x2d.shape
    padded = torch.nn.functional.pad(x2d.float(), (0, 0, 0, -rows % 16))
    chunks = padded.t().reshape(cols, -1, 16) @ hadamard16(x2d.device)
    return chunks.reshape(cols, -1).t()
