"""FP4 operand rules of the fake-quant linear (recipes nvfp4 and mxfp4), as TE's NVFP4BlockScaling applies them.

GEMM by GEMM (fp32 accumulation of dequantized operands, like the FP8 emulation in linear.py):

    fprop  Y  = X_row @ W^T          X: 1xB blocks along K, round-to-nearest-even
    dgrad  dX = dY_row @ W           dY: 1xB blocks along N, stochastic rounding
    wgrad  dW = dY_col^T @ X_col     Bx1 blocks along tokens; both operands first multiplied, per
                                     16-token chunk, by the random-sign Hadamard (fp4_hadamard_wgrad)

B = 16 (nvfp4) or 32 (mxfp4). nvfp4 weights use 16x16 2-D blocks, so fprop and dgrad share one
copy (W and W^T hold the same values); mxfp4 weights, like MXFP8's, use 1x32 blocks along `in`
for fprop and 32x1 along `out` for dgrad. Each copy of X and dY has its own per-tensor amax (after
the Hadamard transform for the wgrad copies, as TE's post-RHT amax). Under TP the per-tensor scales
are those of the local tensor, as on TE: the sequence-parallel input of a column-parallel layer
and the output gradient of a row-parallel one are quantized after the all-gather, which is the
full tensor (TE reduces their amax over TP for the same result); shards of weights and of the
other operands keep their own amax.

Stochastic rounding is reproducible: the uniforms of a backward pass are drawn from a generator
seeded with (precision.fp4_seed, the module's stream salt, the count of its backward passes, the
operand copy). The salt names the module by its global layer number and name (set after the
model is built, `assign_fp4_streams`), so pipeline layouts draw identical streams; the counter is
checkpointed with the module (extra state), so a resumed run repeats the uninterrupted one bitwise.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import fp4


def _mix(*values: int) -> int:
    """Stable 63-bit hash of small integers (splitmix64 steps): seeds independent generator streams."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


class Fp4ModuleQuantizer:
    """Per-module FP4 state and rules (same interface as linear.ModuleQuantizer)."""

    fwd_fmt = grad_fmt = "e2m1"
    """Operand format names (FP8 recipes use them to pick E4M3/E5M2; here both are E2M1)."""
    amax_group = None
    """Unused: FP4 recipes keep no amax history."""

    def __init__(self, cfg: PrecisionConfig):
        """Rules of cfg.recipe (nvfp4 or mxfp4) with the FP4 options of cfg."""
        if not cfg.fp4_enabled:
            raise ValueError(f"Fp4ModuleQuantizer needs an FP4 recipe (nvfp4, mxfp4), got {cfg.recipe!r}")
        self.recipe = cfg.recipe
        self.block_len = fp4.NVFP4_BLOCK if cfg.recipe == "nvfp4" else fp4.MXFP4_BLOCK
        self.hadamard = bool(cfg.fp4_hadamard_wgrad)
        self.stochastic = bool(cfg.fp4_stochastic_rounding)
        self.seed = int(cfg.fp4_seed)
        self.salt = 0
        """Names this module's stochastic-rounding streams (assign_fp4_streams)."""
        self.backward_calls = 0
        """Backward passes quantized so far: the position in the stream (checkpointed)."""

    def _quantize(self, x2d: torch.Tensor, block: fp4.Block, stream: Optional[int]) -> torch.Tensor:
        """Dequantized fp32 copy of x2d; stochastic rounding from stream `stream` unless it is None."""
        uniforms = None
        if stream is not None:
            g = torch.Generator(device=x2d.device)
            g.manual_seed(_mix(self.seed, self.salt, self.backward_calls, stream))
            uniforms = torch.rand(fp4.padded_shape(tuple(x2d.shape), block), generator=g, device=x2d.device)
        return fp4.fake_quantize(x2d, self.recipe, block, uniforms)

    def operand_pair(self, role: str, x2d: torch.Tensor, fmt=None, update: bool = True,
                     amax: Optional[torch.Tensor] = None, columnwise: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(row-wise, column-wise) dequantized copies of a [tokens, features] input ("input") or output gradient ("grad").

        The column-wise (wgrad) copy has its token rows zero-padded to a multiple of 16 when the
        Hadamard transform is on (both wgrad operands alike, so their product is unchanged); it is
        None when `columnwise` is False (no wgrad follows). `fmt`, `update` and `amax` belong to the
        FP8 interface and are ignored.
        """
        n = self.block_len
        sr = role == "grad" and self.stochastic
        row = self._quantize(x2d, (1, n), 0 if sr else None)
        col = None
        if columnwise:
            col_in = fp4.hadamard_along_rows(x2d) if self.hadamard else x2d
            col = self._quantize(col_in, (n, 1), 1 if sr else None)
        if role == "grad":
            self.backward_calls += 1
        return row, col

    def weight_pair(self, w: torch.Tensor, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(fprop, dgrad) dequantized copies of a [out, in] weight (one shared 16x16-block copy under nvfp4)."""
        if self.recipe == "nvfp4":
            q = self._quantize(w, (fp4.NVFP4_BLOCK, fp4.NVFP4_BLOCK), None)
            return q, q
        return self._quantize(w, (1, self.block_len), None), self._quantize(w, (self.block_len, 1), None)

    def state_dict(self) -> dict:
        """The stochastic-rounding stream position (checkpointed as the module's extra state)."""
        return {"fp4_backward_calls": self.backward_calls}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stream position."""
        self.backward_calls = int(state["fp4_backward_calls"])


def stream_salt(layer_number: int, name: str) -> int:
    """Salt of a module's streams from its global layer number and its name inside the layer (stable across processes)."""
    return _mix(int(layer_number), zlib.crc32(name.encode()))


def assign_fp4_streams(model: torch.nn.Module) -> int:
    """Give every FP4-quantized linear inside a transformer layer its own stream salt; returns how many were named.

    Layers are found by megatron's global, 1-based `layer_number`, so every pipeline layout (and
    every TP rank, which must round replicated tensors alike) names a module the same way.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    named = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        number = layer.layer_number
        for name, module in layer.named_modules():
            quant = getattr(module, "fp8_quant", None)
            if isinstance(quant, Fp4ModuleQuantizer):
                quant.salt = stream_salt(number, name)
                named += 1
    return named
