"""Receiving side of SGLang's weight-update endpoints for the embedded engine.

Every update is staged, verified, then swapped: tensors arrive into fresh buffers (a broadcast,
shared-memory handles, or a checkpoint built by the loader), their names, shapes and dtypes are
checked against what the engine serves, and only then are they copied into the model, on the
engine's worker thread between two generation batches. A bad request therefore leaves the served
weights untouched, and a batch never runs on half-copied weights.

Semantics follow SGLang's model runner:
- names are HF checkpoint names; a tied `lm_head.weight` is skipped on load (SGLang's
  `load_weights` skips it) and read back as the embedding;
- FP8 engines (W8A8 emulation) serve `X.weight` as float8_e4m3fn plus `X.weight_scale_inv` (blockwise) or
  `X.weight_scale` (per-channel w8a8_fp8);
- a high-precision tensor may arrive in another high-precision dtype and is cast on copy (SGLang's
  weight loaders `copy_` into the parameter); any other dtype change is refused;
- `/update_weights_from_distributed` receives every tensor of a well-formed request even when the
  check fails, so the group stays in step with the trainer; a broadcast that does not arrive within
  the group timeout destroys the group and fails the request;
- `/get_weights_by_name` returns the first `truncate_size` rows as float lists (`/release_memory_occupation`
  drops weight storage, `/resume_memory_occupation` re-allocates it zero-filled, as SGLang without
  --enable-weights-cpu-backup: push weights again before generating).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_rl.precision.w8a8 import W8A8Linear

HIGH_PRECISION = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""dtypes a served high-precision tensor may be sent in (cast on copy)."""
ARCH_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "hidden_act", "rms_norm_eps", "attention_bias",
    "mlp_bias", "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling",
)
"""config.json fields that define the served architecture (a weight update may not change them)."""
MEMORY_TAGS = ("weights", "kv_cache")
"""Tags of /release_memory_occupation and /resume_memory_occupation."""


class WeightUpdateError(ValueError):
    """A weight update the engine refuses; the message is returned to the client (HTTP 400)."""


