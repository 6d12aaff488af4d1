"""Run tracking: per-step metrics to JSONL (+ TensorBoard), phase timers, progress bar, final summary."""
from megatron_rl.tracking.timers import Timers
from megatron_rl.tracking.writer import MetricsWriter, read_metrics

__all__ = ["MetricsWriter", "Timers", "read_metrics"]
