"""CPU compatibility layer for megatron-core 0.16.1 (the only place that patches upstream).

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:
it allocates scalars with ``device="cuda"``, asks ``torch.cuda.current_device()``, keeps its
dropout RNG streams in the CUDA generator and checks ``param.type() == "torch.cuda.FloatTensor"``.
On a machine without CUDA, ``enable_cpu_compat()`` redirects exactly these to the CPU so the
real megatron code paths (parallel layers, schedules, DDP, optimizers) run on gloo.

Patch list (all installed only when CUDA is absent; ``check_patch_points()`` fails loudly when an
upgrade removes or changes one of them):

1. ``torch.cuda.current_device`` returns the cpu device; ``torch.cuda.synchronize`` and
   ``torch.cuda.empty_cache`` become no-ops.
2. RNG: ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
   and ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` use the CPU
   generator (``manual_seed_all`` stays: torch.manual_seed itself calls it), so ``model_parallel_cuda_manual_seed`` and the
   RNG tracker's ``fork()`` work (megatron warns once per fork on CPU; that is expected).
3. A process-wide ``TorchFunctionMode`` maps ``device="cuda"``/``"cuda:N"``/int devices to
   cpu in tensor factories and ``Tensor.to``, drops ``pin_memory=True``, makes ``Tensor.cuda()`` and ``Tensor.pin_memory()``
   return the tensor itself, and makes ``Tensor.type()`` report ``torch.cuda.<T>`` for
   ``torch.<T>`` (megatron's optimizers branch on that string). Every torch call pays for its
   Python ``__torch_function__`` (~1 us), so it is lifted where nothing needs it:
   ``run_without_compat_mode`` (the learner's transformer blocks) and ``compat_mode_suspended``.

Not a patch, but part of the same layer: megatron's own ``disable_jit_fuser()`` is called the moment
megatron.core.jit has run, so its torch.compile decorators (and torch._dynamo) stay out of CPU processes
(megatron_rl/jit_fuser_hook.py, installed by the package's ``__init__``).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_STATE: dict[str, Any] = {"enabled": False, "mode": None, "originals": {}}


def _map_device(device: Any) -> Any:
    """cpu for anything that names a CUDA device (str, torch.device or bare int), else unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_PIN = torch.Tensor.pin_memory
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU (patch 3 of the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Rewrite CUDA device arguments to cpu, then call `func`."""
        kwargs = kwargs or {}
        if func is _TENSOR_CUDA or func is _TENSOR_PIN:
            return args[0]
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is _TENSOR_TO and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _map_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU generator state standing in for megatron's CUDA RNG state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Set the CPU generator state standing in for megatron's CUDA RNG state."""
    torch.set_rng_state(new_state)


def _noop(*args: Any, **kwargs: Any) -> None:
    """Does nothing (CUDA stream/memory management has no CPU meaning)."""
    return None


# (owner, attribute name, replacement factory, expected parameter names or None)
def _patch_table() -> list[tuple[Any, str, Callable[[], Any], tuple[str, ...] | None]]:
    """Every upstream attribute the layer replaces, with the signature it was written against."""
    from megatron.core.tensor_parallel import random as mrandom

    return [
        (torch.cuda, "current_device", lambda: (lambda: _CPU), ()),
        (torch.cuda, "synchronize", lambda: _noop, None),
        (torch.cuda, "empty_cache", lambda: _noop, None),
        (torch.cuda, "get_rng_state", lambda: (lambda device="cuda": torch.get_rng_state()), ("device",)),
        (torch.cuda, "set_rng_state", lambda: (lambda new_state, device="cuda": torch.set_rng_state(new_state)), ("new_state", "device")),
        (torch.cuda, "manual_seed", lambda: torch.manual_seed, ("seed",)),
        (mrandom, "_get_cuda_rng_state", lambda: _cpu_get_rng_state, ("device", "clone", "graph_safe")),
        (mrandom, "_set_cuda_rng_state", lambda: _cpu_set_rng_state, ("new_state", "device", "graph_safe")),
    ]


def check_patch_points() -> None:
    """Raise RuntimeError if an upstream attribute this layer patches disappeared or changed signature."""
    from megatron.core.tensor_parallel import random as mrandom

    problems = []
    for owner, name, _, params in _patch_table():
        saved = _STATE["originals"].get((id(owner), name))
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        original = saved[1] if saved else getattr(owner, name, None)
        if not hasattr(owner, name) or original is None or not callable(original):
            problems.append(f"{label} is missing")
            continue
        if params is None:
            continue
        try:
            actual = tuple(p for p in inspect.signature(original).parameters)
        except (TypeError, ValueError):
            continue
        if actual != params:
            problems.append(f"{label} has parameters {actual}, the compat layer expects {params}")
    for attr in ("model_parallel_cuda_manual_seed", "CudaRNGStatesTracker", "get_cuda_rng_tracker"):
        if not hasattr(mrandom, attr):
            problems.append(f"megatron.core.tensor_parallel.random.{attr} is missing")
    tracker_src = inspect.getsource(mrandom.CudaRNGStatesTracker)
    for needle in ("torch.cuda.get_rng_state()", "torch.cuda.manual_seed(seed)", "_set_cuda_rng_state(", "_get_cuda_rng_state("):
        if needle not in tracker_src:
            problems.append(f"CudaRNGStatesTracker no longer calls {needle}; re-check the RNG patches")
    if problems:
        raise RuntimeError("megatron_rl CPU compat layer is out of date:\n  " + "\n  ".join(problems))


def cpu_compat_needed() -> bool:
    """True when CUDA is absent (the only case in which the layer is installed)."""
    return not torch.cuda.is_available()


def cpu_compat_enabled() -> bool:
    """True once `enable_cpu_compat()` installed the patches in this process."""
    return bool(_STATE["enabled"])


def enable_cpu_compat() -> bool:
    """Install the CPU patches once (no-op with CUDA or when already installed); returns whether active."""
    if _STATE["enabled"]:
        return True
    if not cpu_compat_needed():
        return False
    check_patch_points()
    for owner, name, factory, _ in _patch_table():
        _STATE["originals"][(id(owner), name)] = (owner, getattr(owner, name))
        setattr(owner, name, factory())
    mode = _CudaToCpuMode()
    mode.__enter__()
    _STATE["mode"] = mode
    _STATE["enabled"] = True
    return True


def disable_cpu_compat() -> None:
    """Undo `enable_cpu_compat()` (tests use this to prove each patch is needed and restorable)."""
    if not _STATE["enabled"]:
        return
    _STATE["mode"].__exit__(None, None, None)
    for (_, name), (owner, original) in _STATE["originals"].items():
        setattr(owner, name, original)
    _STATE.update(enabled=False, mode=None, originals={})


class _ModeLift(threading.local):
    """Takes the compat mode off the torch-function mode stack and puts it back (re-entrant, per thread).

    Only when the mode is the innermost one (a mode pushed above it, e.g. by a test, stays in charge
    and so does ours); the stack is the thread's own, as torch keeps it.
    """

    def __init__(self):
        """No lift in progress."""
        self.lifted: list[Any] = []

    def enter(self) -> None:
        """Pop the compat mode if it is on top."""
        mode = _STATE["mode"]
        top = torch._C._len_torch_function_stack()
        on_top = mode is not None and top > 0 and torch._C._get_function_stack_at(top - 1) is mode
        if on_top:
            torch._C._pop_torch_function_stack()
        self.lifted.append(mode if on_top else None)

    def exit(self) -> None:
        """Push back what the matching enter() popped."""
        mode = self.lifted.pop()
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)


