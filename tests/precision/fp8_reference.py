"""Independent FP8 reference for the tests: numpy formulas from docs/FACTS.md, no project code.

The FP8 value grids are decoded from the bit layout (sign, exponent, mantissa, bias), rounding
is nearest-with-ties-to-even by searching the grid, and all scale arithmetic uses numpy float32
(IEEE round-to-nearest), so a bug in torch's cast or in the project's quantizers shows up as a
mismatch.
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)


def fp8_grid(fmt: str) -> np.ndarray:
    """Non-negative finite values of the format in code order (code i has mantissa LSB i & 1)."""
    ebits, mbits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    vals = []
    for e in range(2**ebits):
        for m in range(2**mbits):
            if fmt == "e4m3" and e == 15 and m == 7:
                continue  # the only NaN code of e4m3fn
            if fmt == "e5m2" and e == 31:
                continue  # inf / NaN codes
            if e == 0:
                vals.append(m * 2.0 ** (1 - bias - mbits))
            else:
                vals.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return np.array(vals, dtype=np.float64)


FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def ref_cast(x: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating RNE cast to the FP8 grid (values returned as float64; NaN stays NaN)."""
    grid = fp8_grid(fmt)
    assert grid[-1] == FP8_MAX[fmt]
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        a = np.minimum(np.abs(x), grid[-1])
    a_safe = np.where(np.isnan(a), 0.0, a)
    j = np.searchsorted(grid, a_safe)
    lo, hi = grid[np.maximum(j - 1, 0)], grid[j]
    d_lo, d_hi = a_safe - lo, hi - a_safe
    # ties go to the code with an even mantissa LSB (code j-1 when it is even)
    tie = np.where((j - 1) % 2 == 0, lo, hi)
    r = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, tie))
    r = np.where((j == 0) | (hi == a_safe), hi, r)
    return np.where(np.isnan(x), np.nan, np.copysign(r, x))


def te_scale(amax: float, fp8_max: float, pow2: bool = False, eps: float = 0.0) -> np.float32:
    """TE scale rule: max(amax, eps); 0/inf/NaN -> 1; fp32 fp8_max/amax; overflow -> FLT_MAX; pow2 keeps sign+exponent."""
    a = F32(amax)
    if a < F32(eps):
        a = F32(eps)
    if math.isnan(a) or math.isinf(a) or a == 0:
        return F32(1.0)
    with np.errstate(over="ignore"):
        s = F32(fp8_max) / a
    if math.isinf(s):
        s = F32(FLT_MAX)
    if pow2:
        s = np.array([s], dtype=np.float32).view(np.uint32)
        s = (s & np.uint32(0xFF800000)).view(np.float32)[0]
    return F32(s)


def amax_no_nan(x: np.ndarray) -> float:
    """max |x| skipping NaN (TE's fmaxf), 0 for an empty or all-NaN block."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    a = a[~np.isnan(a)]
    return float(a.max()) if a.size else 0.0


def blocks(rows: int, cols: int, br: int, bc: int):
    """(i, j, row slice, col slice) of every (possibly ragged) block."""
    for i in range(math.ceil(rows / br)):
        for j in range(math.ceil(cols / bc)):
            yield i, j, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)


def te_quantize(x: np.ndarray, block: tuple[int, int], fmt: str, pow2: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q values, scale_inv per block, dequantized) under TE's multiply convention for 2-D fp32 x."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    br, bc = block
    q = np.zeros_like(x, dtype=np.float64)
    deq = np.zeros_like(x)
    sinv = np.zeros((math.ceil(rows / br), math.ceil(cols / bc)), dtype=np.float32)
    for i, j, rs, cs in blocks(rows, cols, br, bc):
        s = te_scale(amax_no_nan(x[rs, cs]), FP8_MAX[fmt], pow2)
        with np.errstate(over="ignore", invalid="ignore"):
            q[rs, cs] = ref_cast((x[rs, cs] * s).astype(np.float32), fmt)
        sinv[i, j] = F32(1.0) / s
        deq[rs, cs] = (q[rs, cs].astype(np.float32) * sinv[i, j]).astype(np.float32)
    return q, sinv, deq


def e8m0_round_up(v: float) -> int:
    """Biased exponent of 2^ceil(log2 v) for a positive normal fp32 v (frexp: v = m * 2^k, m in [0.5, 1))."""
    m, k = math.frexp(v)
    return 127 + (k - 1 if m == 0.5 else k)


def mxfp8_quantize(x: np.ndarray, block: tuple[int, int], fmt: str = "e4m3"):
    """(q values, scale_inv = 2^(e-127) per block, dequantized) of MXFP8 for 2-D fp32 x (normal amaxes or 0)."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    q = np.zeros_like(x, dtype=np.float64)
    sinv = np.zeros((math.ceil(rows / block[0]), math.ceil(cols / block[1])), dtype=np.float32)
    for i, j, rs, cs in blocks(rows, cols, *block):
        v = F32(amax_no_nan(x[rs, cs])) * F32(1.0 / FP8_MAX[fmt])
        e = 0 if v == 0 else e8m0_round_up(float(v))
        mult = F32(2.0 ** (127 - e))
        q[rs, cs] = ref_cast((x[rs, cs] * mult).astype(np.float32), fmt)
        sinv[i, j] = F32(2.0 ** (e - 127))
    deq = np.zeros_like(x)
    for i, j, rs, cs in blocks(rows, cols, *block):
        deq[rs, cs] = (q[rs, cs].astype(np.float32) * sinv[i, j]).astype(np.float32)
    return q, sinv, deq


def ckpt_quantize(w: np.ndarray, block: tuple[int, int], ue8m0: bool = False):
    """(q values, scale_inv) of the DeepSeek/SGLang convention: scale_inv = max(amax,1e-10)/448, q = clamp(w/scale_inv)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    q = np.zeros_like(w, dtype=np.float64)
    sinv = np.zeros((math.ceil(rows / block[0]), math.ceil(cols / block[1])), dtype=np.float32)
    for i, j, rs, cs in blocks(rows, cols, *block):
        s = F32(max(amax_no_nan(w[rs, cs]), F32(1e-10))) / F32(448.0)
        if ue8m0:
            m, k = math.frexp(float(s))
            s = F32(2.0 ** (k - 1 if m == 0.5 else k))
        sinv[i, j] = s
        q[rs, cs] = ref_cast(np.clip((w[rs, cs] / s).astype(np.float32), -448, 448), "e4m3")
    return q, sinv


def ckpt_dequantize(q: np.ndarray, sinv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """q * scale_inv per block in fp32."""
    out = np.zeros(q.shape, dtype=np.float32)
    for i, j, rs, cs in blocks(q.shape[0], q.shape[1], *block):
        out[rs, cs] = (q[rs, cs].astype(np.float32) * sinv[i, j]).astype(np.float32)
    return out
