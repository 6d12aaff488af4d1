"""Generic collectives for global statistics: sum all-reduce, padded variable-length all-gather,
capped uniform subsampling with the true count carried along, and their byte costs.

`group=None` means "no communication": the local tensor is the global one. Pass
`torch.distributed.group.WORLD` for the default group. Every rank of a group must call each
function the same number of times, in the same order, even with zero rows.

Results live on the device of the input. What travels is placed on the group's device (CUDA for
an NCCL group, the input's device otherwise), so a rank may contribute a CPU tensor, e.g. an
empty statistic, to a GPU group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def group_size(group: Optional[object]) -> int:
    """Number of ranks in `group` (1 when group is None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_device(group: Optional[object], like: torch.Tensor) -> torch.device:
    """Where tensors for `group`'s collectives must live: the current CUDA device for NCCL, else `like`'s device."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return like.device


def all_reduce_sum(tensor: torch.Tensor, group: Optional[object]) -> torch.Tensor:
    """Elementwise sum over `group` (a new tensor on the input's device; the input is left untouched)."""
    if group is None or group_size(group) == 1:
        return tensor.clone()
    out = tensor.to(group_device(group, tensor), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(tensor.device)


def all_gather_variable(rows: torch.Tensor, group: Optional[object]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate every rank's [n_i, d] rows in rank order; returns (rows [sum n_i, d], counts [world]).

    Two collectives: the row counts, then the rows padded to the largest count (gloo's
    all_gather needs equal shapes).
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be [n, d], got shape {tuple(rows.shape)}")
    world = group_size(group)
    if world == 1:
        return rows, torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    dev = group_device(group, rows)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=dev)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts_t = torch.cat(counts).to(rows.device)
    sizes = [int(n) for n in counts_t.tolist()]
    padded = torch.zeros((max(max(sizes), 1), rows.shape[1]), dtype=rows.dtype, device=dev)
    padded[: rows.shape[0]] = rows.to(dev)
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    out = torch.cat([c[:n] for c, n in zip(chunks, sizes)], dim=0).to(rows.device)
    return out, counts_t


def subsample_rows(rows: torch.Tensor, cap: int, generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, float]:
    """At most `cap` rows drawn uniformly without replacement (order kept); returns (rows, weight = n / kept)."""
    n = rows.shape[0]
    if n <= cap:
        return rows, 1.0
    # drawn with the (CPU) generator so the draw is reproducible and checkpointable, then moved to the rows
    keep = torch.randperm(n, generator=generator)[:cap].sort().values  # device-ok: CPU generator draw, moved below
    return rows[keep.to(rows.device)], n / cap


def gather_samples(
    rows: torch.Tensor,
    max_rows_per_rank: int,
    group: Optional[object],
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' rows (each capped by uniform subsampling) and a per-row weight = true rows / kept rows of its rank.

    Exact (all weights 1) when no rank exceeds the cap. With group=None no cap is applied.
    """
    if group is None:
        return rows, torch.ones(rows.shape[0], dtype=torch.float64, device=rows.device)
    kept, weight = subsample_rows(rows, max_rows_per_rank, generator)
    # the weight travels as an extra column so one gather carries everything
    with_w = torch.cat([kept.to(torch.float64), torch.full((kept.shape[0], 1), weight, dtype=torch.float64, device=kept.device)], dim=1)
    out, _ = all_gather_variable(with_w, group)
    return out[:, :-1].to(rows.dtype), out[:, -1]


def all_gather_bytes(world_size: int, rows_per_rank: int, row_bytes: int) -> int:
    """Bytes a rank receives in a padded ring all-gather (counts, then rows padded to `rows_per_rank`)."""
    return (world_size - 1) * (8 + rows_per_rank * row_bytes)


def all_reduce_bytes(world_size: int, numel: int, itemsize: int) -> int:
    """Bytes a rank receives in a ring all-reduce of `numel` items: 2 (w - 1) / w of the buffer."""
    return int(2 * (world_size - 1) * numel * itemsize // max(world_size, 1))
