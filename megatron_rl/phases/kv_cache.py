"""Recalibrated FP8 KV cache scales of a run (precision.kv_cache_scales): measured on the step's old-log-prob forward,
smoothed over steps, sent with every weight sync, checkpointed with the RL state.

    kv = start(session)                     # None unless precision recalibrates; restores or calibrates once
    with kv.measuring():                    # phases/logprobs.py: the pi_old forward over the rollout batch
        ...forward...
    metrics.update(kv.observe())            # all-reduce (MAX) of [L, 2] amax, one step into the window
    sync_weights(..., kv_scales=kv.scales())

The scales a sync carries come from the batches the previous weights generated (the step's rollout batch is
the newest measurement when the step's updated weights leave), which the window and headroom of
precision/kv_scales.py cover. Before the first sync of a fresh run there is no rollout yet: one forward over the
first training prompts (prompt tokens only) gives the first measurement, so the first rollouts already run at
measured scales; a resumed run restores the window instead, so it continues as if it had not stopped.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.kv_scales import KvScaleTracker

STATE_KEY = "kv_cache_scales"
"""RL-state entry holding `KvCacheScales.state_dict()`."""


class KvCacheScales:
    """The learner's K/V amax probe and the tracker that turns its measurements into per-layer scales."""

    def __init__(self, learner, precision: PrecisionConfig) -> None:
        """Hook `learner` (trainer/kv_scales.py) and track with the precision policy's window and headroom."""
        from megatron_rl.trainer.kv_scales import KvAmaxProbe

        self.probe = KvAmaxProbe(learner)
        self.tracker = KvScaleTracker(learner.config.num_layers, precision.kv_cache_scale_window,
                                      precision.kv_cache_scale_headroom,
                                      power_of_two=precision.kv_cache_scale_rounding == "power_of_two")

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Record K/V amax during the forwards inside (call `observe` on every rank afterwards)."""
        with self.probe.recording():
            yield

    def observe(self) -> dict[str, float]:
        """Reduce the recorded amax over every learner rank (collective), add them to the window; metrics."""
        t0 = time.perf_counter()
        amax = self.probe.result()
        self.tracker.observe(amax)
        scales = self.tracker.scales()
        return {"kv_cache/k_amax": float(amax[:, 0].max()), "kv_cache/v_amax": float(amax[:, 1].max()),
                "kv_cache/k_scale_max": float(scales[:, 0].max()), "kv_cache/v_scale_max": float(scales[:, 1].max()),
                "kv_cache/k_scale_min": float(scales[:, 0].min()), "kv_cache/v_scale_min": float(scales[:, 1].min()),
                "time/kv_cache_reduce": time.perf_counter() - t0}

    def scales(self) -> torch.Tensor:
        """[L, 2] float32 (k_scale, v_scale) per layer, identical on every rank."""
        return self.tracker.scales()

    def calibrate(self, learner, tokenizer, rows, micro_batch_size: int, seq_multiple: int, count: int) -> dict[str, float]:
        """One no-grad forward over the prompts of `rows[:count]` (cycled up to a multiple of DP x micro_batch_size)
        measures the first amax (collective; every rank holds the same rows)."""
        from megatron_rl.parallel import state
        from megatron_rl.phases.logprobs import _global_forward

        batch = prompt_batch(tokenizer, rows, count, state.dp_size() * micro_batch_size, seq_multiple,
                             learner.arch.max_seq_len)
        with self.measuring():
            _global_forward(learner, batch, micro_batch_size)
        return self.observe()

    def state_dict(self) -> dict:
        """Picklable state (the tracker's window)."""
        return self.tracker.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()` output."""
        self.tracker.load_state_dict(sd)


def prompt_batch(tokenizer, rows, count: int, multiple: int, seq_multiple: int, max_len: int):
    """A TrainBatch of the prompts of `rows` (the first `count`, cycled to a multiple of `multiple` rows) whose loss mask
    covers every prompt token, so that `cached_positions` counts exactly the tokens a prefill caches."""
    from megatron_rl.phases.batching import build_train_batch
    from megatron_rl.phases.rollout import encode_prompts
    from megatron_rl.types import Sample

    n = -(-max(1, min(count, len(rows))) // multiple) * multiple
    picked = [rows[k % len(rows)] for k in range(n)]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    samples = []
    for p in encode_prompts(tokenizer, picked):
        p = p[: max(1, max_len - seq_multiple + 1)]  # padded up to seq_multiple, it still fits the model
        samples.append(Sample(prompt_ids=p[:1], response_ids=p[1:] + [eos], rollout_logprobs=[0.0] * len(p),
                              finish_reason="stop", group_id=0))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return build_train_batch(samples, torch.zeros(len(samples)), pad, seq_multiple, max_len)  # device-ok: host-side batch


def start(session) -> Optional[KvCacheScales]:
    """The run's KvCacheScales (None unless precision recalibrates the FP8 KV cache scales): restored from the resumed
    RL state, else calibrated on the first training prompts (collective)."""
    cfg = session.cfg
    if not cfg.precision.recalibrates_kv_scales:
        return None
    from megatron_rl.phases.batching import seq_multiple

    kv = KvCacheScales(session.learner, cfg.precision)
    saved: Any = session.rl_state.get(STATE_KEY)
    if saved is not None:
        kv.load_state_dict(saved)
    else:
        kv.calibrate(session.learner, session.tokenizer, session.train_rows, cfg.train.micro_batch_size,
                     seq_multiple(cfg.parallel, cfg.precision), cfg.train.prompts_per_step)
    return kv
