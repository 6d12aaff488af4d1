"""The CPU compatibility layer: patch points still exist upstream, and each patch does its job."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.parallel import compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compat layer is inactive with CUDA")


@pytest.fixture
def enabled():
    """The layer installed (and left installed: other tests in the process rely on it)."""
    assert compat.enable_cpu_compat()
    yield
    compat.enable_cpu_compat()


def test_patch_points_exist_with_expected_signatures():
    """Fails after a megatron/torch upgrade that moves or re-signs a patched attribute."""
    compat.check_patch_points()


def test_enable_is_idempotent(enabled):
    """A second call installs nothing new (one mode on the stack, originals kept)."""
    mode, originals = compat._STATE["mode"], dict(compat._STATE["originals"])
    assert compat.enable_cpu_compat()
    assert compat._STATE["mode"] is mode and compat._STATE["originals"] == originals
    assert compat.cpu_compat_enabled()


def test_device_redirection(enabled):
    """device='cuda', 'cuda:0', ints and torch.device('cuda') all land on the CPU."""
    assert torch.device(torch.cuda.current_device()).type == "cpu"
    for device in ("cuda", "cuda:0", 0, torch.device("cuda")):
        assert torch.zeros(2, device=device).device.type == "cpu"
    x = torch.arange(3.0)
    assert x.to("cuda").device.type == "cpu"
    assert x.to(torch.float64).dtype == torch.float64
    assert x.cuda() is x and x.pin_memory() is x
    assert torch.tensor([1, 2], pin_memory=True).tolist() == [1, 2]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_type_string_reports_cuda(enabled):
    """megatron's optimizers compare param.type() with 'torch.cuda.FloatTensor'."""
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64


def test_rng_tracker_uses_cpu_generator(enabled):
    """model_parallel_cuda_manual_seed + tracker.fork() draw from seed+2718+tp_rank and restore the default stream."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    default = torch.get_rng_state()
    with mrandom.get_cuda_rng_tracker().fork():
        drawn = torch.rand(4)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(123 + 2718 + 1))
    torch.testing.assert_close(drawn, expected)
    assert torch.equal(torch.get_rng_state(), default)
    with mrandom.get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    assert not torch.equal(again, drawn)  # the tracked stream advanced


def test_missing_patch_point_is_reported(monkeypatch):
    """Removing or re-signing a patched megatron function makes check_patch_points() raise, naming it."""
    from megatron.core.tensor_parallel import random as mrandom

    was_enabled = compat.cpu_compat_enabled()
    compat.disable_cpu_compat()
    try:
        monkeypatch.delattr(mrandom, "_get_cuda_rng_state")
        with pytest.raises(RuntimeError, match="_get_cuda_rng_state is missing"):
            compat.check_patch_points()
        monkeypatch.undo()
        monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda state, idx: None)
        with pytest.raises(RuntimeError, match="_set_cuda_rng_state has parameters"):
            compat.check_patch_points()
        monkeypatch.undo()
        compat.check_patch_points()
    finally:
        if was_enabled:
            compat.enable_cpu_compat()


def test_disable_restores_originals():
    """disable_cpu_compat() puts every original back; enabling again re-installs."""
    compat.enable_cpu_compat()
    patched = torch.cuda.current_device
    originals = {name: fn for (_, name), (_, fn) in compat._STATE["originals"].items()}
    compat.disable_cpu_compat()
    try:
        assert torch.cuda.current_device is originals["current_device"]
        assert torch.ones(1).type() == "torch.FloatTensor"
    finally:
        compat.enable_cpu_compat()
    assert torch.cuda.current_device is not patched or torch.cuda.current_device() == torch.device("cpu")
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"


def test_mode_can_be_suspended(enabled):
    """Inside compat_mode_suspended() torch behaves natively; the mode is back afterwards."""
    with compat.compat_mode_suspended():
        assert torch.ones(1).type() == "torch.FloatTensor"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
