"""Independent FP4 reference for the tests: numpy, element by element, from docs/FACTS.md "FP4 formats".

No project code: the E2M1 grid is decoded from its bit layout (1 sign, 2 exponent bits with bias 1,
1 mantissa bit), rounding searches the grid for the nearest value (ties to the even code), E4M3
scale casts use the FP8 reference's grid search, and all scale arithmetic is numpy float32 scalars
(IEEE round-to-nearest), each operation written out as FACTS.md states it.
"""
from __future__ import annotations

import math

import numpy as np

from .fp8_reference import ref_cast

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


def e2m1_grid() -> np.ndarray:
    """Non-negative E2M1 values in code order: code = (exponent << 1) | mantissa."""
    vals = []
    for e in range(4):
        for m in range(2):
            vals.append(m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
    return np.array(vals)


GRID = e2m1_grid()
assert GRID.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_e2m1(v: float) -> float:
    """Nearest E2M1 value of a float32 scalar, ties to the even code, saturating at 6; NaN stays NaN."""
    if math.isnan(v):
        return math.nan
    a = min(abs(float(v)), 6.0)
    best = None
    for code, g in enumerate(GRID):
        d = abs(a - g)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, code, g)
    return math.copysign(best[2], v)


def ref_e4m3(v: np.float32) -> np.float32:
    """E4M3 round-to-nearest-even, saturating at 448."""
    return F32(ref_cast(np.array([min(float(v), 448.0)], dtype=np.float32), "e4m3")[0])


def _amax(values) -> np.float32:
    """max |v| skipping NaN (0 when empty or all NaN)."""
    vals = [abs(float(v)) for v in values if not math.isnan(float(v))]
    return F32(max(vals)) if vals else F32(0.0)


def ref_nvfp4(x: np.ndarray, block: tuple[int, int] = (1, 16), amax_tensor=None) -> np.ndarray:
    """Dequantized NVFP4 of a 2-D float32 array with (br, bc) blocks (ragged edge blocks allowed)."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    amax_t = _amax(x.ravel()) if amax_tensor is None else F32(amax_tensor)
    if amax_t == 0:
        s_enc = F32(1.0)
    else:
        with np.errstate(over="ignore", divide="ignore"):
            s_enc = F32(2688.0) / amax_t
        if math.isinf(s_enc):
            s_enc = FLT_MAX
        if s_enc == 0:
            s_enc = F32(1.0)
    out = np.zeros_like(x)
    br, bc = block
    for i0 in range(0, rows, br):
        for j0 in range(0, cols, bc):
            blk = x[i0:i0 + br, j0:j0 + bc]
            amax_b = _amax(blk.ravel())
            with np.errstate(over="ignore"):
                s_b = ref_e4m3(F32(amax_b / F32(6.0)) * s_enc)
            d = F32(s_b / s_enc)
            for (i, j), v in np.ndenumerate(blk):
                if s_b == 0:
                    out[i0 + i, j0 + j] = v * F32(0.0)
                else:
                    with np.errstate(over="ignore"):
                        q = ref_e2m1(F32(v / d))
                    out[i0 + i, j0 + j] = F32(F32(q) * d)
    return out


def ref_mxfp4(x: np.ndarray, block: tuple[int, int] = (1, 32)) -> np.ndarray:
    """Dequantized MXFP4 of a 2-D float32 array: d = 2^(floor(log2 amax) - 2), clamped to [2^-127, 2^127]."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    out = np.zeros_like(x)
    br, bc = block
    for i0 in range(0, rows, br):
        for j0 in range(0, cols, bc):
            blk = x[i0:i0 + br, j0:j0 + bc]
            amax_b = float(_amax(blk.ravel()))
            if math.isinf(amax_b):
                out[i0:i0 + br, j0:j0 + bc] = np.nan
                continue
            if amax_b == 0:
                out[i0:i0 + br, j0:j0 + bc] = blk * F32(0.0)
                continue
            e = math.floor(math.log2(amax_b))
            # log2 of a float can round across an integer: fix e so that 2^e <= amax < 2^(e+1) exactly
            while 2.0 ** e > amax_b:
                e -= 1
            while 2.0 ** (e + 1) <= amax_b:
                e += 1
            d = F32(2.0 ** max(-127, min(127, e - 2)))
            for (i, j), v in np.ndenumerate(blk):
                out[i0 + i, j0 + j] = F32(F32(ref_e2m1(F32(v / d))) * d)
    return out


def ref_fake_quant(x: np.ndarray, fmt: str, axis: int = -1) -> np.ndarray:
    """fake_quant_fp4's contract in the reference: 1-D blocks along `axis`, nvfp4 per-tensor scale over all of x."""
    x = np.asarray(x, dtype=np.float32)
    moved = np.moveaxis(x, axis, -1)
    x2d = moved.reshape(-1, moved.shape[-1])
    out = ref_nvfp4(x2d, (1, 16)) if fmt == "nvfp4" else ref_mxfp4(x2d, (1, 32))
    return np.moveaxis(out.reshape(moved.shape), -1, axis)
