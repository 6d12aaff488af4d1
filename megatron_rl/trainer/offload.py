"""The learner's memory while colocated engines run (rollout.placement: colocated): allocator cache and host offload.

Colocated engines take their memory back (/resume_memory_occupation) while the learner holds what it
keeps between steps. Before that, every learner rank

- returns its allocator's cached blocks to the device (`release_device_cache`: torch.cuda.empty_cache
  on CUDA; nothing to return on CPU, whose allocator caches nothing), and
- with rollout.colocate_offload, moves its optimizer states and gradient buffers to host memory
  (`LearnerOffload.offload`) and brings them back after the engines released theirs, before it trains
  again (`reload`). The model weights stay: the weight sync, the health checks and the evaluation read them.

Gradient buffers go through megatron-core's own DDP calls (`offload_grad_buffers` / `restore_grad_buffers`:
the buffer storage is freed and re-allocated zeroed; every step starts by zeroing it, so nothing is lost).
Optimizer states use our own code: megatron-core's `MegatronOptimizer.offload_to_cpu` replaces
`param.data` of every optimizer parameter, which for an FP32 optimizer *is* the model weight (it would
move the weights the engines sync from) and detaches a parameter from any tensor sharing its storage;
here each distinct storage on the learner's device (Adam moments, fp32 main params of BF16 runs and
their gradients; the distributed optimizer's shards) is copied to host and resized to 0 in place, so
every view and alias stays valid and comes back bit for bit. The same code runs on CPU (host-to-host
copies), where tests/test_colocate_offload.py checks a few steps bitwise against a run without it.
"""
from __future__ import annotations

from typing import Iterator

import torch


def release_device_cache(device: torch.device) -> None:
    """Return the caching allocator's free blocks of `device` to the driver (CUDA); CPU tensors are freed when dropped."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def learner_device(learner) -> torch.device:
    """The device the learner's weights live on."""
    return next(p.device for chunk in learner.model for p in chunk.parameters())


def _inner_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (ChainedOptimizer or a single one)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not getattr(opt, "is_stub_optimizer", False):
            yield inner


def _ddp_buffers(chunk) -> list:
    """megatron DDP's param-and-grad buffers of a model chunk (lists shadowing nn.Module.buffers)."""
    return [b for name in ("buffers", "expert_parallel_buffers")
            for b in (getattr(chunk, name, None) if isinstance(getattr(chunk, name, None), list) else [])]


class LearnerOffload:
    """Optimizer states and gradient buffers of one learner rank, to host memory and back (see the module docstring)."""

    def __init__(self, learner) -> None:
        """`learner` is a trainer.learner.Learner (its model chunks and megatron optimizer)."""
        self.learner = learner
        self.device = learner_device(learner)
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.offloaded = False

    def _kept_storages(self) -> set[int]:
        """Storages that stay on the device: model weights (and megatron's param buffers) and the DDP grad buffers."""
        keep = set()
        for chunk in self.learner.model:
            keep.update(p.untyped_storage().data_ptr() for p in chunk.parameters())
            for buffer in _ddp_buffers(chunk):
                for data in (buffer.param_data, buffer.grad_data):
                    if data is not None:
                        keep.add(data.untyped_storage().data_ptr())
        return keep

    def _optimizer_storages(self) -> list[torch.UntypedStorage]:
        """Distinct non-empty storages on the learner's device held by the optimizer: states, main params, their grads."""
        keep, seen, out = self._kept_storages(), set(), []

        def add(t) -> None:
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                return
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() and ptr not in keep and ptr not in seen:
                seen.add(ptr)
                out.append(storage)

        for inner in _inner_optimizers(self.learner.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    add(p)
                    add(p.grad)
            for state in inner.state.values():
                for value in state.values():
                    add(value)
        return out

    def offload(self) -> int:
        """Move optimizer states and gradient buffers to host memory; returns the device bytes freed (0 if already off)."""
        if self.offloaded:
            return 0
        cuda = self.device.type == "cuda"
        freed = 0
        for storage in self._optimizer_storages():
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=cuda)  # the host copy
            host.copy_(device_bytes)
            freed += storage.nbytes()
            storage.resize_(0)
            self._host.append((storage, host))
        for chunk in self.learner.model:
            freed += sum(b.grad_data.untyped_storage().nbytes() for b in _ddp_buffers(chunk) if b.grad_data is not None)
            if _ddp_buffers(chunk):
                chunk.offload_grad_buffers(synchronize=cuda, empty_cache=False)
        self.offloaded = True
        return freed

    def reload(self) -> None:
        """Bring everything `offload` moved back to the device, bit for bit (gradient buffers come back zeroed)."""
        if not self.offloaded:
            return
        for storage, host in self._host:
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host)
        self._host = []
        for chunk in self.learner.model:
            if _ddp_buffers(chunk):
                chunk.restore_grad_buffers(synchronize=self.device.type == "cuda")
        self.offloaded = False
