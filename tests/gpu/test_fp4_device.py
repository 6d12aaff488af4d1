"""FP4 on a GPU: the emulation is device-correct (CUDA equals CPU bit for bit), and on Blackwell with TE >= 2.8
TE's NVFP4 quantizer agrees with `fake_quant_fp4` (not bitwise: TE multiplies by a reciprocal scale where
docs/FACTS.md divides, see precision/fp4.py). Skipped without CUDA.

Run: pytest -q -m gpu tests/gpu/test_fp4_device.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import fake_quant_fp4
from megatron_rl.precision.linear import fake_quant_linear, make_quantizer

pytestmark = [pytest.mark.gpu]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tensor(rows: int = 64, cols: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[0, :16] = 0.0
    return x


@needs_cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_emulation_is_the_same_on_cuda_and_cpu(fmt):
    x = _tensor()
    for axis in (-1, 0):
        cpu = fake_quant_fp4(x, fmt, axis)
        gpu = fake_quant_fp4(x.cuda(), fmt, axis)
        assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    cfg = PrecisionConfig(recipe=fmt, fp4_stochastic_rounding=False)
    w = torch.randn(96, 200, generator=torch.Generator().manual_seed(1)) * 0.05
    outs = {}
    for dev in ("cpu", "cuda"):
        xg, wg = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        y = fake_quant_linear(xg, wg, None, make_quantizer(cfg))
        y.backward(torch.ones_like(y))
        outs[dev] = (y.detach().cpu(), xg.grad.cpu(), wg.grad.cpu())
    for a, b in zip(outs["cpu"], outs["cuda"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # GEMM summation order differs by device
    # stochastic rounding on CUDA is reproducible from the seed
    sr = [fake_quant_linear(x.cuda(), w.cuda().requires_grad_(), None, make_quantizer(PrecisionConfig(recipe=fmt)))
          for _ in range(2)]
    assert torch.equal(sr[0], sr[1])


@needs_cuda
def test_te_nvfp4_quantizer_agrees_with_the_emulation():
    te_recipe = pytest.importorskip("transformer_engine.common.recipe")
    if not hasattr(te_recipe, "NVFP4BlockScaling") or torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("needs TE >= 2.8 and a Blackwell GPU")
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    x = _tensor(128, 256).to(torch.bfloat16)
    te_val = NVFP4Quantizer(rowwise=True, columnwise=False)(x.cuda()).dequantize().float().cpu()
    ours = fake_quant_fp4(x.float(), "nvfp4")
    same = (te_val == ours).float().mean().item()
    assert same > 0.99, same
    torch.testing.assert_close(te_val, ours, rtol=0.35, atol=1e-6)  # a rare differing element is one E2M1 step off
