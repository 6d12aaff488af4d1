"""The FP8 megatron ColumnParallelLinear/RowParallelLinear subclasses: single process and TP=2 (+SP) on gloo."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import high_precision
from megatron_rl.precision.linear import ModuleQuantizer, fake_quant_linear, fp8_parallel_linear_classes, make_quantizer

H, F, S, B = 256, 512, 8, 2  # TP shards of F are whole 128-blocks, so block scales match a single process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, tp: int) -> None:
    from megatron.core import parallel_state

    from megatron_rl.parallel.compat import enable_cpu_compat

    enable_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _teardown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _layers(cfg: PrecisionConfig, tp: int, sp: bool):
    from megatron.core.model_parallel_config import ModelParallelConfig

    col_cls, row_cls = fp8_parallel_linear_classes(cfg)
    mp = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True)
    init = torch.nn.init.zeros_
    col = col_cls(H, F, config=mp, init_method=init, bias=False, gather_output=False)
    row = row_cls(F, H, config=mp, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=False)
    return col, row


def _data():
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(F, H, generator=g) * 0.05
    w2 = torch.randn(H, F, generator=g) * 0.05
    x = torch.randn(S, B, H, generator=g) * torch.logspace(-1, 1, H)
    dy = torch.randn(S, B, H, generator=g) * 1e-2
    return w1, w2, x, dy


def _reference(cfg: PrecisionConfig):
    """Single-process fake-quant MLP (col then row) with its grads."""
    w1, w2, x, dy = _data()
    w1, w2, x = w1.requires_grad_(), w2.requires_grad_(), x.requires_grad_()
    h = fake_quant_linear(x, w1, None, ModuleQuantizer(cfg))
    y = fake_quant_linear(h, w2, None, ModuleQuantizer(cfg))
    y.backward(dy)
    return h.detach(), y.detach(), x.grad, w1.grad, w2.grad


def _tp_worker(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port, tp=world)
    try:
        cfg = PrecisionConfig(recipe="blockwise")
        h_ref, y_ref, gx_ref, gw1_ref, gw2_ref = _reference(cfg)
        w1, w2, x, dy = _data()
        fs = slice(rank * F // world, (rank + 1) * F // world)
        ss = slice(rank * S // world, (rank + 1) * S // world)

        def close(got, want):
            # partial sums over TP ranks change fp32 summation order; FP8 noise is ~1e3 x larger
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())

        for sp in (True, False):
            col, row = _layers(cfg, world, sp)
            with torch.no_grad():
                col.weight.copy_(w1[fs])
                row.weight.copy_(w2[:, fs])
            xin = (x[ss] if sp else x).clone().requires_grad_()
            h, _ = col(xin)
            y, _ = row(h)
            y.backward(dy[ss] if sp else dy)
            close(h, h_ref[..., fs])
            close(y, y_ref[ss] if sp else y_ref)
            close(xin.grad, gx_ref[ss] if sp else gx_ref)
            close(col.weight.grad, gw1_ref[fs])
            close(row.weight.grad, gw2_ref[:, fs])
            # and the check is sharp: the high-precision result is far outside the tolerance
            assert (y - (torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2)[ss] if sp else
                         torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2))).abs().max() > 1e-3 * y_ref.abs().max()
        # delayed scaling: all TP ranks share one scale per role, from the amax of the full tensor
        dcfg = PrecisionConfig(recipe="delayed")
        col, row = _layers(dcfg, world, True)
        with torch.no_grad():
            col.weight.copy_(w1[fs])
            row.weight.copy_(w2[:, fs])
        h, _ = col(x[ss].clone().requires_grad_())
        y, _ = row(h)
        y.backward(dy[ss])
        st = col.fp8_quant.state_dict()
        assert st["weight"]["scale"] == (torch.tensor(448.0) / w1.abs().max()).item()
        assert st["input"]["scale"] == (torch.tensor(448.0) / x.abs().max()).item()
        scales = torch.tensor([st[k]["scale"] for k in ("input", "weight", "grad")] +
                              [row.fp8_quant.state_dict()[k]["scale"] for k in ("input", "weight", "grad")])
        gathered = [torch.zeros_like(scales) for _ in range(world)]
        torch.distributed.all_gather(gathered, scales)
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        results[rank] = "ok"
    except Exception as e:  # reported by the parent
        results[rank] = repr(e)
        raise
    finally:
        _teardown()


@pytest.mark.slow
def test_tp2_with_and_without_sequence_parallel_matches_single_process():
    mp = torch.multiprocessing.get_context("spawn")
    results = mp.Manager().dict()
    torch.multiprocessing.start_processes(_tp_worker, args=(2, _free_port(), results), nprocs=2, start_method="spawn")
    assert dict(results) == {0: "ok", 1: "ok"}


def _fp4_shard_reference(cfg: PrecisionConfig, world: int):
    """Single-process FP4 computation of what a TP group computes: every shard quantized on its own.

    TE's per-tensor FP4 scale belongs to the local tensor (a weight shard, the row-parallel input
    shard, the column-parallel output-gradient shard), so TP=2 is not the unsharded computation;
    it is the sum over shards of per-shard fake-quant linears with identical rounding streams.
    """
    w1, w2, x, dy = _data()
    hs, y, gx, gw1, gw2 = [], 0, 0, [], []
    for r in range(world):
        fs = slice(r * F // world, (r + 1) * F // world)
        xr, w1r, w2r = x.clone().requires_grad_(), w1[fs].clone().requires_grad_(), w2[:, fs].clone().requires_grad_()
        h = fake_quant_linear(xr, w1r, None, make_quantizer(cfg))
        hd = h.detach().requires_grad_()
        yr = fake_quant_linear(hd, w2r, None, make_quantizer(cfg))
        yr.backward(dy)
        h.backward(hd.grad)
        hs.append(h.detach())
        y = y + yr.detach()
        gx = gx + xr.grad
        gw1.append(w1r.grad)
        gw2.append(w2r.grad)
    return torch.cat(hs, -1), y, gx, torch.cat(gw1, 0), torch.cat(gw2, 1)


def _tp_worker_fp4(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port, tp=world)
    try:
        cfg = PrecisionConfig(recipe="nvfp4", fp4_seed=5)
        h_ref, y_ref, gx_ref, gw1_ref, gw2_ref = _fp4_shard_reference(cfg, world)
        w1, w2, x, dy = _data()
        fs = slice(rank * F // world, (rank + 1) * F // world)
        ss = slice(rank * S // world, (rank + 1) * S // world)

        def close(got, want):
            # partial sums over TP ranks change fp32 summation order; FP4 noise is ~1e4 x larger
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())

        for sp in (True, False):
            col, row = _layers(cfg, world, sp)
            with torch.no_grad():
                col.weight.copy_(w1[fs])
                row.weight.copy_(w2[:, fs])
            xin = (x[ss] if sp else x).clone().requires_grad_()
            h, _ = col(xin)
            y, _ = row(h)
            y.backward(dy[ss] if sp else dy)
            close(h, h_ref[..., fs])
            close(y, y_ref[ss] if sp else y_ref)
            close(xin.grad, gx_ref[ss] if sp else gx_ref)
            close(col.weight.grad, gw1_ref[fs])
            close(row.weight.grad, gw2_ref[:, fs])
            # replicated tensors (row-parallel dY) are rounded alike on every rank: same stream position
            assert col.fp8_quant.backward_calls == row.fp8_quant.backward_calls == 1
        results[rank] = "ok"
    except Exception as e:  # reported by the parent
        results[rank] = repr(e)
        raise
    finally:
        _teardown()


@pytest.mark.slow
def test_fp4_tp2_with_and_without_sequence_parallel_matches_shard_reference():
    mp = torch.multiprocessing.get_context("spawn")
    results = mp.Manager().dict()
    torch.multiprocessing.start_processes(_tp_worker_fp4, args=(2, _free_port(), results), nprocs=2, start_method="spawn")
    assert dict(results) == {0: "ok", 1: "ok"}


@pytest.fixture
def single_process():
    _init(0, 1, _free_port(), tp=1)
    yield
    _teardown()


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"])
def test_single_process_layers_equal_fake_quant_and_high_precision_is_plain(single_process, recipe):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    cfg = PrecisionConfig(recipe=recipe)
    w1, _, x, _ = _data()
    col, _ = _layers(cfg, 1, False)
    plain = ColumnParallelLinear(H, F, config=ModelParallelConfig(use_cpu_initialization=True),
                                 init_method=torch.nn.init.zeros_, bias=False, gather_output=False)
    with torch.no_grad():
        col.weight.copy_(w1)
        plain.weight.copy_(w1)
    out, _ = col(x)
    assert torch.equal(out, fake_quant_linear(x, w1, None, make_quantizer(cfg)))
    with high_precision():
        hp, _ = col(x)
    assert torch.equal(hp, plain(x)[0])
    assert not torch.equal(hp, out)
    # delayed scaling keeps its state per module: the shadow pass did not touch it
    if recipe == "delayed":
        before = col.fp8_quant.state_dict()
        with high_precision():
            col(x)
        assert col.fp8_quant.state_dict() == before
        col2, _ = _layers(cfg, 1, False)
        assert col2.fp8_quant.state_dict()["input"]["history"] == []
