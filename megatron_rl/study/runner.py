"""Run a study: the shared warm start once, then every arm x seed one after another, then RESULTS.md.

Resumable at every level: the data and the SFT warm start are reused when present; a finished run
(final checkpoint holding the after-RL evaluation) is skipped; a killed run resumes from its newest
checkpoint (runs are saved every `checkpoint_every` steps). Before anything runs, every run's
config is built and compared with the config.yaml an earlier attempt left in its directory, so a
changed spec never silently mixes old and new runs.

Each run is a `megatron-rl train` subprocess (fresh torch.distributed state and engines), its output
appended to <run_dir>/study.log.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import yaml

from megatron_rl.config.algo import REMOVED_CALIBRATION_FIELDS
from megatron_rl.config.run import config_record
from megatron_rl.cpu_kernels import kernel_path_env, pinned_env
from megatron_rl.study import results
from megatron_rl.config.yaml_io import load_yaml_file
from megatron_rl.study.spec import Study, StudyError, as_overrides


def child_env(study: Study, arm: Optional[str] = None) -> dict[str, str]:
    """Environment of a run: the spec's CPU threads per process, the CPU kernels (the arm's `kernels` path, else the
    pins of megatron_rl/cpu_kernels.py), this package importable."""
    kernels = next((a.kernels for a in study.spec.arms if a.name == arm), None)
    env = pinned_env(os.environ) if kernels is None else kernel_path_env(os.environ, kernels)
    env["OMP_NUM_THREADS"] = str(study.spec.torch_threads)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def cli_command(study: Study, command: str, overrides: list[str], nproc: int = 1) -> list[str]:
    """argv of `megatron-rl <command> BASE overrides...` (under torchrun when nproc > 1)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    return [*launcher, "-m", "megatron_rl.cli", command, str(study.base), *overrides]


def _run_logged(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, float]:
    """Run cmd with stdout/stderr appended to `log`; (return code, wall seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("a") as fh:
        fh.write(f"\n=== {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - start


def prepare_warm_start(study: Study, say: Callable[[str], None] = print) -> list[str]:
    """Make the shared warm start's data and SFT (each once, reused when present); returns Study.warm_overrides()."""
    from megatron_rl.data.prepare import prepare_task_data

    cfg = study.warm_start_config()
    _check_warm_start_config(study, cfg)
    warm = study.warm_overrides()
    if any(o.startswith("data.") for o in warm):
        prepare_task_data(cfg.data, study.warm_dir / "data")
    if cfg.model.init_checkpoint is not None or study.spec.warm_start == "per_run":
        return warm
    data = [o for o in warm if o.startswith("data.")]
    hf = Path(json.loads(warm[-1].split("=", 1)[1]))
    if (hf / "model.safetensors").exists():
        say(f"warm start: reusing {hf}")
        return warm
    say(f"warm start: SFT ({cfg.sft.steps} steps) -> {hf}")
    cmd = cli_command(study, "sft", [*as_overrides(study.spec.overrides), *data, f"run_dir={json.dumps(str(study.warm_dir))}"],
                      study.spec.nproc)
    rc, wall = _run_logged(cmd, child_env(study), study.warm_dir / "sft.log")
    if rc != 0 or not (hf / "model.safetensors").exists():
        raise StudyError(f"warm start failed (rc={rc}); see {study.warm_dir / 'sft.log'}")
    say(f"warm start: done in {wall:.0f} s")
    return warm


WARM_START_RECORD = "warm_start_config.yaml"
"""The warm start's resolved config, recorded in warm_start/ so a later spec cannot silently reuse a different one."""


def _check_warm_start_config(study: Study, cfg) -> None:
    """Record the warm start's config the first time; StudyError when a later spec implies another one."""
    record = study.warm_dir / WARM_START_RECORD
    now = yaml.safe_load(yaml.safe_dump(config_record(cfg), sort_keys=False))
    if record.exists():
        diff = _diff(load_yaml_file(record), now, before_field={})  # the SFT reads none of BEHAVIOUR_BEFORE_FIELD
        if diff:
            raise StudyError(f"{study.warm_dir} was made from a different config than {study.spec_path} now gives the warm "
                             f"start ({'; '.join(diff[:4])}); delete it or use another output_dir")
        return
    study.warm_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(yaml.safe_dump(now, sort_keys=False))


def check_existing_runs(study: Study, warm: list[str]) -> None:
    """StudyError when a run directory holds a run made with a different config than the spec now implies."""
    for arm, seed in study.runs():
        cfg = study.run_config(arm, seed, warm)
        recorded = study.run_dir(arm, seed) / "config.yaml"
        if not recorded.exists():
            continue
        old, new = load_yaml_file(recorded), yaml.safe_load(yaml.safe_dump(config_record(cfg), sort_keys=False))
        diff = _diff(old, new)
        if diff:
            raise StudyError(f"{recorded} was made with a different config than {study.spec_path} now gives arm {arm!r} "
                             f"seed {seed} ({'; '.join(diff[:4])}); delete that run directory or use another output_dir")


