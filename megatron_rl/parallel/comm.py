"""Controller <-> learner-rank communication of the RL loop (objects from rank 0, rows across DP)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.parallel import state


def broadcast_from_controller(obj: Any) -> Any:
    """Every rank receives global rank 0's `obj` (pickled; tensors travel on CPU)."""
    if state.world_size() == 1:
        return obj
    box = [obj if state.is_controller() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj: Any) -> list:
    """Every rank's `obj` (pickled), indexed by global rank, on every rank."""
    if state.world_size() == 1:
        return [obj]
    out: list = [None] * state.world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_dp_rows(local: torch.Tensor) -> torch.Tensor:
    """Concatenate each DP rank's rows (in DP-rank order) so every rank holds the global [B, ...] tensor."""
    size = state.dp_size()
    if size == 1:
        return local
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    parts = [torch.empty_like(local, device=device) for _ in range(size)]
    dist.all_gather(parts, local.to(device).contiguous(), group=state.dp_group())
    return torch.cat([p.cpu() for p in parts], dim=0)


def share_from_last_stage(obj: Any) -> Any:
    """Every pipeline stage receives its last stage's `obj` (pickled): state kept where the loss runs, made visible to rank 0."""
    if state.pp_size() == 1:
        return obj
    box = [obj if state.is_last_stage() else None]
    dist.broadcast_object_list(box, src=state.last_stage_global_rank(), group=state.pp_group())
    return box[0]


def barrier() -> None:
    """Wait for every learner rank."""
    if state.world_size() > 1:
        dist.barrier()


def reduce_loss_sums(local: dict | None) -> dict:
    """Sum per-rank metric sums of the loss over the ranks that own distinct tokens, result on every rank.

    The loss runs on the last pipeline stage and TP ranks hold identical copies, so only last-stage
    TP-rank-0 ranks contribute (one per DP x CP position); every rank joins the collective.
    """
    contributes = state.is_last_stage() and state.tp_rank() == 0
    mine = {k: v.detach().cpu().to(torch.float64) for k, v in (local or {}).items()} if contributes else {}
    if state.world_size() == 1:
        return mine
    everyone: list = [None] * state.world_size()
    dist.all_gather_object(everyone, mine)
    total: dict = {}
    for part in everyone:
        for k, v in part.items():
            total[k] = total[k] + v if k in total else v.clone()
    return total
