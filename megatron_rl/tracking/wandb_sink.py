"""Weights & Biases sink beside the JSONL/TensorBoard writers (tracking.wandb: true).

wandb is an optional extra, imported only when a run asks for it (the config refuses tracking.wandb
without the package, naming the field). The run's files go under <run_dir>/wandb; in offline mode
(the default) nothing touches the network and `wandb sync <run_dir>/wandb/offline-run-*` uploads
later. The W&B run id derives from the run directory, so a resumed run continues the same W&B run.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Optional


def run_id(run_dir: str | Path) -> str:
    """A stable W&B run id for a run directory (same directory, same id: resumes continue the run)."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class WandbSink:
    """Logs numeric step metrics to one W&B run."""

    def __init__(self, run_dir: str | Path, project: str, name: Optional[str], mode: str, config: dict[str, Any]) -> None:
        """Start (or resume) the W&B run of `run_dir` with the resolved config attached."""
        import wandb

        out = Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name or out.resolve().name, mode=mode, dir=str(out),
                              id=run_id(out), resume="allow", config=config, reinit="create_new")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Log the finite numeric metrics of one step."""
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        self.run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the run and stop W&B's service process, which writes the run file: only then is it complete on disk."""
        import wandb

        self.run.finish()
        wandb.teardown()


def open_sinks(cfg, run_dir: str | Path) -> list[WandbSink]:
    """The extra metric sinks `cfg.tracking` asks for (W&B), to hand to MetricsWriter."""
    t = cfg.tracking
    if not t.wandb:
        return []
    return [WandbSink(run_dir, t.wandb_project, t.wandb_name, t.wandb_mode, cfg.model_dump(mode="json"))]
