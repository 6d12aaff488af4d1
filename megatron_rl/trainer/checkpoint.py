"""Distributed checkpoints of the Learner: megatron dist_checkpointing (torch_dist) + RL state, atomic, reshardable.

What one checkpoint holds (``<ckpt_root>/step_<N:08d>/``)::

    dist/            megatron torch_dist checkpoint (every rank writes its shards):
                       model / model<i>  sharded_state_dict of each model chunk (i = virtual stage)
                       optimizer         sharded_state_dict of the megatron optimizer: Adam moments
                                         (+ fp32 main params under bf16 / the distributed optimizer),
                                         step, param groups; absent when no step was taken yet
                       scheduler         OptimizerParamScheduler.state_dict() (plain, in common.pt)
    rl_state.pkl     the caller's picklable dict (step, data cursor, weight version, calibrator,
                     controller RNG states, ...), written by global rank 0
    rng/rank_R.pkl   per-rank RNG states: torch CPU (+ CUDA), python, numpy, megatron's
                     model-parallel RNG tracker; restored only under the same layout
    meta.json        format version, step, learner step_count, parallel layout that saved it,
                     optimizer kind and distributed-optimizer sharding type, model architecture
    COMPLETE         written last; a directory without it is never returned or loaded

Atomicity: every rank writes into ``<ckpt_root>/.tmp_step_<N>``; after a barrier global rank 0
writes meta.json and COMPLETE and renames the directory to ``step_<N:08d>``, so a crash at any
point leaves only a ``.tmp_*`` directory, which ``latest_checkpoint`` ignores and the next save
removes. Retention keeps the newest ``keep_last`` complete checkpoints. The checkpoint root must
be one filesystem visible to every rank (as for any megatron run).

Resharding: model tensors are stored in global coordinates (megatron ShardedTensors), so a
checkpoint saved under one TP/PP/VPP/DP/CP layout loads under any other that the model supports.
The optimizer state reshards too: the regular (DDP) optimizer's state is keyed by the same
ShardedTensors; the distributed optimizer is saved in megatron's ``fully_reshardable`` format
(gathered to model-space tensors on save, sliced per rank on load). Not supported: switching
between the regular and the distributed optimizer with ``load_optimizer=True`` (their state
layouts differ; load with ``load_optimizer=False`` to keep only weights and the LR schedule).

Public API: ``save_checkpoint``, ``load_checkpoint``, ``latest_checkpoint``, ``list_checkpoints``,
``checkpoint_meta``, ``apply_retention``, ``reject_checkpoints`` (weights a health check condemned: renamed
``rejected_step_<N>``, never loaded again), ``capture_rng_state`` / ``restore_rng_state``. All of
save/load are collectives: every learner rank calls them with the same arguments.

Quirks of megatron-core 0.16.1 handled here (on the optimizer instance, during one load only):
- its DistributedOptimizer, with torch's own Adam (no Apex/TE: the CPU path), copies every
  optimizer-state key when loading model-space formats, including Adam's ``step``, which the
  checkpoint does not hold per parameter (``_distopt_step_tolerant``); it cannot build a loading
  state dict before the first step (``_allocate_distopt_state``); and it gives all parameters one
  shared ``step`` tensor that torch Adam then increments once per parameter
  (``_unshare_adam_steps``);
- OptimizerParamScheduler.load_state_dict adds the saved step count to its current one, so the
  count is reset first.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.parallel import state
from megatron_rl.trainer.model import unwrap

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
RL_STATE_FILE = "rl_state.pkl"
DIST_DIR = "dist"
RNG_DIR = "rng"
TMP_PREFIX = ".tmp_step_"
DISTOPT_SHARDING = "fully_reshardable"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """Directory name of the complete checkpoint of `step` (zero-padded so names sort by step)."""
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------- discovery
def list_checkpoints(ckpt_root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ckpt_root` as (step, path), oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Optional[str]:
    """Path of the newest complete checkpoint under `ckpt_root`, or None."""
    found = list_checkpoints(ckpt_root)
    return str(found[-1][1]) if found else None


def checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a complete checkpoint (step, layout that saved it, optimizer kind, ...)."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return json.loads((path / META_FILE).read_text())


# ---------------------------------------------------------------------------- layout helpers
def _layout(learner: Any) -> dict[str, Any]:
    """The parallel layout of `learner`, as recorded in meta.json and compared for RNG restore."""
    cfg = learner.parallel_cfg
    return {
        "world_size": state.world_size(),
        "tp": state.tp_size(),
        "pp": state.pp_size(),
        "vpp": cfg.virtual_pipeline_model_parallel_size,
        "cp": state.cp_size(),
        "dp": state.dp_size(),
        "sequence_parallel": bool(cfg.sequence_parallel),
        "use_distributed_optimizer": bool(cfg.use_distributed_optimizer),
    }


def _sharding_metadata(distributed_optimizer: bool) -> dict[str, Any]:
    """Metadata steering megatron's sharded_state_dict (model and optimizer) for save and load."""
    from megatron.core import parallel_state as mpu

    meta: dict[str, Any] = {
        # megatron's torch_dist layouts as of 0.14+: per-layer tensors stacked on a global layer axis
        # (reshards over PP/VPP) and optimizer keys without a chained_<i> prefix.
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        # TE layers (GPU spec) read this group when they build their sharded state.
        "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True),
    }
    if distributed_optimizer:
        meta["distrib_optim_sharding_type"] = DISTOPT_SHARDING
    return meta