_ABSENT = object()

BEHAVIOUR_BEFORE_FIELD = {"train.old_logprob_batches": "rollout"}
"""Fields added with a default that changes what a run does: a record made before the field existed ran with this value."""


def _removed_calibration_fields(old: dict) -> set[str]:
    """Removed algo.calibration fields of a record that change nothing the code now does: set to the behaviour it
    keeps, read only by a removed rule (which the record's strength or lower_target shows), or the removed seed where
    it drew nothing (shadow_fraction 1)."""
    same = set()
    for k, (kept, _) in REMOVED_CALIBRATION_FIELDS.items():
        if k in old and (kept is None or old[k] == kept or (k == "seed" and old.get("shadow_fraction", 1.0) == 1.0)):
            same.add(k)
    return same


def _diff(old, new, prefix: str = "", before_field: Optional[dict] = None) -> list[str]:
    """Dotted keys whose values differ between a recorded config and the one a spec implies now, except what cannot
    change a run: fields the record lacks (added to the code since, with defaults that keep the old behaviour, as the
    project's configs do; those whose default does not keep it are in BEHAVIOUR_BEFORE_FIELD), algo.calibration.*
    while calibration is off in both (no part of it is read then) and removed algo.calibration fields that change
    nothing now (`_removed_calibration_fields`). So runs made before such an addition, or before a
    change of calibration defaults, are reused, not refused."""
    if isinstance(old, dict) and isinstance(new, dict):
        if prefix == "algo.calibration." and old.get("enabled") is False and new.get("enabled") is False:
            return []
        ignored = _removed_calibration_fields(old) - set(new) if prefix == "algo.calibration." else set()
        out = []
        for k in sorted((set(old) | set(new)) - ignored, key=str):
            if k not in old:
                before = (BEHAVIOUR_BEFORE_FIELD if before_field is None else before_field).get(f"{prefix}{k}", _ABSENT)
                if before is not _ABSENT and before != new.get(k):
                    out.append(f"{prefix}{k}: {before!r} (before the field existed) -> {new.get(k)!r}")
                continue
            out += _diff(old.get(k, _ABSENT), new.get(k, _ABSENT), f"{prefix}{k}.", before_field)
        return out
    if new is _ABSENT:
        new = "(no such field now)"
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def run_study(study: Study, report_only: bool = False, say: Callable[[str], None] = print,
              only_arms: Optional[Sequence[str]] = None, only_seeds: Optional[Sequence[int]] = None) -> int:
    """Run whatever is missing (of `only_arms` and `only_seeds` when given), then write RESULTS.md and the figures;
    returns the number of failed runs."""
    failed = 0
    names = [a.name for a in study.spec.arms]
    unknown = sorted(set(only_arms or ()) - set(names))
    if unknown:
        raise StudyError(f"{study.spec_path}: --arms {' '.join(unknown)}: not arms of this study ({', '.join(names)})")
    stray = sorted(set(only_seeds or ()) - set(study.spec.seeds))
    if stray:
        raise StudyError(f"{study.spec_path}: --seeds {' '.join(map(str, stray))}: not seeds of this study "
                         f"({', '.join(map(str, study.spec.seeds))})")
    if not report_only:
        warm = prepare_warm_start(study, say)
        check_existing_runs(study, warm)
        runs = [(arm, seed) for arm, seed in study.runs()
                if (only_arms is None or arm in only_arms) and (only_seeds is None or seed in only_seeds)]
        for k, (arm, seed) in enumerate(runs, 1):
            run_dir = study.run_dir(arm, seed)
            if results.final_rl_state(run_dir, study.spec.steps) is not None:
                say(f"[{k}/{len(runs)}] {arm} seed {seed}: finished, skipped")
                continue
            first = results.resume_step(run_dir)
            say(f"[{k}/{len(runs)}] {arm} seed {seed}: " + (f"resuming at step {first}" if first else "starting"))
            cmd = cli_command(study, "train", study.run_overrides(arm, seed, warm), study.spec.nproc)
            rc, wall = _run_logged(cmd, child_env(study, arm), run_dir / "study.log")
            with (run_dir / results.ATTEMPTS_FILE).open("a") as fh:
                fh.write(json.dumps({"started": datetime.datetime.now().isoformat(timespec="seconds"),
                                     "wall_s": wall, "returncode": rc, "resumed_from_step": first}) + "\n")
            if rc != 0:
                failed += 1
                say(f"[{k}/{len(runs)}] {arm} seed {seed}: FAILED (rc={rc}) after {wall:.0f} s; see {run_dir / 'study.log'}")
            else:
                say(f"[{k}/{len(runs)}] {arm} seed {seed}: done in {wall:.0f} s")
    out = write_report(study)
    say(f"results: {out}")
    return failed


