"""Weight-sync phase: Megatron shards -> HF names -> (FP8 rollout format) -> engines, streamed bucket by bucket.

Every learner rank calls `sync_weights`; what each does (rollout/sync/base.py has the protocol):
all ranks refuse non-finite weights first; the controller pauses the engines; then each pipeline
stage in turn streams its own layers (trainer/weight_export.py: TP shards gathered one parameter
at a time onto the stage's sender, renamed, quantized on the learner's device, bucketed) into the
transport; the controller commits and resumes generation. Trainer and rollout quantize from
identical bits: FP8 rollout weights are quantized from exactly the learner's parameters.
Colocated engines (a tensor transport with per-rank feeds) are fed by every rank from its own device
instead of by the stage senders (phases/colocated.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.parallel import state
from megatron_rl.phases.colocated import colocated_bucket_bytes, stream_colocated
from megatron_rl.parallel.comm import all_gather_objects, barrier, broadcast_from_controller
from megatron_rl.trainer.weight_export import Converter, StreamingExporter, check_finite, nbytes, with_last


@dataclass
class ExportFormat:
    """How exported HF tensors become what the engines serve (precision/rollout_formats.py names the formats)."""

    convert: Converter
    """Per HF tensor: [(name, tensor)] to send (the tensor in the learner's dtype, or FP8 weight + its scale)."""
    config_updates: dict = field(default_factory=dict)
    """config.json entries of a checkpoint in this format (quantization_config)."""
    kv_scales: Optional[torch.Tensor] = None
    """[L, 2] per-layer (k_scale, v_scale) of the FP8 KV cache sent with the weights (None: none are sent)."""
    family: str = ""
    """HF model_type naming the scales (precision/kv_scales.py kv_scale_names)."""

    def extra_tensors(self, layers: list[int]) -> list[tuple[str, torch.Tensor]]:
        """The K/V cache scale tensors of decoder layers `layers` (empty without scales)."""
        from megatron_rl.precision.kv_scales import scale_tensors

        return [] if self.kv_scales is None else scale_tensors(self.kv_scales, self.family, layers)

    @property
    def extra(self) -> Optional[Callable[[list[int]], list]]:
        """What the exporters add to the weights' last bucket (None: nothing)."""
        return self.extra_tensors if self.kv_scales is not None else None


def export_format(precision: PrecisionConfig, kv_scales: Optional[torch.Tensor] = None, family: str = "") -> ExportFormat:
    """The rollout format of `precision.rollout_quantization`, applied one tensor at a time, with the FP8 KV cache's
    per-layer scales `kv_scales` ([L, 2], named for HF model_type `family`) when precision recalibrates them.

    Tensors that stay high precision travel in the learner's parameter dtype (bf16 on GPU: half the
    bytes of float32, the exact values); quantized weights are quantized from them (rollout_formats.py).
    """
    from megatron_rl.precision.rollout_formats import rollout_format

    fmt = rollout_format(precision)
    scales = kv_scales if precision.recalibrates_kv_scales else None
    return ExportFormat(lambda name, t: list(fmt.quantize(name, t).items()), fmt.config_updates(), scales, family)


def rollout_payload(hf_sd: dict[str, torch.Tensor], precision: PrecisionConfig, kv_scales: Optional[torch.Tensor] = None,
                    family: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """A whole HF state dict in the rollout format (with `kv_scales` of every layer, as `export_format`), plus its
    config.json updates (small models, tests, tools)."""
    fmt = export_format(precision, kv_scales, family)
    out = {n: t for name, tensor in hf_sd.items() for n, t in fmt.convert(name, tensor)}
    if fmt.kv_scales is not None:
        out.update(fmt.extra_tensors(list(range(fmt.kv_scales.shape[0]))))
    return out, dict(fmt.config_updates)


def export_hf_state_dict(learner) -> Optional[dict[str, torch.Tensor]]:
    """HF-named full weights on global rank 0 (None on other ranks); collective. Holds the whole model: tests/tools only."""
    from megatron_rl.models import hf_mapping

    full = learner.gather_full_state_dict()
    if full is None:
        return None
    return hf_mapping.to_hf(full, learner.arch)


def _agree(error: Optional[str], extra: Any = None) -> list:
    """Every rank's (error, extra); raises the first error on every rank."""
    reports = all_gather_objects((error, extra))
    errors = [(rank, e) for rank, (e, _) in enumerate(reports) if e]
    if errors:
        rank, e = errors[0]
        raise RuntimeError(f"weight sync failed on learner rank {rank}: {e}")
    return [x for _, x in reports]


def stream_to_transport(learner, transport, fmt: ExportFormat, weight_version: Any,
                        bucket_bytes: Optional[int] = None) -> tuple[int, int]:
    """Every stage, in turn, streams its buckets into `transport` (stage senders); returns this rank's (bytes, buckets).

    Collective over all learner ranks. A failing send does not stop the stage's gathers (its TP
    peers are inside them): the sender drains the export, then every rank raises the error.
    """
    learner.finish_param_sync()  # every rank, before only the exporting replica reads parameters
    exporter = StreamingExporter(learner)
    pp = state.pp_size()
    sent, count = 0, 0
    for stage in range(pp):
        error: Optional[str] = None
        if exporter.stage == stage and exporter.participates:
            size = bucket_bytes or (transport.bucket_bytes if transport is not None else 1 << 30)
            try:
                if exporter.is_sender:
                    transport.begin_stage(stage, pp, weight_version)
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                error = f"{type(exc).__name__}: {exc}"
            for bucket, last in with_last(exporter.buckets(size, fmt.convert, fmt.extra)):
                if error is None:
                    try:
                        transport.send_bucket(bucket, final=last and stage == pp - 1)
                        sent += nbytes(bucket)
                        count += 1
                    except Exception as exc:  # noqa: BLE001
                        error = f"{type(exc).__name__}: {exc}"
                del bucket
            if exporter.is_sender and error is None:
                transport.end_stage()
        _agree(error)
    return sent, count


def _share_targets(transport) -> None:
    """Every stage sender adopts the controller's live engines (EnginePool may have restarted or dropped some)."""
    targets = None
    if state.is_controller():
        targets = transport.targets() if hasattr(transport, "targets") else (list(getattr(transport, "urls", [])), 0)
    targets = broadcast_from_controller(targets)
    if transport is not None and hasattr(transport, "refresh_targets"):
        transport.refresh_targets(*targets)


def sync_weights(learner, transport, precision: PrecisionConfig, weight_version: int,
                 kv_scales: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Push the learner's current weights (and the FP8 KV cache's per-layer scales `kv_scales` [L, 2], identical on
    every rank, when precision recalibrates them) to every engine as `weight_version`; metrics on the controller.

    Collective: every learner rank calls it; `transport` is the rank's transport (stage senders and
    the controller) or None. Non-finite weights raise NonFiniteWeightsError before anything is sent.
    """
    start = time.perf_counter()
    check_finite(learner)
    fmt = export_format(precision, kv_scales, learner.arch.family)
    controller = state.is_controller()
    error: Optional[str] = None
    if controller:
        try:
            transport.begin(weight_version)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    done = False
    try:
        _agree(error)
        _share_targets(transport)
        colocated = colocated_bucket_bytes(transport)
        if colocated is not None:
            sent, count = stream_colocated(learner, transport, fmt, weight_version, colocated)
        else:
            sent, count = stream_to_transport(learner, transport, fmt, weight_version)
        if controller:
            try:
                transport.commit(weight_version, fmt.config_updates)
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        totals = _agree(error, (sent, count))
        done = True
    finally:
        if controller:
            try:
                transport.finish()
            except Exception:
                if done:  # otherwise the sync's own error is the one to report
                    raise
    if not controller:
        return {}
    elapsed = time.perf_counter() - start
    total_bytes = float(sum(b for b, _ in totals))
    return {"sync/bytes": total_bytes, "sync/buckets": float(sum(c for _, c in totals)), "sync/time_s": elapsed,
            "sync/gb_per_s": total_bytes / elapsed / 1e9 if elapsed > 0 else 0.0}


def export_rollout_checkpoint(learner, precision: PrecisionConfig, out_dir: str, hf_config_dir: Optional[str] = None,
                              bucket_mb: float = 512.0, prepare: Optional[Callable[[str], None]] = None,
                              kv_scales: Optional[torch.Tensor] = None) -> Optional[str]:
    """Write the learner's weights (with `kv_scales` as `sync_weights`) as an HF checkpoint in the rollout format at
    `out_dir` (streamed; collective).

    Every stage sender writes its own shards into a staging directory (on a filesystem all learner
    nodes share); global rank 0 first runs `prepare(staging)` (e.g. writes config and tokenizer),
    then writes the index and config.json (from `hf_config_dir`, default the staging directory
    itself) and renames the result to `out_dir`, which it returns (None on other ranks).
    """
    import os
    import shutil

    from megatron_rl.rollout.sync.disk import finalize_checkpoint, write_shard

    fmt = export_format(precision, kv_scales, learner.arch.family)
    staging = str(out_dir).rstrip("/") + ".tmp"
    error = None
    if state.is_controller():
        try:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            if prepare is not None:
                prepare(staging)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    _agree(error)
    writer = _ShardWriter(staging, write_shard)
    stream_to_transport(learner, writer, fmt, "export", bucket_bytes=max(1, int(bucket_mb * 1024 * 1024)))
    path = None
    if state.is_controller():
        try:
            finalize_checkpoint(staging, hf_config_dir or staging, fmt.config_updates)
            shutil.rmtree(out_dir, ignore_errors=True)
            os.rename(staging, out_dir)
            path = str(out_dir)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    _agree(error)
    return path


class _ShardWriter:
    """A transport that only writes each stage's buckets as shards (for `export_rollout_checkpoint`)."""

    def __init__(self, directory: str, write: Callable) -> None:
        self.directory, self.write, self.k, self.stage = directory, write, 0, 0

    def begin_stage(self, stage: int, num_stages: int, weight_version: Any) -> None:
        self.stage, self.k = stage, 0

    def send_bucket(self, bucket, final: bool) -> None:
        self.write(bucket, f"{self.directory}/model-pp{self.stage:02d}-{self.k:05d}.safetensors")
        self.k += 1

    def end_stage(self) -> None:
        pass


def export_hf_dir(learner, tokenizer, out_dir) -> None:
    """Write an HF directory (config, safetensors shards, tokenizer) of the learner's weights; collective.

    Streamed like a weight sync (each pipeline stage writes its own shards): no rank holds the model.
    """
    from megatron_rl.models.presets import hf_config

    def prepare(staging: str) -> None:
        config = hf_config(learner.arch, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    export_rollout_checkpoint(learner, PrecisionConfig(), str(out_dir), prepare=prepare)
    barrier()
