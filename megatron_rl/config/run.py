"""The run config (all sections) and the only place that parses: YAML files plus dotted overrides.

A YAML file may start with `base: other.yaml` (relative path): the other file is loaded first and
this one is merged over it, section by section.

    cfg = load_config("examples/configs/tiny_grpo.yaml", ["train.steps=5", "algo.calibration.enabled=true"])

Unknown keys, wrong types and invalid values raise ConfigError naming the dotted key.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError, ValidationInfo, model_validator

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.config.base import StrictConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.train import CheckpointConfig, SftConfig, TrackingConfig, TrainConfig
from megatron_rl.config.yaml_io import YAMLInputError, load_yaml, load_yaml_file


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
    def _check_across_sections(self, info: ValidationInfo) -> "RunConfig":
        errors = config_errors(self, dp_size=1, layout=(info.context or {}).get("check_layout", True))
        if errors:
            raise ValueError("; ".join(errors))
        return self


def config_errors(cfg: RunConfig, dp_size: int, sft: bool = True, layout: bool = True) -> list[str]:
    """Cross-section problems of `cfg` for a data-parallel size, each naming its dotted fields ([] when usable).

    Load time checks DP = 1 (the world size is not known yet); the run checks again with the real
    DP size right after the process groups exist, before any data or model work (`sft=False` when
    the supervised warm start will not run, so its batch geometry does not matter). `layout=False`
    leaves out the TP/PP split of the model (`megatron-rl plan` reports those problems by code).
    """
    t, s, p = cfg.train, cfg.sft, cfg.parallel
    out = []
    rows = t.prompts_per_step * cfg.rollout.n_samples_per_prompt
    unit = dp_size * t.num_minibatches * t.micro_batch_size
    if rows % unit:
        out.append(f"train.prompts_per_step * rollout.n_samples_per_prompt = {rows} samples must be divisible by "
                   f"data-parallel size ({dp_size}) * train.num_minibatches ({t.num_minibatches}) * "
                   f"train.micro_batch_size ({t.micro_batch_size}) = {unit}")
    elif p.virtual_pipeline_model_parallel_size and rows // unit < p.pipeline_model_parallel_size:
        out.append(f"{rows // unit} micro-batches per mini-batch and data-parallel rank (train.prompts_per_step * "
                   f"rollout.n_samples_per_prompt / (DP {dp_size} * train.num_minibatches * train.micro_batch_size)) "
                   f"is fewer than parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size}, which the "
                   "interleaved schedule (parallel.virtual_pipeline_model_parallel_size) needs")
    if sft and s.global_batch_size % (dp_size * s.micro_batch_size):
        out.append(f"sft.global_batch_size ({s.global_batch_size}) must be divisible by data-parallel size ({dp_size}) "
                   f"* sft.micro_batch_size ({s.micro_batch_size})")
    if sft and s.eval_every and cfg.data.train_file is None and s.eval_prompts >= cfg.data.num_train_prompts:
        out.append(f"sft.eval_prompts ({s.eval_prompts}) leaves none of data.num_train_prompts ({cfg.data.num_train_prompts}) "
                   "for the warm start to train on (the checks score prompts it never trains on): lower it or set sft.eval_every=0")
    if sft and s.teacher_carry_drop and cfg.data.train_file is None and cfg.data.task != "addition":
        # rows read from data.train_file are checked one by one when the warm start starts (file:line named)
        out.append(f"sft.teacher_carry_drop ({s.teacher_carry_drop}) rewrites 'a+b=' demonstrations: it needs "
                   f"data.task=addition (got {cfg.data.task}) or a data.train_file of addition rows")
    lmax = cfg.algo.dapo.max_response_length or cfg.rollout.sampling.max_new_tokens
    if cfg.algo.dapo.overlong_buffer and cfg.algo.dapo.overlong_buffer >= lmax:
        out.append(f"algo.dapo.overlong_buffer ({cfg.algo.dapo.overlong_buffer}) must be smaller than "
                   f"algo.dapo.max_response_length or rollout.sampling.max_new_tokens ({lmax})")
    if cfg.algo.dapo.dynamic_sampling and cfg.rollout.n_samples_per_prompt < 2:
        out.append("algo.dapo.dynamic_sampling keeps groups whose rewards differ, which needs rollout.n_samples_per_prompt >= 2")
    updates = t.num_minibatches * t.ppo_epochs
    if cfg.algo.calibration.enabled and updates < 2:
        # the first update of a step is on-policy (ratio 1 in high precision): nothing to calibrate on
        out.append(f"algo.calibration.enabled needs an off-policy update: train.num_minibatches * train.ppo_epochs "
                   f"= {t.num_minibatches} * {t.ppo_epochs} = {updates}, must be >= 2")
    a = cfg.algo
    if a.policy_loss.clip_decision == "high_precision":
        p = "algo.policy_loss.clip_decision=high_precision"
        if cfg.precision.recipe == "none":
            out.append(f"{p} decides the clip on a high-precision ratio instead of the learner's, but precision.recipe=none "
                       "already trains in high precision")
        if a.policy_loss.name not in ("ppo", "dual_clip"):
            out.append(f"{p} changes the PPO clip decision; algo.policy_loss.name={a.policy_loss.name} has none (ppo or dual_clip)")
        if a.calibration.enabled:
            out.append(f"{p} already clips what high precision clips, token by token; algo.calibration.enabled would "
                       "calibrate on top of it (turn one of them off: algo.calibration.strength=decision is "
                       "this decision with the calibration's measurements beside it)")
        if a.experimental.clip_error_scale != 1.0:
            out.append(f"{p} and algo.experimental.clip_error_scale both set the clip decision (the instrument at 0 is this option)")
    c = a.calibration
    if c.enabled and a.policy_loss.name not in ("ppo", "dual_clip"):
        if c.strength in ("decision", "targeted"):
            out.append(f"algo.calibration.strength={c.strength} decides the PPO clip on high-precision ratios; "
                       f"algo.policy_loss.name={a.policy_loss.name} has no clip decision (ppo or dual_clip): set "
                       "algo.calibration.strength to full")
    out += fp8_params_errors(cfg)
    out += a.experimental.problems(cfg.precision.recipe, a.policy_loss.name, a.calibration.enabled,
                                   a.calibration.shadow_fraction, a.calibration.bounds_update)
    if layout:
        out.extend(layout_errors(cfg))
    out.extend(kv_scale_errors(cfg))
    if t.health.max_kl_ref is not None and cfg.algo.kl.coef == 0:
        out.append("train.health.max_kl_ref needs the reference policy: set algo.kl.coef > 0 or unset train.health.max_kl_ref")
    return out


def fp8_params_errors(cfg: RunConfig) -> list[str]:
    """precision.fp8_params=true beside a setting that needs high-precision forwards of the learner (one error each)."""
    if not cfg.precision.fp8_params:
        return []
    a = cfg.algo
    # With FP8 parameters the weights themselves are quantized: TE's cast_if_needed leaves a quantized weight as
    # it is, so a forward with FP8 autocast off still multiplies FP8 weights (or fails): it is no high-precision forward.
    needs = [(a.calibration.enabled, "algo.calibration.enabled=true", "set algo.calibration.enabled=false"),
             (a.policy_loss.clip_decision == "high_precision", "algo.policy_loss.clip_decision=high_precision",
              "set algo.policy_loss.clip_decision=learner"),
             (a.experimental.clip_error_scale != 1.0,
              f"algo.experimental.clip_error_scale={a.experimental.clip_error_scale:g}",
              "set algo.experimental.clip_error_scale=1")]
    return [f"precision.fp8_params=true stores the learner's weights in FP8, so the high-precision forwards that {field} "
            f"runs would multiply FP8 weights (TE's cast_if_needed leaves a quantized weight as it is): set "
            f"precision.fp8_params=false or {fix}" for on, field, fix in needs if on]


def sglang_drops_kv_scales(cfg: RunConfig) -> bool:
    """Whether the run's engines are SGLang (started or external) serving a model whose K/V scales SGLang 0.5.23 drops."""
    from megatron_rl.models.presets import get_preset
    from megatron_rl.precision.kv_scales import SGLANG_KV_SCALE_FAMILIES

    if cfg.rollout.engine == "embedded":
        return False
    return get_preset(cfg.model.preset).family not in SGLANG_KV_SCALE_FAMILIES


