"""Turn megatron-core's JIT fuser off on machines without CUDA, the moment megatron defines it.

megatron.core.jit sets ``jit_fuser = torch.compile`` at import, and a dozen fusion modules decorate their functions
with it at their own import, so every process that imports megatron.core pays for torch._dynamo and torch._inductor
(~1.5 CPU-seconds of a ~3 s megatron import) for kernels the CPU path never calls (the learner turns every fusion
off without CUDA: trainer/model.py). megatron has its own switch, ``megatron.core.jit.disable_jit_fuser()``, but it
only takes effect for decorators that run after it, and importing megatron.core.jit runs megatron.core's
``__init__`` (and with it the fusion modules) first. So a finder on ``sys.meta_path`` calls that switch right after
megatron.core.jit has executed, before the module that imported it continues. Nothing of megatron is changed: it is
megatron's own switch, called at the only time it can work. With CUDA the fuser stays on. Installed by
``megatron_rl/__init__.py``; part of the CPU compatibility layer (megatron_rl/parallel/compat.py).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional, Sequence

JIT_MODULE = "megatron.core.jit"


class _DisableAfterExec(importlib.abc.Loader):
    """Runs the real loader, then megatron's disable_jit_fuser() when this process has no CUDA."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        import torch  # megatron.core.jit imported it already

        if not torch.cuda.is_available():
            module.disable_jit_fuser()


class JitFuserFinder(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit as the rest of sys.meta_path would, with a loader that disables the fuser after it."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _DisableAfterExec(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (once per process; a no-op when megatron.core.jit is already imported)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, JitFuserFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, JitFuserFinder())
