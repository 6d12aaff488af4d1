"""Bit-faithful CPU emulation of the FP4 formats: E2M1 values with NVFP4 or MXFP4 block scales.

Definitions (docs/FACTS.md, "FP4 formats"):

* E2M1 holds {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives. Forward rounding is to nearest with
  ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and
  saturates at 6; stochastic rounding (gradients) rounds up with probability equal to the distance
  from the lower neighbour over the gap, so it is unbiased inside [-6, 6].
* NVFP4 (TE ``NVFP4BlockScaling``): one FP32 per-tensor encode scale s_enc = 6*448 / amax(tensor),
  per block an E4M3 decode scale s_b = e4m3(amax(block) / 6 * s_enc), element decode scale
  d = s_b / s_enc, value = e2m1(x / d) * d. Blocks are 1x16 (activations, gradients) or 16x16
  (weights, so W and W^T share values).
* MXFP4 (OCP MX v1.0): per 32-element block an E8M0 scale d = 2^(floor(log2(amax(block))) - 2),
  value = e2m1(x / d) * d.

Why our own code: torch has no E2M1 dtype or cast, and Transformer Engine's NVFP4 kernels need a
Blackwell GPU; this module is the CPU leaf behind ``precision.recipe: nvfp4 | mxfp4``. The public
entry point is ``fake_quant_fp4``; ``quantize_fp4`` exposes the raw codes and scales (rollout export).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from megatron_rl.precision.numerics import E4M3_MAX, FP32_MAX, _abs_no_nan, _f32, cast_to_fp8

Fp4Format = Literal["nvfp4", "mxfp4"]

E2M1_MAX = 6.0
"""Largest finite E2M1 magnitude."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Non-negative E2M1 values in code order (code i has mantissa bit i & 1)."""
NVFP4_BLOCK = 16
"""Elements per NVFP4 scaling block (1-D), and the side of the 2-D weight blocks."""
MXFP4_BLOCK = 32
"""Elements per MXFP4 scaling block."""
NVFP4_GLOBAL_NUMERATOR = 2688.0
"""6 * 448: E2M1 max times E4M3 max, numerator of the NVFP4 per-tensor encode scale (exact in fp32)."""
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
"""Unbiased exponent range of an OCP E8M0 scale (biased code 255 is NaN)."""

Block = tuple[int, int]


_ONE_BITS, _FOUR_BITS = 127 << 23, 129 << 23
"""fp32 exponent fields of 1.0 and 4.0: the binade floors of the E2M1 steps 0.5, 1 and 2."""


def round_e2m1(v: torch.Tensor, uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 v rounded onto the E2M1 grid, saturating at +-6: nearest-even, or stochastic given uniforms in [0, 1).

    Within each binade the grid is evenly spaced (step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]) and
    every binade edge is on the grid, so rounding |v| / step to an integer half to even picks the
    even E2M1 code; |v| / step and the products are exact in fp32. Stochastic rounding adds one step
    when u < frac(|v| / step). NaN stays NaN, +-inf saturates to +-6, the sign of zero is kept.

    The step is 2^(e-1) for the binade 2^e of |v| with e clamped to [0, 2] (read off the exponent
    bits); nearest-even rounding adds and subtracts C = step * 2^23, whose fp32 sum rounds half to
    even at exactly that step (the old where/round/multiply form, kept in
    tests/precision/quantizer_reference.py, gives the same bits).
    """
    v = _f32(v)
    a = v.abs().clamp_(max=E2M1_MAX)
    binade = (a.view(torch.int32) & 0x7F800000).clamp_(_ONE_BITS, _FOUR_BITS)  # NaN's exponent field clamps too
    if uniforms is None:
        c = binade.add_(22 << 23).view(torch.float32)  # step * 2^23
        return a.add_(c).sub_(c).copysign_(v)
    step = binade.sub_(1 << 23).view(torch.float32)
    units = a.div_(step)
    low = torch.floor(units)
    # frac > u as 1.0 / 0.0 in place (NaN gives 0, as u < NaN is False): adding a bool tensor would convert it
    r = low.add_(units.sub_(low).gt_(uniforms)).mul_(step)
    return r.copysign_(v)


def nvfp4_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 per-tensor encode scale s_enc = fp32(2688) / amax (fp32 division).

    amax 0 gives 1 (FACTS.md); beyond FACTS.md, as TE's compute_global_encode_scaling_factor_FP4:
    an overflowing quotient (amax < 2688 / FLT_MAX) becomes FLT_MAX, and amax = inf (quotient 0) gives 1.
    """
    amax = amax.float()
    s = (torch.full_like(amax, NVFP4_GLOBAL_NUMERATOR) / amax).clamp_(max=FP32_MAX)
    return s.masked_fill_((amax == 0) | (s == 0), 1.0)


