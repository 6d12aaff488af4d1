"""Weights & Biases tracking: offline mode writes the run under <run_dir>/wandb with no network, the writer feeds it,
and a config asking for W&B without the package fails at load naming tracking.wandb."""
import importlib.util

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.tracking import MetricsWriter
from megatron_rl.tracking.wandb_sink import open_sinks, run_id


def test_offline_run_is_written_under_the_run_dir(tmp_path):
    cfg = load_config(None, ["tracking.wandb=true", "tracking.wandb_mode=offline", f"run_dir={tmp_path}"])
    writer = MetricsWriter(tmp_path, sinks=open_sinks(cfg, tmp_path))
    for step in range(3):
        writer.write(step, {"reward/mean": 0.25 * step, "clipfrac": float("nan"), "samples": ["1+1=2"]})
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(run_id(tmp_path))
    data = next(runs[0].glob("*.wandb")).read_bytes()
    assert data.count(b"reward/mean") >= 3, "one history record per step"
    assert b"prompts_per_step" in data, "the resolved config is attached to the run"
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_sinks_only_when_asked(tmp_path):
    assert open_sinks(load_config(None, []), tmp_path) == []
    assert run_id(tmp_path) == run_id(tmp_path / "." ) != run_id(tmp_path / "other")


def test_missing_package_is_a_load_time_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking.*wandb=true needs the wandb package"):
        load_config(None, ["tracking.wandb=true"])
    assert load_config(None, []).tracking.wandb is False  # runs that do not ask never import it
