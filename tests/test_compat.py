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


# ------------------------------------------------------------------ where the mode is lifted
class _Recording(torch.overrides.TorchFunctionMode):
    """A plain mode that counts the torch calls reaching it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_lift_pops_only_the_compat_mode_and_nests(enabled):
    """compat_mode_suspended lifts the mode when it is innermost, nests, and leaves a mode pushed above it in charge."""
    with compat.compat_mode_suspended():
        with compat.compat_mode_suspended():
            assert torch.ones(1).type() == "torch.FloatTensor"
        assert torch.ones(1).type() == "torch.FloatTensor"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    with _Recording() as rec:
        with compat.compat_mode_suspended():
            torch.ones(1).type()  # ours is not innermost: nothing is lifted, both modes see the call
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert rec.calls >= 2
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"


def test_a_lifted_module_restores_the_mode_after_an_exception(enabled):
    """run_without_compat_mode: the forward runs without the mode; the mode is back after a normal or a failing forward."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, fail: bool):
            seen.append(torch.ones(1).type())
            if fail:
                raise ValueError("boom")
            return torch.zeros(1)

    probe = compat.run_without_compat_mode(Probe())
    probe(False)
    with pytest.raises(ValueError):
        probe(True)
    assert seen == ["torch.FloatTensor", "torch.FloatTensor"]
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, device="cuda").device.type == "cpu"


@pytest.fixture(scope="module")
def tiny_learner():
    """A world-1 tiny learner with tensorwise FP8 emulation (the mode's heaviest forward)."""
    import warnings

    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.parallel import state
    from megatron_rl.trainer.learner import Learner

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    lrn = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(lr=1e-3, clip_grad=1.0),
                  PrecisionConfig(recipe="tensorwise"), vocab_size=40, seed=3)
    yield lrn
    state.destroy_distributed()


def _batch():
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 40, (4, 8), generator=g), torch.randint(0, 40, (4, 8), generator=g)
    mask = torch.ones(4, 8)
    return TrainBatch(ids, labels, mask, torch.randn(4, 1).expand(4, 8).contiguous(), torch.zeros(4, 8),
                      token_weight=mask / mask.sum())


def test_learner_keeps_the_redirects_megatron_needs_and_lifts_the_rest(tiny_learner, monkeypatch):
    """In a train step and a log-prob pass the schedule's CUDA token counter and the optimizer's CUDA scalars and
    type() checks still go through the mode (lose one and this fails; the step would also raise), while no torch call
    made inside the transformer blocks reaches it."""
    import sys

    redirected, in_blocks = [], []
    original = compat._CudaToCpuMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        frame, files = sys._getframe(1), []
        while frame is not None and len(files) < 80:
            files.append(frame.f_code.co_filename)
            frame = frame.f_back
        if any(f.endswith("transformer/transformer_block.py") for f in files):
            in_blocks.append(func)
        device = (kwargs or {}).get("device")
        if (device is not None and compat._map_device(device) is not device) or func is compat._TENSOR_TYPE:
            redirected.append(next((f.split("megatron/core/")[-1] for f in files if "megatron/core/" in f), "elsewhere"))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(compat._CudaToCpuMode, "__torch_function__", spy)
    loss_fn = lambda lp, ent, mb, ctx: (-(lp * mb.advantages * mb.token_weight).sum(), {})  # noqa: E731
    metrics = tiny_learner.train_step(_batch(), loss_fn, 2)
    tiny_learner.forward_logprobs(_batch(), 2)
    assert metrics["update_skipped"] == 0.0
    assert in_blocks == []
    assert "pipeline_parallel/schedules.py" in redirected  # total_num_tokens = torch.zeros(..., device="cuda")
    assert "optimizer/clip_grads.py" in redirected  # grad-norm scalars on "cuda", param.type() == "torch.cuda.FloatTensor"


def test_lifting_the_mode_over_megatrons_schedule_fails_loudly(tiny_learner, monkeypatch):
    """The reason the mode is not lifted around the whole schedule: megatron asks for device='cuda' there."""
    from megatron.core import pipeline_parallel

    real = pipeline_parallel.get_forward_backward_func()

    def lifted(**kwargs):
        with compat.compat_mode_suspended():
            return real(**kwargs)

    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", lambda *a, **k: lifted)
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda"):
        tiny_learner.forward_logprobs(_batch(), 2)


def test_megatron_jit_fuser_is_off_without_cuda_from_the_first_import():
    """megatron_rl/jit_fuser_hook.py: a process that imports megatron_rl and then megatron.core gets megatron's own
    no-op decorator in every fusion module, and never imports torch._dynamo for them (~1.5 CPU-s a process); without
    the hook (megatron imported first) megatron's torch.compile decorators are there, so the test can fail."""
    import subprocess
    import sys

    probe = ("import sys\n{first}\nimport megatron.core\nimport megatron.core.jit as jit\n"
             "from megatron.core.fusions import fused_bias_geglu as geglu\n"
             "print(jit.jit_fuser is jit.noop_decorator, 'torch._dynamo' in sys.modules, "
             "geglu.geglu.__code__.co_filename.endswith('fused_bias_geglu.py'))\n")
    hooked = subprocess.run([sys.executable, "-c", probe.format(first="import megatron_rl")], capture_output=True,
                            text=True, check=True).stdout.split()
    assert hooked == ["True", "False", "True"]  # the decorated function is megatron's own code
    plain = subprocess.run([sys.executable, "-c", probe.format(first="")], capture_output=True, text=True,
                           check=True).stdout.split()
    assert plain == ["False", "True", "False"]  # torch.compile's wrapper