def parse_dtype(value: Any) -> torch.dtype:
    """torch dtype of an SGLang dtype string ('float32', 'bfloat16', 'float8_e4m3fn'; a 'torch.' prefix is accepted)."""
    if isinstance(value, str):
        dt = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
    raise WeightUpdateError(f"dtype {value!r} is not a torch dtype name such as 'float32' or 'bfloat16'")


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype string ('float32')."""
    return str(dtype).removeprefix("torch.")


def parse_shape(value: Any, name: str) -> tuple[int, ...]:
    """A shape given as a list of non-negative ints."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise WeightUpdateError(f"shape of {name!r} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _tied(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def scale_suffix(module: W8A8Linear) -> str:
    """Checkpoint suffix of a W8A8 module's scales: `_scale` for per-channel (w8a8_fp8) rows, `_scale_inv` for blocks."""
    from megatron_rl.precision.hf_fp8 import SCALE_SUFFIX
    from megatron_rl.precision.rollout_formats import CHANNEL_SCALE_SUFFIX

    return CHANNEL_SCALE_SUFFIX if module.block[0] == 1 else SCALE_SUFFIX


def served_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint (and a weight update) can set, by HF checkpoint name."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, W8A8Linear):
            out[f"{mod_name}.weight"] = module.weight_q
            out[f"{mod_name}.weight{scale_suffix(module)}"] = module.weight_scale_inv
    seen = {id(t) for t in out.values()}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # tied weights appear once, under their first name (embed_tokens)
        seen.add(id(tensor))
        out[name] = tensor
    return out


class ServedWeights:
    """The engine model's tensors by HF name: check requests, swap staged tensors, read values back."""

    def __init__(self, model: torch.nn.Module) -> None:
        """Index `model` (rebuild after the model object is replaced)."""
        self.model = model
        self.tensors = served_tensors(model)
        self.tied_lm_head = _tied(model) and "lm_head.weight" not in self.tensors
        self._w8a8 = {n: m for n, m in model.named_modules() if isinstance(m, W8A8Linear)}

    def canonical(self, name: str) -> Optional[str]:
        """The served name `name` refers to (tied lm_head -> embedding), or None when the model has no such tensor."""
        if name in self.tensors:
            return name
        if name == "lm_head.weight" and self.tied_lm_head:
            return "model.embed_tokens.weight"
        return None

    def problems(self, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[str]:
        """Why (name, dtype, shape) entries cannot be loaded; empty when they all can."""
        out = []
        for name, dtype, shape in entries:
            key = self.canonical(name)
            if key is None:
                out.append(f"{name}: the served model has no such tensor")
                continue
            served = self.tensors[key]
            if tuple(served.shape) != tuple(shape):
                out.append(f"{name}: shape {list(shape)} != served {list(served.shape)}")
            elif dtype != served.dtype and not (dtype in HIGH_PRECISION and served.dtype in HIGH_PRECISION):
                out.append(f"{name}: dtype {dtype_name(dtype)} cannot replace served {dtype_name(served.dtype)}")
        return out

    def check(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """WeightUpdateError listing every tensor that does not fit."""
        bad = self.problems((n, t.dtype, tuple(t.shape)) for n, t in named)
        if bad:
            raise WeightUpdateError(f"{len(bad)} of {len(named)} tensors do not match the served model: "
                                    + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else "") + " (weights unchanged)")

    def apply(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copy checked tensors into the model (engine thread only); returns how many were written."""
        touched: set[str] = set()
        written = 0
        with torch.no_grad():
            for name, tensor in named:
                if name == "lm_head.weight" and self.tied_lm_head:
                    continue  # SGLang's load_weights skips a tied lm_head
                key = self.canonical(name)
                self.tensors[key].copy_(tensor)
                written += 1
                if key.endswith((".weight", ".weight_scale_inv", ".weight_scale")):
                    touched.add(key.rsplit(".", 1)[0])
            for mod in touched & self._w8a8.keys():
                m = self._w8a8[mod]
                m.weight_dq.copy_(m._dequant())
        return written

    def read(self, name: str, truncate_size: int) -> list:
        """The first `truncate_size` rows of tensor `name` as (nested) float lists, like SGLang."""
        key = self.canonical(name)
        if key is None:
            raise WeightUpdateError(f"get_weights_by_name: the served model has no tensor {name!r}")
        return self.tensors[key].detach()[:truncate_size].to(torch.float32).tolist()

    def signature(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, dtype)} of every served tensor."""
        return {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in self.tensors.items()}


def check_same_architecture(served: torch.nn.Module, new: torch.nn.Module, source: str) -> None:
    """ValueError naming every config field and tensor where `new` (from `source`) differs from the served model."""
    issues = []
    a, b = getattr(served, "config", None), getattr(new, "config", None)
    if a is not None and b is not None:
        da, db = a.to_dict(), b.to_dict()
        for key in ARCH_KEYS:
            if da.get(key) != db.get(key):
                issues.append(f"config {key}: served {da.get(key)!r}, {source} has {db.get(key)!r}")
    sa, sb = ServedWeights(served).signature(), ServedWeights(new).signature()
    for name in sorted(set(sa) | set(sb)):
        if name not in sb:
            issues.append(f"{name}: missing")
        elif name not in sa:
            issues.append(f"{name}: not in the served model")
        elif sa[name] != sb[name]:
            issues.append(f"{name}: {list(sb[name][0])} {sb[name][1]} != served {list(sa[name][0])} {sa[name][1]}")
    if issues:
        raise ValueError(f"{source} does not match the served architecture ({len(issues)} differences: "
                         + "; ".join(issues[:8]) + (" ..." if len(issues) > 8 else "") + "); served weights unchanged")


# ----------------------------------------------------------------------------- process groups
@dataclass
class _Group:
    """One joined weight-update group."""

    pg: Any
    """The torch ProcessGroup."""
    rank: int
    """This engine's rank in it."""
    world_size: int
    """Ranks in the group."""
    backend: str
    """gloo or nccl."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises receives (broadcasts must be consumed in request order)."""


class WeightGroups:
    """The engine's weight-update groups by name (thread-safe; blocking calls run off the event loop)."""

    def __init__(self, timeout_s: float = 120.0, device: str = "cpu", tp_size: int = 1) -> None:
        """`timeout_s` bounds each rendezvous and broadcast; the embedded engine is one TP rank on CPU."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = float(timeout_s)
        self.device = device
        self.tp_size = tp_size
        self._groups: dict[str, _Group] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def init(self, master_address: Any, master_port: Any, rank_offset: Any, world_size: Any,
             group_name: Any, backend: Any) -> str:
        """Join a group as rank `rank_offset` (blocks until every rank joined); returns SGLang's success message."""
        from megatron_rl.parallel.weight_group import init_weight_update_group

        if not isinstance(master_address, str) or not master_address:
            raise WeightUpdateError("init_weights_update_group: master_address (string) is required")
        for key, value in (("master_port", master_port), ("rank_offset", rank_offset), ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise WeightUpdateError(f"init_weights_update_group: {key} must be an integer, got {value!r}")
        if not 1 <= master_port <= 65535:
            raise WeightUpdateError(f"init_weights_update_group: master_port={master_port} is not a TCP port")
        if rank_offset < 1 or rank_offset + self.tp_size > world_size:
            raise WeightUpdateError(f"init_weights_update_group: rank_offset={rank_offset} with this engine's "
                                    f"{self.tp_size} rank(s) does not fit world_size={world_size} (rank 0 is the trainer)")
        if not isinstance(group_name, str) or not group_name:
            raise WeightUpdateError("init_weights_update_group: group_name must be a non-empty string")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"init_weights_update_group: backend={backend!r} must be 'gloo' or 'nccl'")
        if backend == "nccl" and self.device == "cpu":
            raise WeightUpdateError("init_weights_update_group: backend=nccl needs a CUDA engine; this engine runs on "
                                    "CPU, use backend=gloo")
        with self._lock:
            if group_name in self._groups or group_name in self._pending:
                raise WeightUpdateError(f"init_weights_update_group: group {group_name!r} already exists "
                                        "(POST /destroy_weights_update_group first)")
            self._pending.add(group_name)
        try:
            pg = init_weight_update_group(backend, master_address, master_port, rank_offset, world_size,
                                          group_name, self.timeout_s)
        except Exception as exc:
            raise WeightUpdateError(f"init_weights_update_group: joining {group_name!r} at {master_address}:{master_port} "
                                    f"as rank {rank_offset} of {world_size} failed within {self.timeout_s:g} s: "
                                    f"{type(exc).__name__}: {exc}") from None
        finally:
            with self._lock:
                self._pending.discard(group_name)
        with self._lock:
            self._groups[group_name] = _Group(pg, rank_offset, world_size, backend)
        return "Succeeded to initialize custom process group."

    def destroy(self, group_name: Any) -> str:
        """Leave and destroy a group (waits for a receive in progress)."""
        from megatron_rl.parallel.weight_group import destroy_weight_update_group

        with self._lock:
            group = self._groups.pop(group_name, None) if isinstance(group_name, str) else None
        if group is None:
            raise WeightUpdateError(f"destroy_weights_update_group: no group named {group_name!r}")
        with group.lock:
            destroy_weight_update_group(group.pg)
        return "Succeeded to destroy custom process group."

    def get(self, group_name: Any) -> _Group:
        """The group or a WeightUpdateError naming it."""
        with self._lock:
            group = self._groups.get(group_name) if isinstance(group_name, str) else None
            known = sorted(self._groups)
        if group is None:
            raise WeightUpdateError(f"no weight-update group named {group_name!r} (known: {known}); "
                                    "POST /init_weights_update_group first")
        return group

    def receive(self, group_name: str, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
        """Receive one broadcast per entry from group rank 0 (or one flat uint8 buffer for flattened_bucket)."""
        from megatron_rl.parallel.weight_group import broadcast_from_rank0, destroy_weight_update_group

        group = self.get(group_name)
        with group.lock:
            staged = [(n, torch.empty(shape, dtype=dt, device=self.device)) for n, dt, shape in entries]
            if load_format == "flattened_bucket":
                flat = torch.empty(sum(t.numel() * t.element_size() for _, t in staged), dtype=torch.uint8, device=self.device)
                wire = [flat]
            else:
                wire = [t for _, t in staged]
            if group.backend == "gloo":  # gloo has no float8 kernels: the same bytes travel as uint8
                wire = [t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.uint8 else t for t in wire]
            try:
                broadcast_from_rank0(wire, group.pg)
            except Exception as exc:
                with self._lock:
                    self._groups.pop(group_name, None)
                try:
                    destroy_weight_update_group(group.pg)
                except Exception:  # a broken group may fail to tear down; it is dropped either way
                    pass
                raise WeightUpdateError(
                    f"update_weights_from_distributed: the broadcast of {len(entries)} tensors on {group_name!r} did not "
                    f"complete within {self.timeout_s:g} s ({type(exc).__name__}: {str(exc)[:300]}); the group is destroyed "
                    "and the served weights are unchanged") from None
            if load_format == "flattened_bucket":
                offset = 0
                for i, (n, t) in enumerate(staged):
                    size = t.numel() * t.element_size()
                    staged[i] = (n, flat[offset:offset + size].view(t.dtype).reshape(t.shape))
                    offset += size
            return staged

    def close(self) -> None:
        """Destroy every group (server shutdown)."""
        for name in list(self._groups):
            try:
                self.destroy(name)
            except WeightUpdateError:
                pass


# ----------------------------------------------------------------------------- memory occupation
def parse_tags(tags: Any) -> tuple[str, ...]:
    """The memory tags of a release/resume request (None = all)."""
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise WeightUpdateError(f"tags must be a list of strings from {list(MEMORY_TAGS)}, got {tags!r}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise WeightUpdateError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return tuple(tags)


def release_weights(model: torch.nn.Module, cpu_backup: bool = False) -> dict[int, tuple]:
    """Free the storage of every served tensor and W8A8 dequantized copy; returns what `resume_weights` restores.

    With `cpu_backup` (SGLang's --enable-weights-cpu-backup) the values are kept aside, here in the
    CPU storage they already live in, so resuming brings back the weights served before the release.
    """
    held: dict[int, tuple] = {}
    tensors = list(served_tensors(model).values())
    tensors += [m.weight_dq for m in model.modules() if isinstance(m, W8A8Linear)]
    for t in tensors:
        if id(t) not in held:
            held[id(t)] = (t, t.shape, t.dtype, t.data if cpu_backup else None)
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return held


def resume_weights(held: dict[int, tuple]) -> None:
    """Re-allocate released tensors: their backup when one was kept, else zero-filled (their values must be pushed again)."""
    for t, shape, dtype, backup in held.values():
        t.data = backup if backup is not None else torch.zeros(shape, dtype=dtype, device=t.device)
