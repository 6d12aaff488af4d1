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


def te_scale_from_amax(
    amax: torch.Tensor, max_fp8: float, power_of_two: bool = False, eps: float = 0.0
) -> torch.Tensor:
    """TE's compute_scale_from_amax, elementwise over fp32 amaxes (current and block scaling).

    amax is floored at eps; amax 0, inf or NaN gives scale 1; an fp32-overflowing scale becomes
    FLT_MAX; power_of_two rounds the scale DOWN to a power of two by keeping sign and exponent bits.
    """
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
        s = _expand_blocks(self.scale_inv, self.block, rows, cols)
        return (q * s).reshape(self.shape).to(dtype)


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


def block_amax(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block max |x| of a 2-D fp32 tensor; ragged edges are zero-padded (padding never wins)."""
    br, bc = block
    rows, cols = x2d.shape
    pr, pc = -rows % br, -cols % bc
    a = torch.nn.functional.pad(_abs_no_nan(x2d), (0, pc, 0, pr))
    nr, nc = a.shape[0] // br, a.shape[1] // bc
    return a.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def _abs_no_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN read as 0: TE's amax kernels use fmaxf, which skips NaN operands."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| over the whole tensor as TE computes it (NaN ignored, 0 for empty tensors)."""
    return _abs_no_nan(x).amax() if x.numel() else torch.zeros(())


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fmt: Fp8Format) -> QuantizedTensor:
    """TE-convention quantization with given per-block fp32 scales: q = cast(x * scale), scale_inv = 1/scale."""
    x2d = _as_2d(x).float()
    rows, cols = x2d.shape
    n_blocks = (-(-rows // block[0]), -(-cols // block[1]))
    scale = scale.float()
    if scale.numel() == n_blocks[0] * n_blocks[1]:  # else an empty tensor with its one per-tensor scale
        scale = scale.reshape(n_blocks)
    q = cast_to_fp8(x2d * _expand_blocks(scale, block, rows, cols), fmt)
    return QuantizedTensor(q, torch.reciprocal(scale), block, x.shape)


def quantize_current(x: torch.Tensor, fmt: Fp8Format = "e4m3", power_of_two: bool = False, eps: float = 0.0,
                     amax: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Per-tensor current scaling (TE Float8CurrentScaling); `amax` overrides the local amax (TP reduction)."""
    x2d = _as_2d(x)
    if amax is None:
        amax = tensor_amax(x2d)
    scale = te_scale_from_amax(amax.reshape(1, 1), fp8_max(fmt), power_of_two, eps)
    return quantize_with_scale(x, scale, _whole(x2d), fmt)


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


def quantize_mxfp8(x: torch.Tensor, fmt: Fp8Format = "e4m3", block: tuple[int, int] = (1, 32)) -> QuantizedTensor:
    """MXFP8: per 1x32 block (32x1 for the column-wise copy) e = float_to_e8m0(amax * fp32(1/fp8_max)), q = cast(x * 2^(127-e))."""
    x2d = _as_2d(x)
    rcp = torch.tensor(1.0 / fp8_max(fmt), dtype=torch.float32)
    e = float_to_e8m0(block_amax(x2d, block) * rcp)
    q = quantize_with_scale(x, e8m0_to_scale(e), block, fmt)
    # scale_inv = 2^(e - 127) exactly (1/2^(127-e) is exact for every e TE produces but 255).
    q.scale_inv = torch.exp2((e - 127).float())
    return q


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