def kv_scale_errors(cfg: RunConfig) -> list[str]:
    """precision.kv_cache_scales=recalibrate where SGLang cannot load the scales (precision/kv_scales.py: Qwen3)."""
    from megatron_rl.models.presets import get_preset

    if cfg.precision.kv_cache_scales != "recalibrate" or not sglang_drops_kv_scales(cfg):
        return []
    return [f"precision.kv_cache_scales=recalibrate cannot reach rollout.engine={cfg.rollout.engine} engines serving a "
            f"{cfg.model.preset} ({get_preset(cfg.model.preset).family}) model: SGLang 0.5.23's Qwen3Attention builds its RadixAttention "
            "without quant_config (srt/models/qwen3.py), so no k_scale/v_scale parameters exist and the scales are "
            "dropped; use precision.kv_cache_scales=unit (or auto)"]


def layout_errors(cfg: RunConfig, arch=None) -> list[str]:
    """TP / PP x VPP against the model (heads, query groups, FFN, vocabulary, layers): `megatron-rl plan`'s own checks.

    `arch` is the learner's architecture when known (the init checkpoint's vocabulary); by default the
    model section's (preset + overrides), which is what `megatron-rl config` and `plan` see.
    """
    from megatron_rl.models.presets import resolve_architecture
    from megatron_rl.plan.checks import architecture_checks

    p = cfg.parallel
    if arch is None:
        try:
            arch = resolve_architecture(cfg.model)
        except ValueError as exc:  # an unknown preset or inconsistent overrides: reported as such
            return [str(exc)]
    return [f.message for f in architecture_checks(arch, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                                   p.virtual_pipeline_model_parallel_size) if f.level == "error"]


