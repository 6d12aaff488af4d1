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
- an update holding NaN or inf values (any endpoint: disk, distributed, tensor) is refused naming the
  tensors, before anything is swapped (SGLang itself loads them; an engine is also reached by other
  trainers and scripts than the one that checks before sending);
- `/update_weights_from_distributed` receives every tensor of a well-formed request even when the
  check fails, so the group stays in step with the trainer; a broadcast that does not arrive within
  the group timeout destroys the group and fails the request;
- `/get_weights_by_name` returns the first `truncate_size` rows as float lists (`/release_memory_occupation`
  drops weight storage, `/resume_memory_occupation` re-allocates it zero-filled, as SGLang without
  --enable-weights-cpu-backup: push weights again before generating).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_rl.precision.kv_scales import kv_scale_buffers, normalize_kv_scales
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
    out.update(kv_scale_buffers(model))  # per-layer K/V cache scales, when the checkpoint's quant method creates them
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
        """WeightUpdateError listing every tensor that does not fit (a K/V cache scale must also be a positive number:
        SGLang's process_weights_after_loading would otherwise serve 1.0 or fail its assertion)."""
        bad = self.problems((n, t.dtype, tuple(t.shape)) for n, t in named)
        bad += [f"{n}: a K/V cache scale must be a finite number > 0, got {float(t.reshape(-1)[0])}" for n, t in named
                if n.endswith(("k_scale", "v_scale")) and t.numel() == 1 and not float(t.reshape(-1)[0]) > 0]
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
                elif key.endswith(("k_scale", "v_scale")):
                    touched.add("kv_scales")
            for mod in touched & self._w8a8.keys():
                m = self._w8a8[mod]
                m.weight_dq.copy_(m._dequant())
            if "kv_scales" in touched:  # as SGLang's process_weights_after_loading at end_weight_update
                normalize_kv_scales(self.model)
        return written

    def read(self, name: str, truncate_size: int) -> list | float:
        """The first `truncate_size` rows of tensor `name` as (nested) float lists, like SGLang; a 0-d tensor (a K/V
        cache scale) as its number. A scale also answers under SGLang's parameter name (`...self_attn.attn.k_scale`),
        for reading only: loading under it is what SGLang drops for Qwen3/Llama (precision/kv_scales.py). SGLang
        0.5.23 itself answers None for scales (its Llama reader slices the 0-d list; Qwen models have no reader)."""
        key = self.canonical(name)
        if key is None and name.endswith((".self_attn.attn.k_scale", ".self_attn.attn.v_scale")):
            key = self.canonical(name.replace(".self_attn.attn.", ".self_attn.", 1))
        if key is None:
            raise WeightUpdateError(f"get_weights_by_name: the served model has no tensor {name!r}")
        t = self.tensors[key].detach()
        if t.dim() == 0:
            return float(t)
        return t[:truncate_size].to(torch.float32).tolist()

    def signature(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, dtype)} of every served tensor."""
        return {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in self.tensors.items()}


def same_tensors(a: Sequence[tuple[str, torch.Tensor]], b: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether two staged updates hold the same names, dtypes, shapes and bytes."""
    return len(a) == len(b) and all(
        na == nb and ta.dtype == tb.dtype and ta.shape == tb.shape
        and torch.equal(ta.view(torch.uint8) if ta.element_size() == 1 else ta, tb.view(torch.uint8) if tb.element_size() == 1 else tb)
        for (na, ta), (nb, tb) in zip(a, b))


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors in `named` holding a NaN or an infinity (float8 included)."""
    bad = []
    with torch.no_grad():
        for name, t in named:
            if not t.is_floating_point() or t.numel() == 0:
                continue
            # float8 has few CPU kernels; its values widen exactly to float16 (e4m3 max 448, e5m2 max 57344)
            values = t.to(torch.float16) if t.element_size() == 1 else t
            # one reducing pass without a mask: min/max propagate NaN and reach +-inf (~25x faster than
            # isfinite().all() on CPU, which writes a bool per element)
            lo, hi = torch.aminmax(values)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                bad.append(name)
    return bad


class FiniteCheck:
    """Refuses updates holding NaN/inf weights, naming the tensors; keeps the seconds it spent (/server_info)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        """Time spent checking, summed over every update so far."""

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
        """WeightUpdateError naming the non-finite tensors of an update (`what` names the endpoint)."""
        import time

        t0 = time.perf_counter()
        try:
            bad = nonfinite_tensors(named)
        finally:
            self.seconds += time.perf_counter() - t0
        if bad:
            raise WeightUpdateError(f"{what}: {len(bad)} tensor(s) hold NaN/inf values: " + ", ".join(bad[:8])
                                    + (" ..." if len(bad) > 8 else "") + " (weights unchanged)")


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
