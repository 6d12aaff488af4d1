"""Bit-faithful CPU emulation of FP8 quantization: formats, scale rules and every TE recipe.

Two conventions live here and must not be mixed (docs/FACTS.md, "FP8 formats"):

* Transformer Engine (learner side) multiplies: ``scale = fp8_max / amax`` in fp32,
  ``q = cast(x * scale)`` saturating with round-to-nearest-even, ``scale_inv = 1 / scale``,
  dequantized value ``q * scale_inv``. Used by the current (tensorwise), delayed, blockwise
  and MXFP8 recipes below.
* The DeepSeek/SGLang checkpoint (rollout side) divides: ``scale_inv = max(amax, 1e-10) / 448``,
  ``q = clamp(x / scale_inv, -448, 448)``. It lives in ``precision/blockwise.py``.

All scale arithmetic is float32 (as on the GPU); inputs in other dtypes are upcast first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

Fp8Format = Literal["e4m3", "e5m2"]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
E5M2_MAX = 57344.0
"""Largest finite float8_e5m2 value."""
FP32_MAX = torch.finfo(torch.float32).max
"""Scale used by TE when fp8_max / amax overflows fp32 (amax tiny but nonzero)."""

_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAXES = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}


def fp8_dtype(fmt: Fp8Format) -> torch.dtype:
    """torch dtype of an FP8 format name."""
    return _DTYPES[fmt]


def fp8_max(fmt: Fp8Format) -> float:
    """Largest finite value of an FP8 format."""
    return _MAXES[fmt]


def cast_to_fp8(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of an fp32 tensor to FP8 (NaN stays NaN)."""
    m = _MAXES[fmt]
    # torch saturates E4M3 but sends E5M2 overflow to inf; TE's satfinite cast clamps both
    # (including +-inf), so clamp explicitly and let torch do only the rounding.
    return torch.clamp(x.float(), -m, m).to(_DTYPES[fmt])


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x as float32 (x itself when it already is: no dispatch on the hot path)."""
    return x if x.dtype == torch.float32 else x.float()


_GRIDS = {"e4m3": (3, -6), "e5m2": (2, -14)}
"""(mantissa bits, exponent of the smallest normal) of each FP8 format."""
_NATIVE_CAST_BELOW = 4096
"""Tensors with fewer elements round through torch's FP8 cast (fewer ops); larger ones through
fp32 arithmetic, which vectorizes where torch's FP8-to-fp32 conversion runs element by element."""