def _arch_fields(learner: Any) -> dict[str, Any]:
    """The learner's architecture as plain JSON values (recorded on save, compared on load)."""
    return {k: v for k, v in vars(learner.arch).items() if isinstance(v, (int, float, str, bool, type(None)))}


def _model_keys(learner: Any) -> list[str]:
    """megatron's naming of chunk state dicts: 'model', or 'model<i>' per virtual stage."""
    return ["model"] if len(learner.model) == 1 else [f"model{i}" for i in range(len(learner.model))]


def _model_sharded_state_dict(learner: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """Sharded state dict of every model chunk, keyed like megatron's training loop does (parameters all-gathered first)."""
    learner.finish_param_sync()
    return {
        key: unwrap(chunk).sharded_state_dict(prefix="", metadata=metadata)
        for key, chunk in zip(_model_keys(learner), learner.model)
    }


def _inner_optimizers(learner: Any) -> list[Any]:
    """The megatron optimizers inside the learner's (possibly chained) optimizer."""
    return list(getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]))


def _optimizer_has_state(learner: Any) -> bool:
    """True once an optimizer step allocated Adam state (before that there is nothing to save)."""
    return any(len(getattr(opt.optimizer, "state", {})) > 0 for opt in _inner_optimizers(learner))


def _barrier() -> None:
    """Barrier over all learner ranks (no-op without torch.distributed)."""
    if dist.is_initialized():
        dist.barrier()


def _all_ranks_true(flag: bool) -> bool:
    """True when `flag` holds on every rank (so all ranks take the same branch of a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _on_controller(fn: Any) -> None:
    """Run `fn` on global rank 0 only; if it raises, every rank raises (no rank is left waiting in a barrier)."""
    error: Optional[BaseException] = None
    if state.is_controller():
        try:
            fn()
        except BaseException as exc:  # re-raised below, after the other ranks were told
            error = exc
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RuntimeError(f"checkpoint step failed on global rank 0: {box[0]}")


# ---------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (+ CUDA), python, numpy, megatron's model-parallel tracker."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for the learner itself
        pass
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    out["tracker"] = get_cuda_rng_tracker().get_states()
    return out


def restore_rng_state(rng: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng.get("tracker"):
        get_cuda_rng_tracker().set_states(rng["tracker"])


# ---------------------------------------------------------------------------- save
def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file, fsync, rename (no half-written file is ever visible)."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a power loss (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_shards(learner: Any, tmp: Path) -> bool:
    """Every rank: save model (+ optimizer) + scheduler with dist_checkpointing and its RNG file; True when optimizer state was saved."""
    from megatron.core import dist_checkpointing

    from megatron_rl.child_reaper import ensure_reaper

    # megatron's writer forks shard writers and starts a spawn Manager (+ resource tracker): none may outlive a
    # killed trainer (the forks die with it, the watchdog kills the rest)
    ensure_reaper()
    distopt = bool(learner.parallel_cfg.use_distributed_optimizer)
    metadata = _sharding_metadata(distopt)
    sharded = _model_sharded_state_dict(learner, metadata)
    with_optimizer = _all_ranks_true(_optimizer_has_state(learner))
    if with_optimizer:
        sharded["optimizer"] = learner.optimizer.sharded_state_dict(sharded, is_loading=False, metadata=metadata)
    sharded["scheduler"] = learner.scheduler.state_dict()
    dist_checkpointing.save(sharded, str(tmp / DIST_DIR), sharded_strategy=("torch_dist", 1))
    buf = pickle.dumps(capture_rng_state())
    _atomic_write_bytes(tmp / RNG_DIR / f"rank_{state.global_rank():05d}.pkl", buf)
    return with_optimizer


def _publish(tmp: Path, final: Path, meta: dict[str, Any], rl_state: dict) -> None:
    """Global rank 0: write rl_state and meta, mark COMPLETE, then rename the temporary directory into place."""
    _atomic_write_bytes(tmp / RL_STATE_FILE, pickle.dumps(rl_state))
    _atomic_write_bytes(tmp / META_FILE, json.dumps(meta, indent=1, sort_keys=True).encode())
    _atomic_write_bytes(tmp / COMPLETE_MARKER, f"{meta['step']}\n".encode())
    if final.exists():
        # Re-saving a step: move the old copy aside first so the rename below cannot fail.
        old = final.with_name(f".old_{final.name}_{int(time.time() * 1e6)}")
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def apply_retention(ckpt_root: str | os.PathLike, keep_last: int, keep: Optional[str | os.PathLike] = None,
                    protect: Optional[str | os.PathLike] = None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (and `keep` / `protect`) and every stale temporary directory;
    returns removed paths."""
    root = Path(ckpt_root)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    complete = list_checkpoints(root)
    doomed = [p for _, p in complete[: max(0, len(complete) - max(1, keep_last))]]
    doomed += [p for p in root.iterdir() if p.is_dir() and (p.name.startswith(TMP_PREFIX) or p.name.startswith(".old_step_"))]
    kept = {Path(k).resolve() for k in (keep, protect) if k is not None}
    for path in doomed:
        if path.resolve() in kept:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


