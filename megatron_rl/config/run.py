"""The run config (all sections) and the only place that parses: YAML files plus dotted overrides.

A YAML file may start with `base: other.yaml` (relative path): the other file is loaded first and
this one is merged over it, section by section.

    cfg = load_config("examples/configs/tiny_grpo.yaml", ["train.steps=5", "algo.calibration.enabled=true"])

Unknown keys, wrong types and invalid values raise ConfigError naming the dotted key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import ValidationError, model_validator

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.config.base import StrictConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.train import CheckpointConfig, SftConfig, TrackingConfig, TrainConfig


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


class RunConfig(StrictConfig):
    """Everything one run needs; each section is documented in its own module."""

    run_dir: str = "runs/default"
    """Directory of this run: metrics, checkpoints, weights, generated data."""
    model: ModelConfig = ModelConfig()
    """Architecture."""
    parallel: ParallelConfig = ParallelConfig()
    """Learner parallel layout."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    precision: PrecisionConfig = PrecisionConfig()
    """FP8 policy of learner and rollout."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout engines, client and weight sync."""
    data: DataConfig = DataConfig()
    """Prompts, tokenizer and reward."""
    algo: AlgoConfig = AlgoConfig()
    """Advantages, policy loss, calibrated clipping, rollout correction."""
    train: TrainConfig = TrainConfig()
    """RL step schedule and batch sizes."""
    sft: SftConfig = SftConfig()
    """Supervised warm start."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Distributed checkpoints and resume."""
    tracking: TrackingConfig = TrackingConfig()
    """Metrics outputs."""

    @model_validator(mode="after")
    def _calibration_needs_off_policy_update(self) -> "RunConfig":
        # the first update of a step is on-policy (ratio 1 in high precision): nothing to calibrate on
        updates = self.train.num_minibatches * self.train.ppo_epochs
        if self.algo.calibration.enabled and updates < 2:
            raise ValueError(
                f"algo.calibration.enabled needs an off-policy update: train.num_minibatches * train.ppo_epochs "
                f"= {self.train.num_minibatches} * {self.train.ppo_epochs} = {updates}, must be >= 2")
        return self


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "extra_forbidden" and "input" in err and not isinstance(err["input"], dict) else ""))
    return f"invalid config ({source}):\n" + "\n".join(lines)


def apply_override(tree: dict, override: str) -> None:
    """Apply one 'dotted.key=value' override to a nested dict (value parsed as YAML)."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' is not of the form dotted.key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{override}' has an empty key component")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{part}' is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A YAML config with its `base:` chain merged underneath (paths relative to the file)."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: circular 'base:' chain")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a path to another config file")
    return _deep_merge(_read_yaml(path.parent / base, seen + (path.resolve(),)), loaded)


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Build a RunConfig from an optional YAML file and dotted overrides (applied in order)."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        tree = _read_yaml(path)
        source = str(path)
    overrides = list(overrides)
    for item in overrides:
        apply_override(tree, item)
    if overrides:
        source += " + overrides"
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


SECRET_FIELDS = (("rollout", "api_key"),)
"""Dotted fields whose values never reach a file: run directories get copied and shared."""


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data, secrets replaced by '<redacted>' (what config.yaml holds)."""
    tree = cfg.model_dump(mode="json")
    for section, key in SECRET_FIELDS:
        if tree.get(section, {}).get(key) is not None:
            tree[section][key] = "<redacted>"
    return tree


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the fully resolved config as YAML (the run's record of what it ran; secrets redacted)."""
    Path(path).write_text(yaml.safe_dump(config_record(cfg), sort_keys=False))