def round_to_fp8(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 values of cast_to_fp8(x, fmt) (saturating RNE onto the FP8 grid), as a new fp32 tensor.

    From _NATIVE_CAST_BELOW elements on without materialising FP8: with C = 2^(e + 23 - mbits) for
    the binade 2^e of |x| (e floored at the format's smallest normal exponent, where the grid step
    stays that of the subnormals), |x| + C rounds (IEEE RNE) to the FP8 step of that binade, ties to
    the even code, and (|x| + C) - C is exact; the sign is copied back. Same values as the cast, NaN
    included (tests/precision/test_quantizer_speedup.py).
    """
    xf = _f32(x)
    if xf is x and xf.numel() < _NATIVE_CAST_BELOW:  # the cast path clamps in place
        xf = xf.clone()
    return _round_to_fp8_(xf, fmt)


def _round_to_fp8_(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """round_to_fp8 of an fp32 temporary, which it may overwrite (the callers' products)."""
    m = _MAXES[fmt]
    if y.numel() < _NATIVE_CAST_BELOW:
        return y.clamp_(-m, m).to(_DTYPES[fmt]).float()
    mbits, emin = _GRIDS[fmt]
    a = y.abs().clamp_(max=m)
    # the binade's exponent field, kept in [smallest normal, the max's]: also keeps a NaN's all-ones field from overflowing the add
    lo, hi = (emin + 127) << 23, (math.frexp(m)[1] - 1 + 127) << 23
    c = (a.view(torch.int32) & 0x7F800000).clamp_(lo, hi).add_((23 - mbits) << 23).view(torch.float32)
    return a.add_(c).sub_(c).copysign_(y)


def te_scale_from_amax(
    amax: torch.Tensor, max_fp8: float, power_of_two: bool = False, eps: float = 0.0
) -> torch.Tensor:
    """TE's compute_scale_from_amax, elementwise over fp32 amaxes (current and block scaling).

    amax is floored at eps; amax 0, inf or NaN gives scale 1; an fp32-overflowing scale becomes
    FLT_MAX; power_of_two rounds the scale DOWN to a power of two by keeping sign and exponent bits.
    """
    amax = torch.clamp(amax.float(), min=eps)  # a new tensor; NaN stays NaN
    # amax 0 divides as inf does, so that exactly the amaxes 0, +-inf and NaN give a quotient of 0 or NaN
    # (fp8_max over a finite amax is never 0); fp32 division as TE's
    scale = torch.full_like(amax, max_fp8) / amax.masked_fill_(amax == 0, math.inf)
    scale = torch.nan_to_num_(scale, nan=0.0, posinf=FP32_MAX, neginf=FP32_MAX)
    scale = scale.masked_fill_(scale == 0, 1.0)
    if power_of_two:
        scale = (scale.view(torch.int32) & (0xFF800000 - (1 << 32))).view(torch.float32)
    return scale


@dataclass
class QuantizedTensor:
    """An emulated FP8 tensor: raw FP8 data, its per-block scale_inv and the block shape."""

    data: torch.Tensor
    """FP8 payload with the shape of the original 2-D (or flattened 2-D) tensor."""
    scale_inv: torch.Tensor
    """fp32 dequantization multipliers, one per block: [ceil(rows/br), ceil(cols/bc)]."""
    block: tuple[int, int]
    """(rows, cols) of one scaling block; per-tensor scaling uses the tensor's own shape."""
    shape: torch.Size
    """Original shape (data is reshaped back to it by dequantize)."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * scale_inv in fp32 (then cast to dtype), with the original shape."""
        q = self.data.float()
        rows, cols = q.shape
        block = _fit(self.block, rows, cols)
        if _tiles(rows, cols, block) and self.scale_inv.numel() == (rows // block[0]) * (cols // block[1]):
            out = (_blocked(q, block) * _per_block_view(self.scale_inv, rows, cols, block)).reshape(rows, cols)
        else:
            out = q * _expand_blocks(self.scale_inv, self.block, rows, cols)
        return out.reshape(self.shape).to(dtype)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """Flatten leading dims: quantization blocks run along the last dim and over tokens."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _expand_blocks(per_block: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Broadcast a per-block tensor back to element resolution, cropped to rows x cols."""
    br, bc = block
    full = per_block.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return full[:rows, :cols]


def _fit(block: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """The block cut down to a dimension it alone covers: the same blocks (zero padding never wins an amax), often no ragged edge."""
    return min(block[0], rows) or block[0], min(block[1], cols) or block[1]


def _tiles(rows: int, cols: int, block: tuple[int, int]) -> bool:
    """Whether (br x bc) blocks tile a non-empty rows x cols tensor exactly (no ragged edge)."""
    return rows > 0 and cols > 0 and rows % block[0] == 0 and cols % block[1] == 0


def _blocked(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A tiled 2-D tensor as [row blocks, br, col blocks, bc]: per-block values then broadcast instead of being expanded."""
    rows, cols = x2d.shape
    return x2d.reshape(rows // block[0], block[0], cols // block[1], block[1])


def _per_block_view(per_block: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-block values [nr, nc] shaped [nr, 1, nc, 1] to broadcast against _blocked(x2d)."""
    return per_block.reshape(rows // block[0], 1, cols // block[1], 1)


def block_amax(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block max |x| of a 2-D fp32 tensor; ragged edges are zero-padded (padding never wins)."""
    rows, cols = x2d.shape
    br, bc = _fit(block, rows, cols)
    pr, pc = -rows % br, -cols % bc
    a = _abs_no_nan(x2d)
    if pr or pc:
        a = torch.nn.functional.pad(a, (0, pc, 0, pr))
    nr, nc = a.shape[0] // br, a.shape[1] // bc
    return a.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def _abs_no_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN read as 0: TE's amax kernels use fmaxf, which skips NaN operands."""
    # abs always allocates, so the NaN replacement may work in place; +-inf must stay inf
    return _f32(x).abs().nan_to_num_(nan=0.0, posinf=math.inf)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| over the whole tensor as TE computes it (NaN ignored, 0 for empty tensors)."""
    return _abs_no_nan(x).amax() if x.numel() else torch.zeros((), device=x.device)


def _block_scales(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """fp32 scales as [row blocks, col blocks] (an empty tensor keeps its one per-tensor scale as given)."""
    n_blocks = (-(-rows // block[0]), -(-cols // block[1]))
    scale = scale.float()
    if scale.numel() == n_blocks[0] * n_blocks[1]:
        scale = scale.reshape(n_blocks)
    return scale


def _fake_with_scale(x2d: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     fmt: Fp8Format) -> torch.Tensor:
    """fp32 round_to_fp8(x2d * scale) * scale_inv per block: quantize_with_scale(...).dequantize() without the FP8 payload."""
    rows, cols = x2d.shape
    block = _fit(block, rows, cols)
    if block == (rows, cols):  # one scale [1, 1] broadcasts as it is
        return _round_to_fp8_(x2d * scale, fmt).mul_(scale_inv)
    if _tiles(rows, cols, block):
        q = _round_to_fp8_(_blocked(x2d, block) * _per_block_view(scale, rows, cols, block), fmt)
        return q.mul_(_per_block_view(scale_inv, rows, cols, block)).reshape(rows, cols)
    q = _round_to_fp8_(x2d * _expand_blocks(scale, block, rows, cols), fmt)
    return q.mul_(_expand_blocks(scale_inv, block, rows, cols))


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fmt: Fp8Format) -> QuantizedTensor:
    """TE-convention quantization with given per-block fp32 scales: q = cast(x * scale), scale_inv = 1/scale."""
    x2d = _as_2d(x).float()
    rows, cols = x2d.shape
    scale = _block_scales(scale, rows, cols, block)
    fit = _fit(block, rows, cols)
    if _tiles(rows, cols, fit):
        y = _blocked(x2d, fit) * _per_block_view(scale, rows, cols, fit)
        q = cast_to_fp8(y.reshape(rows, cols), fmt)
    else:
        q = cast_to_fp8(x2d * _expand_blocks(scale, block, rows, cols), fmt)
    return QuantizedTensor(q, torch.reciprocal(scale), block, x.shape)


def _current_scale(x2d: torch.Tensor, fmt: Fp8Format, power_of_two: bool, eps: float, amax: Optional[torch.Tensor]) -> torch.Tensor:
    """[1, 1] per-tensor current-scaling scale of x2d (or of the given amax)."""
    if amax is None:
        amax = tensor_amax(x2d)
    return te_scale_from_amax(amax.reshape(1, 1), fp8_max(fmt), power_of_two, eps)


def quantize_current(x: torch.Tensor, fmt: Fp8Format = "e4m3", power_of_two: bool = False, eps: float = 0.0,
                     amax: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Per-tensor current scaling (TE Float8CurrentScaling); `amax` overrides the local amax (TP reduction)."""
    x2d = _as_2d(x)
    scale = _current_scale(x2d, fmt, power_of_two, eps, amax)
    return quantize_with_scale(x, scale, _whole(x2d), fmt)


def fake_quantize_current(x: torch.Tensor, fmt: Fp8Format = "e4m3", power_of_two: bool = False, eps: float = 0.0,
                          amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quantize_current(x, ...).dequantize(torch.float32), computed without the FP8 payload (same bits)."""
    x2d = _f32(_as_2d(x))
    scale = _current_scale(x2d, fmt, power_of_two, eps, amax)
    return _fake_with_scale(x2d, scale, torch.reciprocal(scale), _whole(x2d), fmt).reshape(x.shape)


def _whole(x2d: torch.Tensor) -> tuple[int, int]:
    """Block shape covering the whole 2-D tensor (at least 1 x 1, so empty tensors work)."""
    return max(1, x2d.shape[0]), max(1, x2d.shape[1])


def quantize_blockwise_te(x: torch.Tensor, block: tuple[int, int], fmt: Fp8Format = "e4m3",
                          power_of_two: bool = True, eps: float = 0.0) -> QuantizedTensor:
    """TE Float8BlockScaling: independent scale per (br x bc) block of the 2-D view of x.

    Use (1, 128) for the row-wise copy of activations and gradients, (128, 1) for their
    column-wise copy (wgrad GEMM: 128 tokens per block), (128, 128) for weights. TE's default is
    power-of-two scales; FP32 scales need NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 on the GPU.
    """
    x2d = _as_2d(x)
    scale = te_scale_from_amax(block_amax(x2d, block), fp8_max(fmt), power_of_two, eps)
    return quantize_with_scale(x, scale, block, fmt)


def fake_quantize_blockwise_te(x: torch.Tensor, block: tuple[int, int], fmt: Fp8Format = "e4m3",
                               power_of_two: bool = True, eps: float = 0.0) -> torch.Tensor:
    """quantize_blockwise_te(x, ...).dequantize(torch.float32), computed without the FP8 payload (same bits)."""
    x2d = _f32(_as_2d(x))
    rows, cols = x2d.shape
    scale = _block_scales(te_scale_from_amax(block_amax(x2d, block), fp8_max(fmt), power_of_two, eps), rows, cols, block)
    return _fake_with_scale(x2d, scale, torch.reciprocal(scale), block, fmt).reshape(x.shape)


def float_to_e8m0(v: torch.Tensor) -> torch.Tensor:
    """TE's float_to_e8m0: biased exponent of v rounded UP to a power of two (uint8 stored in int32).

    NaN -> 255, inf -> 254, 0 -> 0; a nonzero mantissa bumps the exponent unless it is already
    254 or v is a subnormal no larger than 2^-127.
    """
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
    """Quantization multiplier 2^(127 - e) of a biased E8M0 exponent (NaN for 255, as TE's exp2f_rcp)."""
    scale = torch.exp2((127 - e).float())
    return torch.where(e == 0xFF, torch.full_like(scale, float("nan")), scale)


def _mxfp8_exponents(x2d: torch.Tensor, fmt: Fp8Format, block: tuple[int, int]) -> torch.Tensor:
    """Biased E8M0 exponent per block: float_to_e8m0(amax * fp32(1/fp8_max))."""
    rcp = torch.tensor(1.0 / fp8_max(fmt), dtype=torch.float32)
    return float_to_e8m0(block_amax(x2d, block) * rcp)


def quantize_mxfp8(x: torch.Tensor, fmt: Fp8Format = "e4m3", block: tuple[int, int] = (1, 32)) -> QuantizedTensor:
    """MXFP8: per 1x32 block (32x1 for the column-wise copy) e = float_to_e8m0(amax * fp32(1/fp8_max)), q = cast(x * 2^(127-e))."""
    e = _mxfp8_exponents(_as_2d(x), fmt, block)
    q = quantize_with_scale(x, e8m0_to_scale(e), block, fmt)
    # scale_inv = 2^(e - 127) exactly (1/2^(127-e) is exact for every e TE produces but 255).
    q.scale_inv = torch.exp2((e - 127).float())
    return q


def fake_quantize_mxfp8(x: torch.Tensor, fmt: Fp8Format = "e4m3", block: tuple[int, int] = (1, 32)) -> torch.Tensor:
    """quantize_mxfp8(x, ...).dequantize(torch.float32), computed without the FP8 payload (same bits)."""
    x2d = _f32(_as_2d(x))
    rows, cols = x2d.shape
    e = _mxfp8_exponents(x2d, fmt, block)
    scale = _block_scales(e8m0_to_scale(e), rows, cols, block)
    scale_inv = _block_scales(torch.exp2((e - 127).float()), rows, cols, block)
    return _fake_with_scale(x2d, scale, scale_inv, block, fmt).reshape(x.shape)


def fake_quantize(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Dequantized value of q in x's dtype (what a fake-quant GEMM consumes)."""
    return q.dequantize(x.dtype)


class DelayedScaler:
    """TE DelayedScaling state of one tensor role: amax history and the scale derived from it.

    A tensor is quantized with the scale computed from the amaxes of *earlier* tensors; its own
    amax then enters the history (TE records amax in the forward and updates at autocast exit).
    scale = (fp8_max * 2^-margin) / amax_h where amax_h is the newest entry (most_recent) or the
    max over the window (max, NaN ignored like fmaxf); a non-finite or zero amax_h keeps the
    previous scale; an overflowing scale becomes FLT_MAX. The initial scale is 1.
    """

    def __init__(self, fmt: Fp8Format, history_len: int = 1, algo: str = "most_recent", margin: int = 0):
        """Empty history, scale 1."""
        if algo not in ("most_recent", "max"):
            raise ValueError(f"amax_compute_algo must be most_recent or max, got {algo!r}")
        self.fmt = fmt
        self.history_len = int(history_len)
        self.algo = algo
        self.margin = int(margin)
        self.history: list[float] = []
        self.scale = torch.ones((), dtype=torch.float32)

    def quantize(self, x: torch.Tensor, update: bool = True, amax: Optional[torch.Tensor] = None) -> QuantizedTensor:
        """Quantize x with the current scale, then (if update) record x's amax and refresh the scale."""
        x2d = _as_2d(x)
        q = quantize_with_scale(x, self.scale.reshape(1, 1), _whole(x2d), self.fmt)
        if update:
            if amax is None:
                amax = tensor_amax(x2d)
            self.update(float(amax))
        return q

    def fake_quantize(self, x: torch.Tensor, update: bool = True, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
        """quantize(x, update, amax).dequantize(torch.float32), computed without the FP8 payload (same bits, same update)."""
        x2d = _f32(_as_2d(x))
        scale = self.scale.reshape(1, 1)
        out = _fake_with_scale(x2d, scale, torch.reciprocal(scale), _whole(x2d), self.fmt).reshape(x.shape)
        if update:
            if amax is None:
                amax = tensor_amax(x2d)
            self.update(float(amax))
        return out

    def update(self, amax: float) -> None:
        """Push one amax into the history and recompute the scale."""
        self.history = ([float(amax)] + self.history)[: self.history_len]
        if self.algo == "most_recent":
            a = self.history[0]
        else:
            a = 0.0
            for h in self.history:
                if not math.isnan(h):
                    a = max(a, h)
        scaled_max = torch.tensor(fp8_max(self.fmt), dtype=torch.float32) / torch.tensor(2.0 ** self.margin, dtype=torch.float32)
        amax_t = torch.tensor(a, dtype=torch.float32)
        if math.isfinite(a) and a > 0:
            scale = scaled_max / amax_t
            self.scale = torch.where(torch.isinf(scale), torch.tensor(FP32_MAX, dtype=torch.float32), scale)

    def state_dict(self) -> dict:
        """History and scale, for checkpoints."""
        return {"history": list(self.history), "scale": float(self.scale)}

    def load_state_dict(self, state: dict) -> None:
        """Restore history and scale."""
        self.history = list(state["history"])
        self.scale = torch.tensor(state["scale"], dtype=torch.float32)