_LIFT = _ModeLift()


def _lift_hook(*_: Any) -> None:
    """Forward pre-hook of run_without_compat_mode (a plain function: a module copies and pickles with it)."""
    _LIFT.enter()


def _restore_hook(*_: Any) -> None:
    """Always-called forward hook of run_without_compat_mode."""
    _LIFT.exit()


@contextlib.contextmanager
def compat_mode_suspended() -> Iterator[None]:
    """Lift the TorchFunctionMode for the block (~1 us per torch call otherwise); a no-op where it is not installed (GPU)."""
    _LIFT.enter()
    try:
        yield
    finally:
        _LIFT.exit()


def run_without_compat_mode(module: torch.nn.Module) -> torch.nn.Module:
    """Make every forward of `module` run with the compat mode lifted (forward hooks; a no-op on GPU, where it is never installed).

    For compute that asks for no CUDA device by name: the learner's transformer blocks
    (trainer/model.py), whose ops would otherwise each pass through the mode's Python
    __torch_function__. megatron's CUDA requests sit outside them (schedules' token counter,
    optimizer, DDP buffers, the context-parallel RoPE index in GPTModel), so the redirects stay
    where they are needed (tests/test_compat.py). Backward needs no lift: autograd does not run
    the mode on the backward ops. A torch call inside that names a CUDA device fails loudly
    ("Torch not compiled with CUDA") rather than silently leaving the CPU.
    """
    module.register_forward_pre_hook(_lift_hook)
    module.register_forward_hook(_restore_hook, always_call=True)
    return module