def _pad_blocks(x2d: torch.Tensor, block: Block) -> torch.Tensor:
    """x2d zero-padded to whole blocks and viewed as [row blocks, br, col blocks, bc]."""
    br, bc = block
    rows, cols = x2d.shape
    pr, pc = -rows % br, -cols % bc
    padded = torch.nn.functional.pad(x2d, (0, pc, 0, pr)) if pr or pc else _unpadded(x2d)
    return padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)


def _unpadded(x2d: torch.Tensor) -> torch.Tensor:
    """What F.pad with zero padding returns, without its copy where that copy changes nothing.

    F.pad then clones, keeping the layout of a dense tensor (contiguous or transposed), which x2d
    itself has; only a non-dense view is cloned. Results (and the GEMMs reading them) thus see the
    layouts they saw before.
    """
    return x2d if x2d.is_contiguous() or x2d.t().is_contiguous() else x2d.clone()


@dataclass
class Fp4Tensor:
    """An emulated FP4 tensor: E2M1 codes as fp32 values, per-block scales and the format's rules."""

    fmt: Fp4Format
    """nvfp4 or mxfp4."""
    q: torch.Tensor
    """E2M1 values (fp32) with the 2-D shape that was quantized (NaN where the input was NaN)."""
    block_scale: torch.Tensor
    """Per block [ceil(rows/br), ceil(cols/bc)]: nvfp4 s_b as float8_e4m3fn; mxfp4 biased E8M0 codes (int32)."""
    global_scale: Optional[torch.Tensor]
    """nvfp4: the fp32 per-tensor encode scale s_enc (0-d); mxfp4: None."""
    block: Block
    """(rows, cols) of one scaling block."""

    def decode_scale(self) -> torch.Tensor:
        """fp32 element decode scale per block: s_b / s_enc (nvfp4) or 2^(code - 127) (mxfp4, NaN for code 255)."""
        if self.fmt == "nvfp4":
            return self.block_scale.float() / self.global_scale
        d = torch.exp2((self.block_scale - 127).float())
        return torch.where(self.block_scale == 255, torch.full_like(d, float("nan")), d)

    def dequantize(self) -> torch.Tensor:
        """q * d in fp32 with the quantized 2-D shape."""
        rows, cols = self.q.shape
        qb = _pad_blocks(self.q, self.block)
        d = self.decode_scale()[:, None, :, None]
        out = (qb * d).reshape(qb.shape[0] * qb.shape[1], qb.shape[2] * qb.shape[3])
        return out[:rows, :cols]


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    """Per-block max |x| of a [nr, br, nc, bc] view; NaN is skipped (fmaxf), +-inf counts."""
    return _abs_no_nan(xb).amax(dim=(1, 3))


