"""The Learner: owns every piece of megatron state (model chunks, DDP, optimizer, LR schedule).

It knows nothing about RL. It computes log-probs/entropy (`forward_logprobs`) and greedy hits (`forward_greedy_hits`), runs one
optimizer step for a loss given as a callable (`train_step`), and moves full (un-sharded)
megatron-named weights in and out (`gather_full_state_dict` / `load_full_state_dict`).

Loss contract of `train_step`: `loss_fn(logprobs, entropy, mb, ctx) -> (loss, metrics)` receives
one micro-batch (for CP, the rows' tokens held by this CP rank, in megatron's load-balanced
layout, with every [b, S] field of `mb` sliced the same way) and returns a loss in *global sum
form*: the objective is the sum of loss_fn outputs over all micro-batches and all DP x CP ranks
(TrainBatch.token_weight carries the normalisation). Gradients are exactly d(sum)/d(theta):
megatron runs in per-token-loss mode (no 1/num_microbatches), DDP sums instead of averaging and
the 1/num_tokens scaling is disabled (see trainer/model.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.parallel import state
from megatron_rl.precision import fp8_forward_context
from megatron_rl.precision.device import DeviceFacts, detect_device_facts, learner_device_errors
from megatron_rl.precision.scale_book import ScaleBook, attach as scale_book_attach, micro_batch_key
from megatron_rl.models.presets import Architecture, megatron_param_shapes, resolve_architecture
from megatron_rl.trainer.logprobs import gather_cp_sequence, vocab_parallel_label_is_argmax, vocab_parallel_logprobs_entropy
from megatron_rl.trainer.model import build_model_chunks, build_transformer_config, learner_kernels, unwrap, wrap_ddp
from megatron_rl.trainer.spec import layer_offset, to_cp_layout
from megatron_rl.types import TrainBatch

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
# The TE spec fuses the pre-norms into the following linear; export/import always use local-spec names.
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass
class LossContext:
    """What a loss function may need besides the tensors: groups and micro-batch position."""

    group: Optional[dist.ProcessGroup]
    """DP x CP group of global loss statistics (each token appears on exactly one rank of it)."""
    micro_batch_index: int
    """Index of this micro-batch within the step (0-based)."""
    num_micro_batches: int
    """Micro-batches per step on every DP rank."""
    dp_size: int
    """Data-parallel size."""
    cp_size: int
    """Context-parallel size."""


LossFn = Callable[[torch.Tensor, torch.Tensor, TrainBatch, LossContext], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _cp_slice(mb: TrainBatch, cp_size: int, cp_rank: int) -> TrainBatch:
    """The tokens of every [b, S] field held by this CP rank (row fields such as sample_index stay)."""
    if cp_size == 1:
        return mb
    changes = {}
    for f in fields(mb):
        value = getattr(mb, f.name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            changes[f.name] = to_cp_layout(value, cp_size, cp_rank)
    return mb.with_fields(**changes)


def check_precision_environment(precision_cfg: PrecisionConfig, on_gpu: bool) -> None:
    """On GPU, fail before the model is built when the imported TE contradicts the FP8 policy (CPU: nothing to check)."""
    if not on_gpu or precision_cfg.recipe == "none":
        return
    # Imported here so that a CPU process never touches transformer_engine.
    from megatron_rl.precision import te

    te.check_te_environment(precision_cfg)
    te.check_te_recipe_support(precision_cfg)


class Learner:
    """megatron-core GPT learner; call `parallel.state.init_distributed` first (or pass init=True)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        parallel_cfg: ParallelConfig,
        optim_cfg: OptimConfig,
        precision_cfg: PrecisionConfig,
        vocab_size: int,
        seed: int = 1234,
        total_steps: Optional[int] = None,
        init: bool = False,
        architecture: Optional[Architecture] = None,
        device_facts: Optional[DeviceFacts] = None,
    ) -> None:
        """Build model chunks, DDP, optimizer and LR schedule.

        `total_steps` sets the decay length of linear/cosine schedules; `architecture` replaces the
        preset resolved from `model_cfg` (e.g. one derived from an HF config); `init=True` forces
        `init_distributed` (it is called anyway when the groups do not exist yet). `device_facts`
        (default: this process's, detected once) decide the layer spec: Transformer Engine's only
        when CUDA is available and TE imports; a recipe this device cannot run is refused here too.
        """
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.device_facts = device_facts if device_facts is not None else detect_device_facts()
        errors = learner_device_errors(precision_cfg, self.device_facts)
        if errors:
            raise ValueError("; ".join(errors))
        if init or not state.is_initialized():
            state.init_distributed(parallel_cfg, seed)
        self.parallel_cfg = parallel_cfg
        self.precision_cfg = precision_cfg
        self.kernels = learner_kernels(self.device_facts, parallel_cfg)
        self.arch = architecture if architecture is not None else resolve_architecture(model_cfg, vocab_size)
        self.config = build_transformer_config(self.arch, parallel_cfg, optim_cfg, precision_cfg,
                                               on_gpu=self.device_facts.cuda, kernels=self.kernels)
        check_precision_environment(precision_cfg, on_gpu=self.kernels.te_spec)
        torch.manual_seed(seed)
        chunks = build_model_chunks(self.arch, self.config, precision_cfg, use_te=self.kernels.te_spec)
        self.model = wrap_ddp(chunks, self.config, parallel_cfg, self.kernels)
        self.scale_book = ScaleBook()
        """pi_old's FP8 amaxes for theta's forwards (precision.ratio_consistent_scales; attached to no linear when off)."""
        if precision_cfg.ratio_consistent_scales:
            scale_book_attach((m for chunk in self.model for m in chunk.modules()), self.scale_book)
        self._params_pending = False  # the optimizer stepped and the parameter all-gather was left to a forward
        self.kv_probe = None
        """trainer/kv_scales.py KvAmaxProbe hooked into the core attention modules (None: no K/V amax is measured)."""
        bf16 = optim_cfg.params_dtype == "bf16"
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim_cfg.lr,
                min_lr=optim_cfg.min_lr,
                weight_decay=optim_cfg.weight_decay,
                adam_beta1=optim_cfg.adam_beta1,
                adam_beta2=optim_cfg.adam_beta2,
                adam_eps=optim_cfg.adam_eps,
                clip_grad=optim_cfg.clip_grad,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=parallel_cfg.use_distributed_optimizer,
            ),
            self.model,
        )
        if optim_cfg.lr_decay_style != "constant" and total_steps is None:
            raise ValueError(f"optim.lr_decay_style={optim_cfg.lr_decay_style} needs the Learner's total_steps")
        decay = max(1, (total_steps or 1) - optim_cfg.lr_warmup_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim_cfg.lr_warmup_steps else optim_cfg.lr,
            max_lr=optim_cfg.lr,
            min_lr=optim_cfg.min_lr,
            lr_warmup_steps=optim_cfg.lr_warmup_steps,
            lr_decay_steps=optim_cfg.lr_warmup_steps + decay,
            lr_decay_style=optim_cfg.lr_decay_style,
            start_wd=optim_cfg.weight_decay,
            end_wd=optim_cfg.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            # The config, not the checkpoint, sets the schedule: a run resumed with a raised train.steps decays over
            # its new total from the saved step count; megatron's default keeps the saved horizon, where a finished
            # run's learning rate is already min_lr, so training further would not move the weights.
            override_opt_param_scheduler=True,
            use_checkpoint_opt_param_scheduler=False,
        )
        self.step_count = 0

    # ------------------------------------------------------------------ batches
    def _check_batch(self, batch: TrainBatch, micro_batch_size: int) -> int:
        """Number of micro-batches; ValueError on shapes the layout cannot split."""
        b, s = batch.input_ids.shape
        if micro_batch_size < 1 or b % micro_batch_size != 0:
            raise ValueError(f"batch of {b} rows is not divisible by micro_batch_size={micro_batch_size}")
        n_mb = b // micro_batch_size
        if self.parallel_cfg.virtual_pipeline_model_parallel_size and n_mb < state.pp_size():
            raise ValueError(
                f"{n_mb} micro-batches (batch {b} / micro_batch_size {micro_batch_size}) is fewer than "
                f"parallel.pipeline_model_parallel_size={state.pp_size()}, which the interleaved (VPP) schedule needs"
            )
        cp, tp = state.cp_size(), state.tp_size()
        div = 2 * cp if cp > 1 else 1
        if self.parallel_cfg.sequence_parallel:
            div *= tp
        if s % div != 0:
            raise ValueError(f"sequence length {s} must be divisible by {div} (2*CP{' * TP for sequence parallel' if self.parallel_cfg.sequence_parallel else ''})")
        if s > self.arch.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model max_seq_len={self.arch.max_seq_len}")
        for name, t in batch.tensors().items():
            if t.dim() == 2 and tuple(t.shape) != (b, s):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(t.shape)}, expected {(b, s)}")
        return n_mb

    def _iterators(self, items: list) -> list[Iterator] | Iterator:
        """One iterator per model chunk (megatron's interleaved schedule pulls per virtual stage)."""
        if len(self.model) == 1:
            return iter(items)
        return [iter(items) for _ in self.model]

    def _run(self, batch: TrainBatch, micro_batch_size: int, loss_builder, forward_only: bool) -> list:
        """Run megatron's forward(-backward) schedule over the micro-batches; returns the last stage's outputs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n_mb = self._check_batch(batch, micro_batch_size)
        cp, cp_rank = state.cp_size(), state.cp_rank()
        seq = batch.input_ids.shape[1]
        items = [(i, batch.select(slice(i * micro_batch_size, (i + 1) * micro_batch_size))) for i in range(n_mb)]

        def forward_step(data_iterator, model):
            """Feed one micro-batch; on the last stage the loss closure turns logits into (loss, count, metrics)."""
            index, mb = next(data_iterator)
            device = next(model.parameters()).device
            mb = mb.with_fields(**{k: v.to(device) for k, v in mb.tensors().items()})
            ids = to_cp_layout(mb.input_ids, cp, cp_rank)
            pos = to_cp_layout(torch.arange(seq, device=device).unsqueeze(0).expand(mb.batch_size, -1), cp, cp_rank)
            if self.kv_probe is not None and self.kv_probe.active:  # the positions an engine's KV cache holds
                from megatron_rl.trainer.kv_scales import cached_positions

                self.kv_probe.set_positions(to_cp_layout(cached_positions(mb.loss_mask), cp, cp_rank))
            with fp8_forward_context(self.precision_cfg, self.config), self.scale_book.micro_batch(micro_batch_key(mb)):
                output = model(ids, pos, None)
            return output, lambda logits: loss_builder(logits, index, n_mb, mb)

        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=self._iterators(items),
            model=self.model,
            num_microbatches=n_mb,
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        # every parameter's forward pre-hook waited on (or dispatched) its bucket's all-gather: nothing is pending,
        # and a forced finish_param_sync would repeat the full all-gather on every export
        self._params_pending = False
        return outputs

    def _logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocab-parallel log-probs/entropy of local-layout labels."""
        return vocab_parallel_logprobs_entropy(
            logits, labels.to(logits.device), state.tp_group(), self.parallel_cfg.logprob_chunk_size
        )

    # ------------------------------------------------------------------ public API
    def forward_logprobs(self, batch: TrainBatch, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad log-probs and entropy [B, S] of this DP rank's rows, on every rank of the replica."""
        cp, cp_rank, cp_group = state.cp_size(), state.cp_rank(), state.cp_group()

        def builder(logits, index, n_mb, mb):
            lp, ent = self._logprobs(logits, to_cp_layout(mb.labels, cp, cp_rank))
            out = {"logprobs": gather_cp_sequence(lp, cp_group), "entropy": gather_cp_sequence(ent, cp_group)}
            return torch.zeros((), device=logits.device), torch.tensor(1, dtype=torch.int), out

        with torch.no_grad():
            outputs = self._run(batch, micro_batch_size, builder, forward_only=True)
        shape = tuple(batch.input_ids.shape)
        if state.is_last_stage():
            lp = torch.cat([o["logprobs"] for o in outputs]).float().cpu()
            ent = torch.cat([o["entropy"] for o in outputs]).float().cpu()
        else:
            lp, ent = torch.empty(shape), torch.empty(shape)
        if state.pp_size() > 1:
            packed = torch.stack([lp, ent]).to(self._comm_device())
            dist.broadcast(packed, src=state.last_stage_global_rank(), group=state.pp_group())
            lp, ent = packed[0].cpu(), packed[1].cpu()
        return lp, ent

    def forward_greedy_hits(self, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
        """No-grad bool [B, S] of this DP rank's rows: labels[b, s] is the model's argmax after input_ids[b, :s+1]
        (teacher forcing), on every rank of the replica."""
        cp, cp_rank, cp_group = state.cp_size(), state.cp_rank(), state.cp_group()

        def builder(logits, index, n_mb, mb):
            hit = vocab_parallel_label_is_argmax(logits, to_cp_layout(mb.labels, cp, cp_rank).to(logits.device),
                                                 state.tp_group())
            out = {"hits": gather_cp_sequence(hit.to(torch.uint8), cp_group)}
            return torch.zeros((), device=logits.device), torch.tensor(1, dtype=torch.int), out

        with torch.no_grad():
            outputs = self._run(batch, micro_batch_size, builder, forward_only=True)
        if state.is_last_stage():
            hits = torch.cat([o["hits"] for o in outputs]).cpu()
        else:
            hits = torch.empty(tuple(batch.input_ids.shape), dtype=torch.uint8, device=batch.input_ids.device)
        if state.pp_size() > 1:
            hits = hits.to(self._comm_device())
            dist.broadcast(hits, src=state.last_stage_global_rank(), group=state.pp_group())
            hits = hits.cpu()
        return hits.bool()

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on this DP rank's rows; returns loss, grad_norm, lr and loss_fn metrics (sums over micro-batches and DP x CP ranks)."""
        cp, cp_rank = state.cp_size(), state.cp_rank()
        group = state.dp_cp_group()
        dp = state.dp_size()

        def builder(logits, index, n_mb, mb):
            local = _cp_slice(mb, cp, cp_rank)
            lp, ent = self._logprobs(logits, local.labels)
            ctx = LossContext(group=group, micro_batch_index=index, num_micro_batches=n_mb, dp_size=dp, cp_size=cp)
            loss, metrics = loss_fn(lp, ent, local, ctx)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a 0-d loss, got shape {tuple(loss.shape)}")
            reduced = {"loss": loss.detach().float()}
            reduced.update({k: torch.as_tensor(v).detach().float().sum() for k, v in metrics.items()})
            return loss, torch.tensor(1, dtype=torch.int), reduced

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(batch, micro_batch_size, builder, forward_only=False)
        grad_norm = None
        success = self._all_ranks_finite(outputs)
        if success:
            # Advance the schedule first so optimizer step k (1-based) uses lr(k): warm-up never spends a step at lr 0.
            self.scheduler.step(increment=1)
            success, grad_norm, _ = self.optimizer.step()
            self.step_count += 1
            self._params_pending = self.kernels.overlap_param_gather
        metrics = self._reduce_metrics(outputs)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = 0.0 if success else 1.0
        return metrics

    def _all_ranks_finite(self, outputs: list[dict[str, torch.Tensor]]) -> bool:
        """True when the loss and the gradient norm are finite on every rank (collective over all learner ranks).

        A non-finite value anywhere skips the update everywhere, for FP32 as for mixed precision
        (megatron's optimizer only checks for inf/NaN when a loss scaler is on), and before the LR
        schedule advances, as megatron's training loop does on a skipped iteration. The sum of squared
        gradients overflows to inf exactly where megatron's FP32 gradient-norm computation would.
        """
        local = torch.zeros((), dtype=torch.float32)
        for o in outputs:
            local = local + o["loss"].detach().float().cpu()
        for grad in self._local_grads():
            local = local + torch.linalg.vector_norm(grad.float()).square().cpu()
        flag = torch.tensor([0.0 if torch.isfinite(local) else 1.0], device=self._comm_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag) == 0.0

    def _local_grads(self) -> Iterator[torch.Tensor]:
        """This rank's gradients after the backward pass (megatron DDP's grad buffers, or .main_grad / .grad per parameter)."""
        for chunk in self.model:
            # megatron's DDP keeps its grad buffers in lists (shadowing nn.Module.buffers)
            buffers = [b for name in ("buffers", "expert_parallel_buffers")
                       for b in (getattr(chunk, name, None) if isinstance(getattr(chunk, name, None), list) else [])]
            if buffers:
                yield from (b.grad_data for b in buffers)
                continue
            for p in chunk.parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    yield g

    def _comm_device(self) -> torch.device:
        """Device of tensors handed to collectives (cuda under NCCL)."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _reduce_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Sum per-micro-batch metrics, all-reduce over DP x CP on the last stage, share with all stages."""
        result: Optional[dict[str, float]] = None
        if state.is_last_stage():
            keys = sorted(outputs[0]) if outputs else ["loss"]
            local = torch.stack([sum(o[k] for o in outputs) for k in keys]).to(self._comm_device()) if outputs else torch.zeros(1)
            dist.all_reduce(local, group=state.dp_cp_group())
            result = {k: float(v) for k, v in zip(keys, local.cpu())}
        if state.pp_size() > 1:
            box = [result]
            dist.broadcast_object_list(box, src=state.last_stage_global_rank(), group=state.pp_group())
            result = box[0]
        return dict(result or {})

    # ------------------------------------------------------------------ weights
    def finish_param_sync(self) -> None:
        """Make every rank's parameters the optimizer's latest before they are read or written outside a forward.

        With overlap_param_gather the distributed optimizer updates only this rank's shard and megatron
        gathers the rest lazily in the next forward's pre-hooks, so until then other ranks' shards are stale
        (read by an export, or restored by a hand swap after which no forward gathers again). The collective
        entry points that touch parameters call this first, on every
        rank (weight sync and its finiteness check, gather/load_full_state_dict, checkpoints, the reference
        policy): it runs the all-gather synchronously (DDP.start_param_sync(force_sync=True), as megatron's
        training loop does through disable_forward_pre_hook before saving), after which the pre-hooks have
        nothing to do. Collective over the DP group; a no-op without overlap or when nothing is pending.
        """
        if not self._params_pending:
            return
        for chunk in self.model:
            chunk.start_param_sync(force_sync=True)
        self._params_pending = False

    def _local_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(global megatron name, local parameter) for every parameter on this rank."""
        if self._params_pending:
            # a collective cannot start here: only some ranks (the exporting replica) iterate this
            raise RuntimeError("learner parameters read while their all-gather is pending (overlap_param_gather): "
                               "call Learner.finish_param_sync() on every rank first")
        for vp, chunk in enumerate(self.model):
            module = unwrap(chunk)
            offset, _ = layer_offset(self.config, vp if len(self.model) > 1 else None)
            for name, param in module.named_parameters():
                m = _LAYER_RE.match(name)
                if m:
                    rest = _TE_FUSED_NORMS.get(name[m.end():], name[m.end():])
                    name = f"decoder.layers.{int(m.group(1)) + offset}." + rest
                if self.arch.tie_word_embeddings and name == "output_layer.weight":
                    # The last stage's copy of a tied embedding (PP > 1): same tensor by name.
                    name = "embedding.word_embeddings.weight"
                yield name, param

    def _is_gated_fc1(self, name: str) -> bool:
        """True for SwiGLU fc1 weights, whose TP shard is cat(gate_i, up_i)."""
        return self.config.gated_linear_unit and name.endswith("mlp.linear_fc1.weight")

    def gather_full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Full (un-sharded over TP and PP) fp32 megatron-named tensors on global rank 0; None elsewhere.

        Names are the local spec's (input_layernorm / pre_mlp_layernorm also on the TE path), layer
        numbers are global, and a tied output layer is exported once as the embedding. Collective:
        every rank must call it. It holds the whole model on rank 0, so it serves tests and small
        conversions; weight sync streams instead (trainer/weight_export.py).
        """
        from megatron_rl.trainer.weight_export import StreamingExporter

        self.finish_param_sync()
        exporter = StreamingExporter(self)
        local = {name: full.float().cpu().clone() for name, full in exporter.full_params() if full is not None}
        if not exporter.is_sender:
            return None
        if state.pp_size() == 1:
            return local
        # Stage senders form rank 0's pipeline group: names/shapes first, then one tensor at a time.
        group, me = state.pp_group(), state.global_rank()
        metas: Optional[list] = [None] * state.pp_size() if me == 0 else None
        dist.gather_object([(n, tuple(t.shape)) for n, t in local.items()], metas, dst=0, group=group)
        device = self._comm_device()
        if me != 0:
            for t in local.values():
                dist.send(t.to(device), dst=0, group=group)
            return None
        full = dict(local)
        for stage in range(1, state.pp_size()):
            src = dist.get_global_rank(group, stage)
            for name, shape in metas[stage]:
                buf = torch.empty(shape, dtype=torch.float32, device=device)
                dist.recv(buf, src=src, group=group)
                full[name] = buf.cpu()
        return full

    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Shard a full megatron-named dict onto this rank (every rank passes the same dict) and refresh optimizer copies."""
        self.finish_param_sync()
        missing = [name for name, _ in self._local_params() if name not in sd]
        if missing:
            raise KeyError(f"load_full_state_dict: missing {len(missing)} tensors, e.g. {missing[:5]}")

        def piece(name: str, shard: Optional[tuple[int, int, int]]) -> torch.Tensor:
            full = sd[name]
            if shard is None:
                return full
            dim, tp, tp_rank = shard
            if self._is_gated_fc1(name):
                gate, up = full.chunk(2, dim=0)
                return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
            return full.chunk(tp, dim=dim)[tp_rank]

        self.load_pieces(piece, "load_full_state_dict")

    def load_pieces(self, piece: Callable[[str, Optional[tuple[int, int, int]]], torch.Tensor], what: str) -> None:
        """Copy piece(name, shard) into each local parameter (shard: (partition_dim, tp, tp_rank), None when whole), then refresh optimizer copies.

        Only this rank's share is asked for, one parameter at a time (the sliced HF warm start reads no more); `what`
        names the source in errors.
        """
        tp, tp_rank = state.tp_size(), state.tp_rank()
        self.finish_param_sync()
        with torch.no_grad():
            for name, param in self._local_params():
                split = tp > 1 and getattr(param, "tensor_model_parallel", False)
                got = piece(name, (param.partition_dim, tp, tp_rank) if split else None)
                if tuple(got.shape) != tuple(param.shape):
                    raise ValueError(f"{what}: {name} gives {tuple(got.shape)} on TP rank {tp_rank} of {tp}, which is not "
                                     f"this rank's shard {tuple(param.shape)}")
                param.copy_(got.to(param.dtype))
        self.optimizer.reload_model_params()

    def expected_full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shapes of every megatron-named tensor of the whole model (all stages; no communication)."""
        return megatron_param_shapes(self.arch)
