"""The op digest recorder behind tools/op_digest.py (megatron_rl/tracking/op_digest.py): every ATen call is recorded
with digests of its inputs and output, saved calls replay on exactly the inputs they had (same strides, also for
views into a larger buffer), and a changed input or output is found."""
from __future__ import annotations

import torch

from megatron_rl.tracking.op_digest import (OpDigestMode, digest, first_divergence, load_calls, replay_calls,
                                            save_calls)


def _work(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    qkv = x @ w                       # [4, 24]
    q, k = qkv[:, :8], qkv[:, 8:16]   # views into qkv: strides (24, 1), offsets 0 and 8
    return torch.softmax(q @ k.t(), dim=-1).sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 16, generator=g), torch.randn(16, 24, generator=g)


def test_records_repeat_and_saved_calls_replay_bitwise(tmp_path):
    x, w = _inputs()
    with OpDigestMode(keep=1) as first:
        _work(x, w)
    with OpDigestMode() as second:
        _work(x, w)
    assert [r.op for r in first.records][:1] == ["aten.mm.default"] and len(first.records) >= 4
    assert first.records == second.records and first_divergence(first.records, second.records) is None
    left_out = save_calls(first.calls, str(tmp_path / "calls.pt"))
    calls = load_calls(str(tmp_path / "calls.pt"))
    assert not left_out and len(calls) == len(first.calls) >= 3
    # a view keeps its offset and strides: the second mm's k.t() is a strided view into qkv
    views = [a for c in calls for a in c.args if isinstance(a, torch.Tensor) and a.storage_offset() == 8]
    assert views and views[0].stride() in ((1, 24), (24, 1))
    assert all(same for _, same in replay_calls(calls))


def test_a_changed_input_or_output_is_found(tmp_path):
    x, w = _inputs()
    with OpDigestMode(keep=1) as mode:
        _work(x, w)
    save_calls(mode.calls, str(tmp_path / "calls.pt"))
    calls = load_calls(str(tmp_path / "calls.pt"))
    calls[0].args[0][0, 0] += 1e-6  # one input bit pattern changes: that call's replay must differ
    results = replay_calls(calls)
    assert not results[0][1] and all(same for _, same in results[1:])
    w2 = w.clone()
    w2[3, 5] = 7.0
    with OpDigestMode() as other:
        _work(x, w2)
    diverged = first_divergence(other.records, mode.records)
    assert diverged is not None and diverged.index == 0 and diverged.op == "aten.mm.default"


def test_digest_sees_bits_shape_and_dtype_not_object_addresses():
    t = torch.arange(6.0)
    assert digest(t) == digest(t.clone()) != digest(t.reshape(2, 3)) != digest(t.double())
    assert digest([t, None, 3, object()]) == digest([t, None, 3, object()])
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