def quantize_nvfp4(x2d: torch.Tensor, block: Block = (1, NVFP4_BLOCK), uniforms: Optional[torch.Tensor] = None,
                   amax: Optional[torch.Tensor] = None) -> Fp4Tensor:
    """NVFP4 quantization of a 2-D tensor with (br, bc) blocks; `uniforms` (padded shape) selects stochastic rounding.

    float32 operations, in this order (docs/FACTS.md taken literally):
      1. xf = x2d.float()
      2. amax_t = max |xf| over the tensor (NaN skipped), or the given `amax`
      3. s_enc = nvfp4_encode_scale(amax_t) = fp32(2688) / amax_t   (1 when amax_t = 0)
      4. per block: amax_b = max |xf| over the block's real elements (NaN skipped, zero padding never wins)
      5. s_b = e4m3((amax_b / fp32(6)) * s_enc): fp32 division, then fp32 product, then a round-to-
         nearest-even cast to float8_e4m3fn saturating at 448 (E4M3 subnormals kept; inf -> 448)
      6. d = fp32(s_b) / s_enc                                          (fp32 division)
      7. q = round_e2m1(xf / d)  (fp32 division, then RNE or stochastic rounding, saturating at +-6)
         -- except where s_b = 0: the block is all zeros (q = xf * 0, so NaN stays NaN)
      8. value = q * d                                                   (fp32 product, exact)
    TE's kernel instead multiplies by fp32(1 / (s_b * (1 / s_enc))) and forms s_b from
    amax_b * (s_enc * (1/6)); either can differ from this in the last bit of a scale (rarely).
    """
    xf = x2d.float()
    q, _, s_b, s_enc = _nvfp4_blocks(xf, block, uniforms, amax)
    return Fp4Tensor("nvfp4", _crop(q, xf.shape), s_b, s_enc, tuple(block))


def _nvfp4_blocks(xf: torch.Tensor, block: Block, uniforms: Optional[torch.Tensor], amax: Optional[torch.Tensor]):
    """(q, d) in the [nr, br, nc, bc] block view, s_b and s_enc: steps 2-7 of quantize_nvfp4."""
    xb = _pad_blocks(xf, block)  # may be a view of the caller's tensor: never written below
    amax_b = _block_amax(xb)
    # the max of the block maxes is the tensor's (NaN skipped alike, zero padding never wins)
    amax_t = amax_b.amax() if xf.numel() else torch.zeros((), device=xf.device)
    s_enc = nvfp4_encode_scale(amax_t if amax is None else amax.reshape(()))
    s_b = cast_to_fp8((amax_b / E2M1_MAX) * s_enc, "e4m3")
    d = (s_b.float() / s_enc)[:, None, :, None]
    uniforms = _as_blocks(uniforms, xb)
    if not xb.is_contiguous():
        # the where() below also fixes the layout of q (and so of the GEMM operand): kept as it was
        q = torch.where(d == 0, xb * 0.0, round_e2m1(xb / d, uniforms))
        return q, d, s_b, s_enc
    # where s_b = 0 the block's values are xb * 0.0 (signed zeros, NaN stays NaN; such a block holds no inf,
    # whose amax would give s_b = 448): dividing by inf there instead of by 0 rounds to exactly those values
    q = round_e2m1(xb / d.masked_fill(d == 0, math.inf), uniforms)
    return q, d, s_b, s_enc


def quantize_mxfp4(x2d: torch.Tensor, block: Block = (1, MXFP4_BLOCK), uniforms: Optional[torch.Tensor] = None) -> Fp4Tensor:
    """MXFP4 (OCP MX v1.0) quantization of a 2-D tensor with (br, bc) blocks; `uniforms` selects stochastic rounding.

    float32 operations, in this order:
      1. xf = x2d.float(); per block amax_b = max |xf| (NaN skipped, +-inf counts)
      2. e = floor(log2(amax_b)), exact: frexp(amax_b) = (m, k) with m in [0.5, 1), e = k - 1
         (subnormal amaxes included; amax_b = 0 gives e = -1, harmless since the block is all zeros)
      3. shared = clamp(e - 2, -127, 127) (2 = emax of E2M1; OCP clamps to the E8M0 range);
         E8M0 code = shared + 127; amax_b = inf gives code 255 (NaN): that block dequantizes to NaN
      4. d = 2^shared (exact in fp32, 2^-127 is a subnormal)
      5. q = round_e2m1(xf / d) (division by a power of two: exact; then RNE or stochastic, saturating at +-6)
      6. value = q * d (exact)
    NaN elements stay NaN.
    """
    xf = x2d.float()
    q, _, code = _mxfp4_blocks(xf, block, uniforms)
    return Fp4Tensor("mxfp4", _crop(q, xf.shape), code, None, tuple(block))


