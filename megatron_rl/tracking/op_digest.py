"""A record of every ATen op a piece of code runs, with a digest of its inputs and outputs: to find which ops give
different bits under which CPU kernel setting (ATen capability, MKL CBWR, oneDNN ISA cap, threads).

    with OpDigestMode(keep=1) as mode:       # keep: how many calls per op signature to save for replay
        train_some_steps()
    mode.records                              # [OpRecord(index, op, inputs digest, output digest)]
    save_calls(mode.calls, "calls.pt")        # the saved calls (inputs cloned before the op ran)
    diffs = replay_calls(load_calls("calls.pt"))   # rerun them here: [(op, same_bits)]

Two records from different settings agree up to the first op whose output differs; after it every input differs,
so comparing records finds where a run first diverges, while replaying saved calls (same inputs, this process's
kernels) finds every op that is sensitive to a setting. `tools/op_digest.py` runs both over the first SFT steps
under each setting this machine can select and prints the table.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class OpRecord(NamedTuple):
    """One op call: its position in the run, its name, and digests of what went in and what came out."""

    index: int
    op: str
    inputs: str
    output: str


@dataclass
class SavedCall:
    """An op call kept for replay: the op's name, its inputs as they were before it ran, and its output digest."""

    index: int
    op: str
    args: Any
    kwargs: Any
    output: str


def _feed(h, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach()
        h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
        if t.layout == torch.strided and t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    elif x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
                                     torch.memory_format)):
        h.update(repr(x).encode())
    else:  # opaque objects (a collective's work handle, a process group) print their address: only their type counts
        h.update(type(x).__name__.encode())


def digest(tree: Any) -> str:
    """Hex digest of every tensor's shape, dtype and bytes (and every other leaf's repr) in a pytree."""
    h = hashlib.blake2b(digest_size=12)
    for leaf in tree_flatten(tree)[0]:
        _feed(h, leaf)
    return h.hexdigest()


def _signature(op: str, args: Any, kwargs: Any) -> tuple:
    leaves = tree_flatten((args, kwargs))[0]
    return (op, *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves))


def _clone(x: Any) -> Any:
    """A copy with the same memory layout: kernels pick their paths by strides (a q/k/v view into a fused buffer is
    not the contiguous tensor `.clone()` may give), so views keep their offset and strides in a copy of the storage."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach()
    if x.layout != torch.strided:
        return x.clone()
    if x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size():
        # the tensor is its whole storage (dense, nothing overlaps): a copy with the same strides is the same layout
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    out = torch.empty(0, dtype=x.dtype, device=x.device)
    return out.set_(x.untyped_storage().clone(), x.storage_offset(), x.size(), x.stride())


UNINITIALIZED = ("aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                 "aten.new_empty.default", "aten.new_empty_strided.default")
"""Ops whose output holds whatever was in memory: only its shape and dtype are digested."""


def replayable(func) -> bool:
    """Ops whose output can be a function of their inputs alone (not uninitialized memory, not profiler markers).

    Ops tagged nondeterministic_seeded are kept: most take a dropout probability that is 0 here (attention); one
    that really draws random numbers shows up as differing when the capturing process replays its own calls.
    """
    return str(func) not in UNINITIALIZED and not str(func).startswith("profiler.")


class OpDigestMode(TorchDispatchMode):
    """Records an OpRecord per ATen call made under it (forward, backward and optimizer alike); with `keep` > 0 also
    saves the inputs of the first `keep` calls of each (op, input shapes and dtypes) for replay."""

    def __init__(self, keep: int = 0, skip: Iterable[str] = ()) -> None:
        """`skip`: op names (e.g. 'aten.detach.default') neither recorded nor saved."""
        super().__init__()
        self.keep, self.skip = keep, set(skip)
        self.records: list[OpRecord] = []
        self.calls: list[SavedCall] = []
        self._seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in self.skip:
            return func(*args, **kwargs)
        inputs = digest((args, kwargs))
        saved = None
        if self.keep and replayable(func):
            sig = _signature(name, args, kwargs)
            if self._seen[sig] < self.keep:
                self._seen[sig] += 1
                saved = (tree_map(_clone, args), tree_map(_clone, kwargs))  # before an in-place op changes them
        out = func(*args, **kwargs)
        shown = tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, out) \
            if name in UNINITIALIZED else out
        record = OpRecord(len(self.records), name, inputs, digest(shown))
        self.records.append(record)
        if saved is not None:
            self.calls.append(SavedCall(record.index, name, saved[0], saved[1], record.output))
        return out


def resolve_op(name: str):
    """The OpOverload called `name` ('aten.mm.default')."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def save_calls(calls: list[SavedCall], path: str) -> list[str]:
    """Write the saved calls with torch.save; returns the ops left out because an argument cannot be pickled
    (e.g. a process group handed to a collective)."""
    import io
    import pickle

    kept, left_out = [], []
    for c in calls:
        try:
            torch.save(c.__dict__, io.BytesIO())
        except (TypeError, pickle.PicklingError, RuntimeError, AttributeError):
            left_out.append(c.op)
            continue
        kept.append(c.__dict__)
    torch.save(kept, path)
    return left_out


def load_calls(path: str) -> list[SavedCall]:
    """Saved calls written by `save_calls`."""
    return [SavedCall(**c) for c in torch.load(path, weights_only=False)]


def replay_calls(calls: list[SavedCall]) -> list[tuple[SavedCall, bool]]:
    """Run every saved call again in this process; (call, output bits equal the recorded ones) for each."""
    out = []
    for call in calls:
        args, kwargs = tree_map(_clone, call.args), tree_map(_clone, call.kwargs)
        out.append((call, digest(resolve_op(call.op)(*args, **kwargs)) == call.output))
    return out


def first_divergence(a: list[OpRecord], b: list[OpRecord]) -> Optional[OpRecord]:
    """The first call of `a` whose output differs from `b`'s call at the same position (None when none does)."""
    for x, y in zip(a, b):
        if x.op != y.op or x.output != y.output:
            return x
    return None if len(a) == len(b) else a[min(len(a), len(b))] if len(a) > len(b) else None