REJECTED_PREFIX = "rejected_"
REJECTED_MARKER = "REJECTED"


def reject_checkpoints(ckpt_root: str | os.PathLike, first_step: int, reason: str) -> list[str]:
    """Set aside every complete checkpoint of step >= `first_step`: renamed `rejected_step_<N>` (never loaded or counted
    again; kept for inspection) with a REJECTED file giving `reason`. Returns the new paths, oldest first."""
    moved = []
    for step, path in list_checkpoints(ckpt_root):
        if step < first_step:
            continue
        target, n = path.with_name(REJECTED_PREFIX + path.name), 1
        while target.exists():
            target, n = path.with_name(f"{REJECTED_PREFIX}{path.name}.{n}"), n + 1
        os.replace(path, target)  # first: once renamed it is never loaded, whatever happens next
        _atomic_write_bytes(target / REJECTED_MARKER, (reason.strip() + "\n").encode())
        moved.append(str(target))
    if moved:
        _fsync_dir(Path(ckpt_root))
    return moved


def save_checkpoint(learner: Any, ckpt_root: str, step: int, rl_state: dict, keep_last: int = 2,
                    protect: Optional[str] = None) -> str:
    """Collective over all learner ranks: save model, optimizer, LR schedule, per-rank RNG and `rl_state`; returns the checkpoint path.

    Retention keeps the newest `keep_last` checkpoints and `protect` (e.g. the newest one the health checks vouched for).
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(ckpt_root)
    tmp = root / f"{TMP_PREFIX}{step}"
    final = root / step_dir_name(step)

    def prepare() -> None:
        """Check rl_state pickles (before any shard is written) and create an empty temporary directory."""
        pickle.dumps(rl_state)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / DIST_DIR).mkdir(parents=True)
        (tmp / RNG_DIR).mkdir()

    def finish() -> None:
        """Publish the checkpoint and apply retention."""
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "learner_step_count": int(getattr(learner, "step_count", 0)),
            "layout": _layout(learner),
            "has_optimizer": with_optimizer,
            "distrib_optim_sharding_type": DISTOPT_SHARDING if learner.parallel_cfg.use_distributed_optimizer else None,
            "model_keys": _model_keys(learner),
            "arch": _arch_fields(learner),
            "saved_at": time.time(),
        }
        _publish(tmp, final, meta, rl_state)
        apply_retention(root, keep_last, keep=final, protect=protect)

    _on_controller(prepare)
    with_optimizer = _write_shards(learner, tmp)
    _barrier()
    _on_controller(finish)
    return str(final)


# ---------------------------------------------------------------------------- load
@contextmanager
def _distopt_step_tolerant(learner: Any) -> Iterator[None]:
    """Let megatron's DistributedOptimizer load model-space state with torch Adam (see module docstring)."""
    patched = []
    for opt in _distributed_optimizers(learner):
        original = opt._set_main_param_and_optimizer_states

        def tolerant(model_param, tensors, opt=opt, original=original):
            """Add the live Adam step (set from param_groups just before) when the checkpoint slice lacks it."""
            if "step" not in tensors and not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                group_index, group_order = opt.model_param_group_index_map[model_param]
                main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
                live = opt.optimizer.state.get(main_param, {})
                if "step" in live:
                    tensors = {**tensors, "step": live["step"]}
            return original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = tolerant
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _distributed_optimizers(learner: Any) -> list[Any]:
    """The megatron DistributedOptimizer instances inside the learner's optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [opt for opt in _inner_optimizers(learner) if isinstance(opt, DistributedOptimizer)]


def _allocate_distopt_state(learner: Any) -> None:
    """Give a never-stepped DistributedOptimizer zero Adam state with step 0 before a load.

    megatron's DistributedOptimizer.state_dict() (torch-Adam path) asserts that every parameter
    has a `step`, which only exists after a first step; the load overwrites all of these values,
    and if it failed, zero moments with step 0 are exactly torch Adam's fresh state. With Apex/TE
    FusedAdam (GPU) the step lives in param_groups and nothing is needed.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in _distributed_optimizers(learner):
        inner = opt.optimizer
        if len(inner.state) > 0 or not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def _unshare_adam_steps(learner: Any) -> None:
    """Give every parameter its own Adam `step` tensor after a load.

    megatron's DistributedOptimizer (torch-Adam path) hands one shared step tensor to every
    parameter's state; torch Adam increments it in place per parameter, so the next step would
    see step + k for the k-th parameter and apply the wrong bias correction.
    """
    for opt in _inner_optimizers(learner):
        seen: set[int] = set()
        for st in getattr(opt.optimizer, "state", {}).values():
            step = st.get("step") if isinstance(st, dict) else None
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    st["step"] = step.clone()
                seen.add(id(step))