def _mxfp4_blocks(xf: torch.Tensor, block: Block, uniforms: Optional[torch.Tensor]):
    """(q, d) in the [nr, br, nc, bc] block view (d NaN for code 255) and the E8M0 codes: steps 1-5 of quantize_mxfp4."""
    xb = _pad_blocks(xf, block)
    amax_b = _block_amax(xb)
    _, k = torch.frexp(amax_b)
    shared = torch.clamp(k.to(torch.int32) - 1 - 2, E8M0_MIN_EXP, E8M0_MAX_EXP)
    inf = torch.isinf(amax_b)
    code = torch.where(inf, torch.full_like(shared, 255), shared + 127)
    d = torch.exp2(shared.float())[:, None, :, None]
    q = round_e2m1(xb / d, _as_blocks(uniforms, xb))
    d = torch.where(inf[:, None, :, None], torch.full_like(d, float("nan")), d)
    return q, d, code


def _as_blocks(uniforms: Optional[torch.Tensor], xb: torch.Tensor) -> Optional[torch.Tensor]:
    """Uniforms given in the padded 2-D shape, viewed like the [nr, br, nc, bc] block view xb."""
    if uniforms is None:
        return None
    rows, cols = xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3]
    if tuple(uniforms.shape) != (rows, cols):
        raise ValueError(f"stochastic-rounding uniforms must have the padded shape {(rows, cols)}, got {tuple(uniforms.shape)}")
    return uniforms.reshape(xb.shape)