def check_config_for_world(cfg: RunConfig, dp_size: int, sft: bool = True) -> None:
    """Raise ConfigError (naming the fields) when `cfg` cannot run with `dp_size` data-parallel ranks (and the warm start when `sft`)."""
    errors = config_errors(cfg, dp_size, sft)
    if errors:
        raise ConfigError(f"invalid config for data-parallel size {dp_size}: " + "; ".join(errors))


def dotted_field_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of `model`: sections and leaf fields (e.g. 'algo', 'algo.policy_loss.eps_low')."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(dotted_field_paths(ann, f"{prefix}{name}."))
    return out


def suggest_keys(unknown: str, paths: Optional[list[str]] = None, n: int = 3) -> list[str]:
    """The valid dotted keys nearest to `unknown` (at most `n`, best first, near-ties of the best only): by the
    whole path, or by its last component alone (so a right name in the wrong section is found)."""
    paths = dotted_field_paths() if paths is None else paths
    last = unknown.rsplit(".", 1)[-1]

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    scored = []
    for path in paths:
        whole, tail = ratio(unknown, path), ratio(last, path.rsplit(".", 1)[-1])
        # the last component decides, the whole path breaks ties between equal leaf names in different sections
        score = max(whole, 0.9 * tail + 0.1 * whole)
        if score >= 0.6:
            scored.append((score, path))
    scored.sort(key=lambda sp: (-sp[0], sp[1]))
    # only near-ties of the best: a list of loosely similar names would bury the one that was meant
    return [path for score, path in scored[:n] if score >= scored[0][0] - 0.1]


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            near = suggest_keys(loc)
            msg = "unknown key" + (f" (did you mean {' or '.join(near)}?)" if near else "")
        got = f" (got {err['input']!r})" if err["type"] != "extra_forbidden" and "input" in err and not isinstance(err["input"], dict) else ""
        lines.append((f"{loc}: {msg}" if loc else msg) + got)
    # one line, as every `error:` the CLI prints (several problems are separated by "; ")
    return f"invalid config ({source}): " + "; ".join(" ".join(line.split()) for line in lines)


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
    try:
        node[parts[-1]] = load_yaml(raw, f"override '{override}'") if raw.strip() else ""
    except YAMLInputError as exc:
        raise ConfigError(str(exc)) from None


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
        loaded = load_yaml_file(path) or {}
    except YAMLInputError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a path to another config file")
    return _deep_merge(_read_yaml(path.parent / base, seen + (path.resolve(),)), loaded)


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = (), check_layout: bool = True,
                check_device: bool = True, device_facts=None, engine_device: bool = True) -> RunConfig:
    """Build a RunConfig from an optional YAML file and dotted overrides (applied in order).

    `check_layout=False` accepts a TP/PP layout that does not split the model (for `megatron-rl plan`, which
    reports every problem of a layout by its code); everything else is checked. `check_device` also refuses
    what this machine's device cannot run for the learner (`device_errors`; `device_facts` default: this
    process's, detected once); `engine_device` resolves the engine-dependent `auto` values for engines on
    this machine's kind of GPU and refuses what such engines would serve differently (`resolve_for_engines`).
    `plan` does both against its --gpu instead; `engines` nodes do not run the learner (check_device=False).
    """
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
        cfg = RunConfig.model_validate(tree, context={"check_layout": check_layout})
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None
    errors = device_errors(cfg, device_facts) if check_device else []
    if engine_device:
        cfg, engine_errors = resolve_for_engines(cfg, device_facts)
        errors += engine_errors
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return cfg