def _resolve(path: str | os.PathLike) -> Path:
    """A complete checkpoint directory: `path` itself, or the newest one when `path` is a checkpoint root."""
    p = Path(path)
    if (p / COMPLETE_MARKER).is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint at {p} (expected a step_<N> directory with a {COMPLETE_MARKER} marker, or a root holding one)")
    return Path(latest)


def load_checkpoint(learner: Any, path: str, load_optimizer: bool = True, load_rng: bool = True) -> dict:
    """Collective: load a checkpoint (a step dir, or the newest under a root; any parallel layout) into `learner`; returns rl_state."""
    from megatron.core import dist_checkpointing

    ckpt = _resolve(path)
    meta = checkpoint_meta(ckpt)
    layout = _layout(learner)
    distopt = layout["use_distributed_optimizer"]
    with_optimizer = load_optimizer and meta["has_optimizer"]
    if with_optimizer and meta["layout"]["use_distributed_optimizer"] != distopt:
        raise ValueError(
            f"{ckpt} was saved with use_distributed_optimizer={meta['layout']['use_distributed_optimizer']} and this "
            f"learner uses {distopt}: optimizer state cannot be converted; pass load_optimizer=False to load weights only"
        )
    from megatron_rl.models.hf_arch import SHAPE_FIELDS

    arch = _arch_fields(learner)
    # Only fields that change the weights or the function count: a preset and the architecture derived from the
    # same model's HF config differ in name, vocab padding rule and position limit, and load each other's weights.
    diff = {k: (v, arch[k]) for k, v in meta.get("arch", {}).items() if k in SHAPE_FIELDS and k in arch and arch[k] != v}
    if diff:
        raise ValueError(f"{ckpt} holds another architecture; (checkpoint, learner) values: {diff}")
    metadata = _sharding_metadata(distopt)
    if distopt and meta.get("distrib_optim_sharding_type"):
        metadata["distrib_optim_sharding_type"] = meta["distrib_optim_sharding_type"]
    sharded = _model_sharded_state_dict(learner, metadata)
    if with_optimizer:
        _allocate_distopt_state(learner)
        sharded["optimizer"] = learner.optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(sharded, str(ckpt / DIST_DIR))
    for key, chunk in zip(_model_keys(learner), learner.model):
        chunk.load_state_dict(loaded[key], strict=True)
    if with_optimizer:
        with _distopt_step_tolerant(learner):
            learner.optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(learner)
    else:
        # Main (fp32) copies must follow the loaded weights when their own state is not loaded.
        learner.optimizer.reload_model_params()
    # megatron's scheduler load *adds* the saved step count (it assumes a fresh scheduler).
    learner.scheduler.num_steps = 0
    learner.scheduler.load_state_dict(loaded["scheduler"])
    learner.step_count = int(meta.get("learner_step_count", 0))
    rng_file = ckpt / RNG_DIR / f"rank_{state.global_rank():05d}.pkl"
    if load_rng:
        if meta["layout"] == layout and rng_file.is_file():
            restore_rng_state(pickle.loads(rng_file.read_bytes()))
        elif state.is_controller():
            logger.warning("checkpoint %s was saved under layout %s, this run is %s: per-rank RNG states not restored",
                           ckpt, meta["layout"], layout)
    rl_state = pickle.loads((ckpt / RL_STATE_FILE).read_bytes())
    _barrier()
    return rl_state