def _crop(qb: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[nr, br, nc, bc] block view back to the unpadded 2-D shape."""
    full = qb.reshape(qb.shape[0] * qb.shape[1], qb.shape[2] * qb.shape[3])
    return full[: shape[0], : shape[1]]


def quantize_fp4(x2d: torch.Tensor, fmt: Fp4Format, block: Optional[Block] = None,
                 uniforms: Optional[torch.Tensor] = None) -> Fp4Tensor:
    """Quantize a 2-D tensor in `fmt` with `block` (default 1 x the format's block length)."""
    if fmt == "nvfp4":
        return quantize_nvfp4(x2d, block or (1, NVFP4_BLOCK), uniforms)
    if fmt == "mxfp4":
        return quantize_mxfp4(x2d, block or (1, MXFP4_BLOCK), uniforms)
    raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")


def fake_quantize(x2d: torch.Tensor, fmt: Fp4Format, block: Block, uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quantize_fp4(x2d, fmt, block, uniforms).dequantize() without materialising the codes (same fp32 operations)."""
    xf = x2d.float()
    if fmt == "nvfp4":
        q, d, _, _ = _nvfp4_blocks(xf, block, uniforms, None)
    elif fmt == "mxfp4":
        q, d, _ = _mxfp4_blocks(xf, block, uniforms)
    else:
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    return _crop(q.mul_(d), xf.shape)  # q is a fresh tensor


def padded_shape(shape: tuple[int, int], block: Block) -> tuple[int, int]:
    """Shape of a 2-D tensor padded to whole blocks (the shape stochastic-rounding uniforms must have)."""
    return -(-shape[0] // block[0]) * block[0], -(-shape[1] // block[1]) * block[1]


def fake_quant_fp4(x: torch.Tensor, fmt: Fp4Format = "nvfp4", axis: int = -1) -> torch.Tensor:
    """Dequantized float32 tensor of x in `fmt`, blocks of 16 (nvfp4) or 32 (mxfp4) consecutive elements along `axis`.

    Forward rounding. x is first converted to float32 (xf = x.float()); the last block along `axis`
    may be ragged (its amax is taken over its real elements only). All arithmetic is IEEE float32
    with round-to-nearest-even, in exactly this order:

    nvfp4 (docs/FACTS.md taken literally; one per-tensor scale over ALL of x):
      1. amax_t = max |xf| over the whole tensor (NaN skipped)
      2. s_enc = fp32(2688) / amax_t                  (2688 = 6 * 448; s_enc = 1 when amax_t = 0;
         beyond FACTS.md, as TE: an overflowing quotient becomes FLT_MAX, amax_t = inf gives 1)
      3. per block: amax_b = max |xf| over the block (NaN skipped)
      4. t = amax_b / fp32(6); u = t * s_enc          (two roundings, in this order)
      5. s_b = float8_e4m3fn(min(u, 448))              (RNE, E4M3 subnormals kept, saturating at 448)
      6. d = fp32(s_b) / s_enc
      7. if s_b == 0: the block's values are xf * 0 (zeros; NaN stays NaN), else
         v = xf / d; q = e2m1_rne(v) saturating at +-6 (ties to the even code); value = q * d
    mxfp4 (OCP MX v1.0, no per-tensor scale):
      1. per block: amax_b = max |xf| (NaN skipped)
      2. e = floor(log2(amax_b)) exactly (from frexp, subnormals included); shared = clamp(e - 2, -127, 127)
      3. d = 2^shared (exact); v = xf / d (exact); q = e2m1_rne(v) saturating at +-6; value = q * d (exact)
      (amax_b = 0: all zeros; amax_b = inf: the E8M0 scale is NaN and the block is all NaN)

    Special values: NaN elements stay NaN and never enter an amax; +-inf enters the amax and
    saturates to +-6 * d (under nvfp4 an inf amax gives s_enc = 1 and s_b = 448).
    """
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    if x.dim() == 0:
        return fake_quant_fp4(x.reshape(1), fmt).reshape(())
    moved = torch.movedim(x.float(), axis, -1)
    x2d = moved.reshape(-1, moved.shape[-1])
    out = fake_quantize(x2d, fmt, (1, NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK))
    return torch.movedim(out.reshape(moved.shape), -1, axis)


WGRAD_SIGNS = torch.tensor(  # device-ok: a constant, moved with .to(device) where used
    [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float32)
"""Transformer Engine's hard-coded random sign vector of the wgrad Hadamard transform (nvfp4_tensor.py)."""


def hadamard16(device: Optional[torch.device] = None) -> torch.Tensor:
    """TE's random-sign Hadamard transform matrix diag(s) @ H16 / 4 (fp32, orthogonal; s is TE's fixed sign vector)."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < 16:  # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (WGRAD_SIGNS.to(device)[:, None] * h) * 0.25


@functools.lru_cache(maxsize=None)
def _hadamard16_on(device: torch.device) -> torch.Tensor:
    """hadamard16(device), built once per device (read-only: only ever a matmul operand)."""
    return hadamard16(device)


def hadamard_along_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Apply the 16x16 random-sign Hadamard to every chunk of 16 rows (tokens) of x2d, zero-padding rows to a multiple of 16.

    For a column v of x2d split into 16-row chunks, each chunk becomes chunk @ R with R = hadamard16()
    (as TE transforms the rows of X^T); R is orthogonal, so (A')^T B' = A^T B for any two operands
    transformed alike: the wgrad product is unchanged before quantization.
    """
    rows, cols = x2d.shape
    padded = _f32(x2d)
    padded = torch.nn.functional.pad(padded, (0, 0, 0, -rows % 16)) if rows % 16 else _unpadded(padded)
    chunks = padded.t().reshape(cols, -1, 16) @ _hadamard16_on(x2d.device)
    return chunks.reshape(cols, -1).t()
