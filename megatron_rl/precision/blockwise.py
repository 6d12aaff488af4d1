"""Rollout-side FP8 quantizers in the DeepSeek/SGLang checkpoint convention (divide by scale_inv).

``scale_inv = max(amax, 1e-10) / 448`` per block in fp32 (``ue8m0``: rounded UP to the next
power of two), ``q = clamp(x / scale_inv, -448, 448) -> float8_e4m3fn`` (round-to-nearest-even),
dequantized as ``q * scale_inv``. The trainer quantizes exported weights with exactly these
functions and the CPU rollout server reads the same bits back, so both sides hold identical
FP8 weights (docs/FACTS.md: quantize trainer and rollout copies from identical bits).
"""
from __future__ import annotations

from typing import Literal

import torch

from megatron_rl.precision.numerics import (
    E4M3_MAX,
    _abs_no_nan,
    _blocked,
    _expand_blocks,
    _f32,
    _fit,
    _per_block_view,
    _round_to_fp8_,
    _tiles,
    block_amax,
)

ScaleFmt = Literal["fp32", "ue8m0"]

AMAX_FLOOR = 1e-10
"""Floor of a block's amax, so all-zero blocks get a finite scale_inv."""


def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 s) for positive finite fp32 s, exact (frexp, no log rounding)."""
    mant, exp = torch.frexp(s.float())
    exact = mant == 0.5
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), torch.where(exact, exp - 1, exp))


def _scale_inv(amax: torch.Tensor, scale_fmt: ScaleFmt) -> torch.Tensor:
    """Per-block scale_inv from per-block amax."""
    s = torch.clamp(_f32(amax), min=AMAX_FLOOR).div_(E4M3_MAX)  # fp32 division by 448, as by a 0-d fp32 tensor
    if scale_fmt == "ue8m0":
        s = round_up_pow2(s)
    elif scale_fmt != "fp32":
        raise ValueError(f"scale_fmt must be 'fp32' or 'ue8m0', got {scale_fmt!r}")
    return s


def _quantize_2d(x2d: torch.Tensor, block: tuple[int, int], scale_fmt: ScaleFmt) -> tuple[torch.Tensor, torch.Tensor]:
    """q and per-block scale_inv of a 2-D tensor."""
    rows, cols = x2d.shape
    s = _scale_inv(block_amax(x2d, block), scale_fmt)
    fit = _fit(block, rows, cols)
    if _tiles(rows, cols, fit):  # per-block scales broadcast over a block view, no expanded copy
        q = (_blocked(_f32(x2d), fit) / _per_block_view(s, rows, cols, fit)).reshape(rows, cols)
    else:
        q = x2d.float() / _expand_blocks(s, block, rows, cols)
    return q.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: ScaleFmt = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight [out, in], fp32 scale_inv [ceil(out/b0), ceil(in/b1)]) of a 2-D weight."""
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D weight, got shape {tuple(w.shape)}")
    return _quantize_2d(w, tuple(block), scale_fmt)


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale_inv (broadcast over blocks, fp32 product) in dtype."""
    rows, cols = q.shape
    fit = _fit(tuple(block), rows, cols)
    if _tiles(rows, cols, fit) and scale_inv.numel() == (rows // fit[0]) * (cols // fit[1]):
        out = (_blocked(q.float(), fit) * _per_block_view(scale_inv.float(), rows, cols, fit)).reshape(rows, cols)
    else:
        out = q.float() * _expand_blocks(scale_inv.float(), tuple(block), rows, cols)
    return out.to(dtype)


def quantize_per_channel(w: torch.Tensor, scale_fmt: ScaleFmt = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """("fp8-channel") float8_e4m3fn weight and fp32 scale_inv [out, 1], one scale per output row."""
    if w.dim() != 2:
        raise ValueError(f"quantize_per_channel expects a 2-D weight, got shape {tuple(w.shape)}")
    return _quantize_2d(w, (1, w.shape[1]), scale_fmt)


def quantize_activation_groups(x: torch.Tensor, group: int = 128, scale_fmt: ScaleFmt = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token 1 x group activation quantization (SGLang's block-FP8 activations).

    Returns (q with x's shape, scale_inv [..., ceil(hidden/group)]).
    """
    x2d = x.reshape(-1, x.shape[-1])
    q, s = _quantize_2d(x2d, (1, group), scale_fmt)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], s.shape[-1])


def fake_quantize_activation_groups(x: torch.Tensor, group: int = 128, scale_fmt: ScaleFmt = "fp32") -> torch.Tensor:
    """dequant(quant(x)) for per-token 1 x group groups, in x's dtype."""
    cols = x.shape[-1]
    if cols <= group or cols % group == 0:
        # the groups tile each row: a [rows, groups, width] view broadcasts the scales instead of expanding them
        # (the rollout engine runs this on every linear of every decoding step); the same fp32 operations
        # element by element, so the same bits as the general path below (tests/precision/test_hf_fp8.py)
        xf = _f32(x)
        xg = xf.reshape(-1, 1, cols) if cols <= group else xf.reshape(-1, cols // group, group)
        s = _scale_inv(_abs_no_nan(xg).amax(dim=-1, keepdim=True), scale_fmt)
        out = _round_to_fp8_(xg / s, "e4m3").mul_(s).reshape(x.shape)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    q, s = quantize_activation_groups(x, group, scale_fmt)
    x2d = q.reshape(-1, x.shape[-1])
    out = dequantize_blockwise(x2d, s.reshape(x2d.shape[0], -1), (1, group))
    return out.reshape(x.shape).to(x.dtype)
