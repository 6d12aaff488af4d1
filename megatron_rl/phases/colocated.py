"""Colocated tensor sync: every learner rank feeds the engine TP rank on its own device (rollout/colocation.py).

Start-up (`share_feeds`, once): every rank reports its device's name; the controller matches them
with each engine's devices and sends every rank its EngineFeed (or the layout error, raised on
every rank). A sync (`stream_colocated`, called by phases/weights.py between the controller's
begin and commit) then runs on every rank, bucket by bucket:

    all ranks:    the whole model's next bucket, on this rank's device (trainer/replicated_export.py)
    feeders:      payload = transport.rank_payload(bucket)            # handles of its own device only
    all ranks:    all_gather (payload, error)                         # each engine's poster takes its TP ranks'
    posters:      transport.post_feed(payloads of its engine, final)  # one /update_weights_from_tensor per engine
    all ranks:    all_gather (error)                                  # the engines answered: buckets may go

Every rank sees every error at the same bucket and raises it there, so no collective is left
half-joined. An engine the controller dropped from the targets is skipped by its feeders.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_rl.parallel import state
from megatron_rl.parallel.comm import all_gather_objects, broadcast_from_controller
from megatron_rl.rollout.colocation import EngineFeed, assign_feeds, device_identity, own_device_index


def share_feeds(engines: Optional[Sequence[tuple[str, Sequence[str]]]], error: Optional[str] = None) -> Optional[EngineFeed]:
    """This rank's EngineFeed (None: it feeds no engine); `engines` [(url, device names by TP rank)] and `error` (a
    layout problem found before) are the controller's. Collective; ValueError with the layout error on every rank."""
    devices = all_gather_objects(device_identity(own_device_index()))
    feeds: Any = None
    if state.is_controller():
        try:
            if error is None:
                feeds = assign_feeds(engines or [], devices)
        except ValueError as exc:
            error = str(exc)
    feeds, error = broadcast_from_controller((feeds, error))
    if error is not None:
        raise ValueError(error)
    return feeds.get(state.global_rank())


def colocated_bucket_bytes(transport) -> Optional[int]:
    """The bucket size of a colocated sync when any rank feeds an engine, else None (collective: every rank agrees)."""
    mine = transport.bucket_bytes if getattr(transport, "feed", None) is not None else None
    sizes = [s for s in all_gather_objects(mine) if s is not None]
    return max(sizes) if sizes else None


def _raise_first(errors: list, what: str) -> None:
    bad = [(rank, e) for rank, e in enumerate(errors) if e]
    if bad:
        rank, e = bad[0]
        raise RuntimeError(f"weight sync failed on learner rank {rank} ({what}): {e}")


def stream_colocated(learner, transport, fmt, weight_version: Any, bucket_bytes: int) -> tuple[int, int]:
    """Every rank streams the whole model into the engine on its device (module docstring); returns (bytes, buckets)
    this rank posted. Collective over all learner ranks."""
    from megatron_rl.trainer.replicated_export import ReplicatedExporter
    from megatron_rl.trainer.weight_export import nbytes, with_last

    learner.finish_param_sync()
    exporter = ReplicatedExporter(learner)
    feeding = transport is not None and getattr(transport, "feed", None) is not None and transport.feeding()
    feed = transport.feed if feeding else None
    sent, count = 0, 0
    for bucket, last in with_last(exporter.buckets(bucket_bytes, fmt.convert, fmt.extra)):
        payload, error = None, None
        if feed is not None:
            try:
                payload = transport.rank_payload(bucket)
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                error = f"{type(exc).__name__}: {exc}"
        reports = all_gather_objects((payload, error))
        _raise_first([e for _, e in reports], "building its payload")
        if feed is not None and feed.poster:
            try:
                transport.post_feed([reports[r][0] for r in feed.feeders], final=last, weight_version=weight_version)
                sent += nbytes(bucket)
                count += 1
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        _raise_first(all_gather_objects(error), "posting to its engine")
        if feed is not None:
            transport.bucket_done()
        del bucket
    return sent, count