def resolve_for_engines(cfg: RunConfig, facts=None) -> tuple[RunConfig, list[str]]:
    """(cfg with precision.rollout_scale_fmt auto made concrete, problems) for the rollout engines of this run.

    Engines we start (sglang) or reach (external) are on rollout.engine_gpu when it is set (a mixed cluster, e.g.
    H100 learners with B200 engines), else on this machine's kind of GPU; embedded engines run on CPU. Detection
    happens only for blockwise FP8 rollouts on GPU engines, the one case where the answer depends on the GPU.
    """
    from megatron_rl.precision import device

    prec = cfg.precision
    capability = None
    if prec.rollout_quantization == "fp8-blockwise" and cfg.rollout.engine != "embedded":
        capability = engine_capability(cfg, facts)
    fmt = device.rollout_scale_fmt_for(prec, capability)
    if fmt != prec.rollout_scale_fmt:
        cfg = cfg.model_copy(update={"precision": prec.model_copy(update={"rollout_scale_fmt": fmt})})
    if cfg.precision.kv_cache_scales == "auto" and cfg.precision.kv_cache_dtype == "fp8_e4m3":
        # concrete in the run's record; unit where SGLang would drop the scales (Qwen3) or w8a8_fp8 loads none
        scales = "unit" if sglang_drops_kv_scales(cfg) or not cfg.precision.recalibrates_kv_scales else "recalibrate"
        cfg = cfg.model_copy(update={"precision": cfg.precision.model_copy(update={"kv_cache_scales": scales})})
    return cfg, device.engine_device_errors(cfg.precision, capability)


def engine_capability(cfg: RunConfig, facts=None):
    """Compute capability of the run's GPU engines: rollout.engine_gpu's (plan/hardware.py) when set, else that of the
    device `facts` describes (default: this process's, detected once)."""
    from megatron_rl.precision import device

    if cfg.rollout.engine_gpu is not None:
        from megatron_rl.plan.hardware import get_device

        return get_device(cfg.rollout.engine_gpu).compute_capability
    return (facts if facts is not None else device.detect_device_facts()).capability


def device_errors(cfg: RunConfig, facts=None) -> list[str]:
    """What the device `facts` describes (default: this process's, detected once) cannot run of `cfg`, each naming its field.

    Detection (which imports torch) happens only for configs whose validity depends on the device.
    """
    from megatron_rl.precision import device

    if cfg.precision.recipe == "none":
        return []
    return device.learner_device_errors(cfg.precision, facts if facts is not None else device.detect_device_facts())


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
