"""The study spec: one base config, arms (dotted overrides), seeds, steps, output directory.

    base: ../configs/tiny_grpo.yaml          # relative to the spec file
    output_dir: runs/studies/fp8_harm        # relative to the working directory, like run_dir
    steps: 100
    seeds: [1, 2, 3]
    overrides: {rollout.sampling.temperature: 1.5}   # every arm and the shared warm start
    arms:
      - {name: bf16, overrides: {precision.recipe: none}}
      - {name: fp8, overrides: {precision.recipe: blockwise, precision.rollout_quantization: fp8-blockwise}}

A "seed" sets every field of `seed_fields` to its value; the warm start (SFT, data, tokenizer) is
shared by every arm and seed, so arms may not change model.*, data.* or sft.* (put such changes in
the study's `overrides`: one study per warm start). With `warm_start: per_run` only the data is
shared: every run trains its own SFT warm start in its run directory (what the main job does), so a
seed and an arm's `kernels` (the CPU kernel path of its runs, megatron_rl/cpu_kernels.py) shape it
too, and arms may change model.* and sft.*. Every run config is built and validated when the
spec loads (`load_study`), so a spec that loads does not fail on a config value hours later.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, field_validator, model_validator

from megatron_rl.config import ConfigError, RunConfig, load_config
from megatron_rl.config.base import StrictConfig
from megatron_rl.config.yaml_io import YAMLInputError, load_yaml_file
from megatron_rl.cpu_kernels import KERNEL_PATHS

SHARED_PREFIXES = ("model.", "data.", "sft.")
"""Arm overrides may not touch these sections: they define the warm start every arm shares."""
RUNNER_KEYS = ("run_dir", "train.steps", "checkpoint.resume", "checkpoint.save_every")
"""Set by the runner for every run; no override may set them."""


class StudyError(ValueError):
    """A spec or study directory that cannot be used; the message names the field or file."""


class ArmSpec(StrictConfig):
    """One arm: a name and the dotted overrides that make it differ from the base config."""

    name: str
    """Arm name (letters, digits, '.', '_', '-'): the run directory runs/<name>/seed<seed>."""
    overrides: dict[str, Any] = {}
    """Dotted config keys and their values, applied after the study's shared overrides."""
    kernels: Optional[str] = None
    """CPU kernel path of this arm's runs, a name in megatron_rl.cpu_kernels.KERNEL_PATHS (native, avx2, plain); None: the pins."""

    @field_validator("kernels")
    @classmethod
    def _kernels(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v not in KERNEL_PATHS:
            raise ValueError(f"unknown kernel path {v!r}; valid: {', '.join(KERNEL_PATHS)}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError(f"arm name {v!r} may only use letters, digits, '.', '_' and '-'")
        return v


class StudySpec(StrictConfig):
    """Arms x seeds of RL runs from one shared warm start, run one after another."""

    base: str
    """Base run config (YAML), relative to the spec file."""
    output_dir: str
    """Study directory: warm_start/, runs/<arm>/seed<seed>/, RESULTS.md and the plots (relative to the working directory)."""
    report_dir: Optional[str] = None
    """Where RESULTS.md and the plots go (relative to the working directory); default output_dir. Specs sharing one
    output_dir (and so its runs) keep their reports apart with it."""
    steps: int
    """RL steps of every run (train.steps)."""
    seeds: list[int] = [1]
    """Seeds; each run of an arm sets every field of seed_fields to one of them."""
    seed_fields: list[str] = ["train.seed", "rollout.seed", "precision.fp4_seed"]
    """Config fields a seed sets (the warm start keeps the base config's seeds)."""
    overrides: dict[str, Any] = {}
    """Dotted overrides shared by the warm start and every arm (model, data and SFT changes go here)."""
    warm_start: Literal["shared", "per_run"] = "shared"
    """shared: one SFT warm start for every run (arms may not change model., data., sft.); per_run: each run trains its own in its run directory (data still shared)."""
    arms: list[ArmSpec] = Field(min_length=1)
    """The arms, in run and report order."""
    reference_arm: Optional[str] = None
    """Arm that RESULTS.md compares the others against (e.g. the high-precision one); default the first arm."""
    checkpoint_every: int = 10
    """RL checkpoint interval of every run: a killed run resumes from its newest checkpoint."""
    torch_threads: int = 1
    """CPU threads per process of a run (OMP_NUM_THREADS of the child; 1 keeps runs comparable on a shared box)."""
    nproc: int = 1
    """Learner processes per run (torchrun when > 1)."""
    tail_fraction: float = 0.2
    """'last' metrics average the last this fraction of steps."""
    from_step: int = 0
    """'from step N' metrics average the steps from this one on (e.g. once the first calibration solve took effect)."""
    smooth_window: int = 5
    """Centered rolling-mean window (steps) of the dense curves in curves.png (1: raw)."""
    frontier: bool = False
    """Also write FRONTIER.md and frontier.png: each setting's quality at k = 1 and 8 against its planned cost at 8B and 32B (megatron_rl/study/frontier.py)."""

    @model_validator(mode="after")
    def _check(self) -> "StudySpec":
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list of distinct integers, got {self.seeds}")
        if any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be >= 0, got {self.seeds}")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be distinct, got {names}")
        if self.reference_arm is not None and self.reference_arm not in names:
            raise ValueError(f"reference_arm {self.reference_arm!r} is not one of the arms {names}")
        for name, value, low in (("checkpoint_every", self.checkpoint_every, 1), ("torch_threads", self.torch_threads, 1),
                                 ("from_step", self.from_step, 0),
                                 ("nproc", self.nproc, 1), ("smooth_window", self.smooth_window, 1)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not 0 < self.tail_fraction <= 1:
            raise ValueError(f"tail_fraction must be in (0, 1], got {self.tail_fraction}")
        for key in self.overrides:
            _forbid(key, RUNNER_KEYS + tuple(self.seed_fields), "overrides")
        for i, arm in enumerate(self.arms):
            where = f"arms[{i}] ({arm.name}).overrides"
            for key in arm.overrides:
                _forbid(key, RUNNER_KEYS + tuple(self.seed_fields), where)
                shared = SHARED_PREFIXES if self.warm_start == "shared" else ("data.",)
                if key.startswith(shared):
                    raise ValueError(f"{where}: {key!r} would change the {'warm start' if self.warm_start == 'shared' else 'data'} "
                                     "every arm shares; put it in the study's overrides (one study per warm start)")
        return self

    @property
    def reference(self) -> str:
        """Name of the reference arm."""
        return self.reference_arm or self.arms[0].name


def _forbid(key: str, forbidden: tuple[str, ...], where: str) -> None:
    if key in forbidden:
        raise ValueError(f"{where}: {key!r} is set by the study runner (steps, seeds, run directories, checkpoints)")


def as_overrides(mapping: dict[str, Any]) -> list[str]:
    """'key=value' strings of a mapping; values as JSON (valid YAML), so the config parser reads them back exactly."""
    return [f"{k}={json.dumps(v)}" for k, v in mapping.items()]


class Study:
    """A loaded spec with its resolved paths and the run configs it implies."""

    def __init__(self, spec: StudySpec, spec_path: Path):
        """Resolve paths against the spec file (base) and the working directory (output_dir)."""
        self.spec = spec
        self.spec_path = spec_path
        self.base = (spec_path.parent / spec.base).resolve()
        self.out = Path(spec.output_dir)
        self.warm_dir = self.out / "warm_start"
        self.report_out = Path(spec.report_dir) if spec.report_dir else self.out

    def run_dir(self, arm: str, seed: int) -> Path:
        """Directory of one arm-seed run."""
        return self.out / "runs" / arm / f"seed{seed}"

    def runs(self) -> list[tuple[str, int]]:
        """(arm, seed) pairs in run order: seed-major, so every arm has a first seed early in a long study."""
        return [(arm.name, seed) for seed in self.spec.seeds for arm in self.spec.arms]

    def warm_start_config(self, extra: list[str] = ()) -> RunConfig:
        """The shared warm start's config: base + shared overrides (run_dir = warm_start/)."""
        return load_config(self.base, [*as_overrides(self.spec.overrides), *extra, f"run_dir={json.dumps(str(self.warm_dir))}"])

    def warm_overrides(self) -> list[str]:
        """Overrides pointing a run at the shared warm start: the data files and tokenizer (when the base
        config generates them) and the SFT export (when it sets no model.init_checkpoint and the warm start is
        shared; per_run runs train their own). Pure: computes
        the paths the runner's prepare_warm_start creates."""
        from megatron_rl.warm_start import sft_dir

        cfg = self.warm_start_config()
        d = cfg.data
        out: list[str] = []
        if d.train_file is None or d.tokenizer_dir is None or (d.eval_file is None and d.num_eval_prompts > 0):
            data_dir = self.warm_dir / "data"  # the layout of megatron_rl.data.prepare.prepare_task_data
            for field, name in (("train_file", "train.jsonl"), ("tokenizer_dir", "tokenizer"), ("eval_file", "eval.jsonl")):
                if getattr(d, field) is None and (field != "eval_file" or d.num_eval_prompts > 0):
                    out.append(f"data.{field}={json.dumps(str(data_dir / name))}")
        if cfg.model.init_checkpoint is None and self.spec.warm_start == "shared":
            hf = sft_dir(self.warm_start_config(out), self.warm_dir) / "hf"
            out.append(f"model.init_checkpoint={json.dumps(str(hf))}")
        return out

    def run_overrides(self, arm: str, seed: int, warm: list[str]) -> list[str]:
        """Overrides of one run, in order: shared, warm start, arm, runner (steps, checkpoints), seed, run_dir."""
        arm_spec = next(a for a in self.spec.arms if a.name == arm)
        return [
            *as_overrides(self.spec.overrides), *warm, *as_overrides(arm_spec.overrides),
            f"train.steps={self.spec.steps}", f"checkpoint.save_every={self.spec.checkpoint_every}",
            "checkpoint.resume=true", "tracking.progress_bar=false",
            *(f"{f}={seed}" for f in self.spec.seed_fields),
            f"run_dir={json.dumps(str(self.run_dir(arm, seed)))}",
        ]

    def run_config(self, arm: str, seed: int, warm: list[str]) -> RunConfig:
        """Validated config of one run; ConfigError names the arm and seed."""
        try:
            return load_config(self.base, self.run_overrides(arm, seed, warm))
        except ConfigError as exc:
            raise StudyError(f"{self.spec_path}: arm {arm!r} seed {seed}: {exc}") from None


def load_study(path: str | Path) -> Study:
    """Read and validate a study spec file (StudyError names the file and field)."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study spec not found: {path}")
    try:
        raw = load_yaml_file(path) or {}
    except YAMLInputError as exc:
        raise StudyError(str(exc)) from None
    try:
        spec = StudySpec.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            lines.append(f"{loc}: {'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}")
        raise StudyError(f"invalid study spec ({path}): " + "; ".join(" ".join(line.split()) for line in lines)) from None
    study = Study(spec, path)
    if not study.base.is_file():
        raise StudyError(f"{path}: base config not found: {study.base}")
    try:
        warm = study.warm_overrides()
    except ConfigError as exc:
        raise StudyError(f"{path}: warm start (base + overrides): {exc}") from None
    for arm, seed in study.runs():  # every run validates now, so nothing fails after hours of running
        study.run_config(arm, seed, warm)
    return study
