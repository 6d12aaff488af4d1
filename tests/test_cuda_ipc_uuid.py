"""CUDA-IPC payloads name their GPU by UUID; a reader maps it back to its own device index as SGLang's
monkey_patch_torch_reductions does (srt/utils/patch_torch.py), through SGLang's function when sglang imports and the
project's equivalent otherwise. The mapping and the unpickling path are checked here on CPU (the rebuild is a stub)."""
import pickle
import sys
import types

import pytest
from torch.multiprocessing import reductions

from megatron_rl.rollout.sync import serialization
from megatron_rl.rollout.sync.serialization import DEVICE_ARG, device_index_from_uuid, patch_torch_reductions

UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]


def test_a_uuid_maps_to_the_index_this_process_sees_it_at():
    assert device_index_from_uuid("GPU-cccc", UUIDS) == 2
    assert device_index_from_uuid("GPU-cccc", list(reversed(UUIDS))) == 0  # another CUDA_VISIBLE_DEVICES order
    assert device_index_from_uuid(1, UUIDS) == 1  # an index (an unpatched sender) passes through
    with pytest.raises(ValueError, match="Invalid device_uuid=GPU-dddd"):  # SGLang's text for a GPU not seen
        device_index_from_uuid("GPU-dddd", UUIDS)
    with pytest.raises(ValueError, match="Unknown type"):
        device_index_from_uuid(1.0, UUIDS)


class _Handle:
    """Pickles as torch's CUDA tensor handle does: a call of reductions.rebuild_cuda_tensor, found by name on load."""

    def __init__(self, device):
        self.device = device

    def __reduce__(self):
        return reductions.rebuild_cuda_tensor, (*range(DEVICE_ARG), self.device, "tail")


@pytest.fixture
def unpatched(monkeypatch):
    """torch's reductions as before the test, whatever it patches; no sglang importable."""
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", reductions.rebuild_cuda_tensor)
    monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original", None, raising=False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang... raises ImportError
    return monkeypatch


def test_the_projects_patch_maps_the_uuid_while_unpickling(unpatched):
    blob = pickle.dumps([("w", _Handle("GPU-bbbb"))])  # pickled before any patch, as the learner does
    assert patch_torch_reductions() == "megatron_rl"
    assert patch_torch_reductions() == "megatron_rl"  # idempotent: the original is wrapped once
    seen = []
    unpatched.setattr(reductions, "_rebuild_cuda_tensor_original", lambda *args: seen.append(args) or "tensor")
    unpatched.setattr(serialization, "visible_device_uuids", lambda: UUIDS)
    assert pickle.loads(blob) == [("w", "tensor")]
    assert seen == [(*range(DEVICE_ARG), 1, "tail")]  # index 1, the rest of the arguments untouched
    with pytest.raises(ValueError, match="Invalid device_uuid=GPU-zzzz"):
        pickle.loads(pickle.dumps(_Handle("GPU-zzzz")))


def test_sglangs_own_patch_is_used_when_sglang_imports(unpatched):
    calls = []
    module = types.ModuleType("sglang.srt.utils.patch_torch")
    module.monkey_patch_torch_reductions = lambda: calls.append(1)
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        unpatched.setitem(sys.modules, name, types.ModuleType(name))
    unpatched.setitem(sys.modules, "sglang.srt.utils.patch_torch", module)
    before = reductions.rebuild_cuda_tensor
    assert patch_torch_reductions() == "sglang" and calls == [1]
    assert reductions.rebuild_cuda_tensor is before  # the project's patch stays out of SGLang's way