def measure_study(study: Study, steps: str = "final", views: Sequence[str] = ("hp",), prompts: int = 64,
                  eval_prompts: Optional[int] = None, say: Callable[[str], None] = print,
                  only_arms: Optional[Sequence[str]] = None) -> int:
    """`megatron-rl hp-measure` of every finished run (of `only_arms` when given) with what it still lacks, one
    subprocess each under the run's own environment (threads, CPU kernels); returns the number of failures."""
    from megatron_rl.study import hp_measure

    names = [a.name for a in study.spec.arms]
    unknown = sorted(set(only_arms or ()) - set(names))
    if unknown:
        raise StudyError(f"{study.spec_path}: --arms {' '.join(unknown)}: not arms of this study ({', '.join(names)})")
    settings = hp_measure.settings_record(prompts, 0, eval_prompts)
    runs = [(arm, seed) for arm, seed in study.runs() if only_arms is None or arm in only_arms]
    failed = 0
    for k, (arm, seed) in enumerate(runs, 1):
        run_dir, tag = study.run_dir(arm, seed), f"[{k}/{len(runs)}] {arm} seed {seed}"
        if results.final_rl_state(run_dir, study.spec.steps) is None:
            say(f"{tag}: not finished, not measured")
            continue
        try:
            todo = hp_measure.pending(run_dir, steps, views, settings)
        except ValueError as exc:
            failed += 1
            say(f"{tag}: {exc}")
            continue
        if not todo:
            say(f"{tag}: measured, skipped")
            continue
        cmd = [sys.executable, "-m", "megatron_rl.cli", "hp-measure", str(run_dir), "--steps", steps, "--prompts",
               str(prompts), *(["--eval-prompts", str(eval_prompts)] if eval_prompts is not None else []),
               *(["--own"] if "own" in views else [])]
        say(f"{tag}: measuring {len(todo)} (step, view) pair(s)")
        rc, wall = _run_logged(cmd, child_env(study, arm), run_dir / "hp_measure.log")
        if rc != 0:
            failed += 1
            say(f"{tag}: hp-measure FAILED (rc={rc}) after {wall:.0f} s; see {run_dir / 'hp_measure.log'}")
        else:
            say(f"{tag}: measured in {wall:.0f} s")
    return failed


def write_report(study: Study) -> Path:
    """RESULTS.md and curves.png / bounds.png / ratio_hist.png from the run directories as they are."""
    from megatron_rl.study import plots

    records = results.collect(study, study.spec.steps)
    by_arm = {a.name: [r for r in records if r.arm == a.name and r.rows] for a in study.spec.arms}
    notes, figures = [], {}
    study.report_out.mkdir(parents=True, exist_ok=True)
    if any(by_arm.values()):
        # a window wider than a tenth of the run would flatten short runs into one value
        window = min(study.spec.smooth_window, max(1, study.spec.steps // 10))
        plots.plot_curves(by_arm, study.spec.steps, study.report_out / "curves.png", window=window)
        figures["Curves per arm (mean over seeds, band: min-max over seeds; shadow-step metrics as markers)"] = "curves.png"
        plots.plot_bounds(by_arm, study.spec.steps, study.report_out / "bounds.png")
        figures["Clip bounds L and H over steps (markers: raw solves; dotted: 1 - eps_low, 1 + eps_high)"] = "bounds.png"
    dumps: dict[str, Optional[dict]] = {}
    for arm in study.spec.arms:
        parts = [d for d in (plots.read_ratio_dumps(r.run_dir) for r in records if r.arm == arm.name) if d is not None]
        dumps[arm.name] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else None
        if not parts:
            notes.append(f"arm `{arm.name}`: no calibration token dumps (runs/<arm>/seed*/calibration/step_*.npz), so no "
                         "log-ratio histogram: they are written on calibration steps with tracking.dump_ratios: true")
    if any(d is not None for d in dumps.values()):
        plots.plot_ratio_histograms(dumps, study.report_out / "ratio_hist.png")
        figures["Per-token low-precision minus high-precision log-ratio, split by advantage sign (calibration steps)"] = "ratio_hist.png"
    for r in records:
        if r.status != "done":
            notes.append(f"`{r.arm}` seed {r.seed}: {r.status} ({len(r.rows)} steps logged); not in the statistics")
    out = results.write_results(study, records, figures, notes)
    if study.spec.frontier:
        from megatron_rl.study.frontier import write_frontier_report

        write_frontier_report(study)
    return out
