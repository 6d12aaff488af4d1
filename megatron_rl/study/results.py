"""What a study measured: per-run records read from the run directories, per-arm statistics over seeds,
and RESULTS.md. Pure Python (no torch or matplotlib) except reading the final checkpoint's RL state.

Every metric states how one run's value is formed (mean over which steps) in METRICS, and RESULTS.md
prints those definitions next to the numbers.
"""
from __future__ import annotations

import datetime
import json
import math
import pickle
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_rl.config.yaml_io import load_yaml_file
from megatron_rl.study.hp_measure import flat_values, read_measurements

CALIBRATION_ROW_KEYS = ("hp/clipfrac_lower_neg",)
"""A metrics row is a calibration (shadow) step when one of these is a finite number (under bounds_update per_step
every step solves, so a solve alone does not make one)."""


@dataclass(frozen=True)
class MetricDef:
    """One reported metric: its label, the metrics.jsonl key (or eval_before/eval_after) and how a run's value is formed."""

    label: str
    key: str
    reduce: str
    """mean (finite values over all steps), window (steps from the spec's from_step on), tail (last tail_fraction of
    steps), max, calib (calibration steps), eval, measured (the final checkpoint's hp_measure.json entry), late and
    late_std (mean and sample std over the measured checkpoints of the second half of training, LATE_MIN_CHECKPOINTS
    or more), share (sum of `key` over sum of `per` on the rows that log both)."""
    definition: str
    per: Optional[str] = None
    """Denominator key of a `share` metric."""


HP_SAMPLED = ("rollout.n_samples_per_prompt completions each (the run's sampling settings) of a fixed seeded set of "
              "training prompts, the same in every arm and seed (`megatron-rl study SPEC --hp-measure`)")
"""How the hp-measured sampled metrics are formed (megatron_rl/study/hp_measure.py)."""

METRICS = (
    MetricDef("clipfrac_lower_neg", "clipfrac_lower_neg", "mean",
              "fraction of negative-advantage tokens whose ratio is below the lower bound L (the paper's quantity); mean over all steps"),
    MetricDef("clipfrac_lower_neg, high precision (shadow)", "hp/clipfrac_lower_neg", "mean",
              "the same fraction under the high-precision shadow ratios; mean over the steps that ran the shadow pass"),
    MetricDef("clipfrac_lower_neg (from step N)", "clipfrac_lower_neg", "window",
              "the same fraction; mean over the steps from the spec's from_step on (after the first calibration solve took effect)"),
    MetricDef("off-policy clipfrac_lower_neg (from step N)", "offpolicy/clipfrac_lower_neg", "window",
              "the fraction over the off-policy updates only, at the bounds they trained with (what alpha aims at); mean "
              "over the steps from from_step on"),
    MetricDef("clipfrac_upper_pos", "clipfrac_upper_pos", "mean",
              "fraction of positive-advantage tokens whose ratio is above the upper bound H; mean over all steps"),
    MetricDef("entropy (last)", "entropy", "tail", "mean token entropy of the policy; mean over the last tail_fraction of steps"),
    MetricDef("entropy (max)", "entropy", "max", "largest per-step mean token entropy (an entropy surge shows here)"),
    MetricDef("entropy after RL, high-precision forward", "hp/entropy", "measured",
              "mean token entropy of the final weights under an fp32 HF forward, over the completions a high-precision "
              "engine sampled: " + HP_SAMPLED),
    MetricDef("reward (last)", "reward/mean", "tail", "mean rollout reward; mean over the last tail_fraction of steps"),
    MetricDef("reward (mean)", "reward/mean", "mean", "mean rollout reward; mean over all steps"),
    MetricDef("sampled reward after RL, high-precision engine", "hp/reward_mean", "measured",
              "mean reward of the final weights served by a high-precision engine (fp32, nothing quantized): " + HP_SAMPLED),
    MetricDef("sampled reward after RL, own engine (same prompts)", "own/reward_mean", "measured",
              "the same through an engine in the arm's own rollout precision: the same weights and prompts"),
    MetricDef("held-out accuracy before RL", "eval_before", "eval", "greedy accuracy on the held-out prompts before the first RL step"),
    MetricDef("held-out accuracy after RL", "eval_after", "eval", "greedy accuracy on the held-out prompts after the last RL step"),
    MetricDef("held-out accuracy after RL, high-precision engine", "hp/greedy_accuracy", "measured",
              "greedy accuracy of the final weights served by a high-precision engine (the run's evaluation function; "
              "its held-out prompts unless hp_measure.json's settings name another count)"),
    MetricDef("held-out accuracy, high-precision engine, late checkpoints", "hp/greedy_accuracy", "late",
              "greedy held-out accuracy through a high-precision engine, mean over the measured checkpoints of the second "
              "half of training (`--hp-measure --hp-steps late` or `all`; at least two): one checkpoint's accuracy swings by 10-30 "
              "points from one saved step to the next in the deep miniature, so the final one alone is a sample of that swing"),
    MetricDef("held-out accuracy, high-precision engine, checkpoint-to-checkpoint std", "hp/greedy_accuracy", "late_std",
              "sample std of that accuracy over the same late checkpoints of one run (how far a single checkpoint's "
              "figure can sit from the run's level)"),
    MetricDef("sampled reward, high-precision engine, late checkpoints", "hp/reward_mean", "late",
              "sampled reward through a high-precision engine, mean over the same late checkpoints: " + HP_SAMPLED),
    MetricDef("entropy, high-precision forward, late checkpoints", "hp/entropy", "late",
              "mean token entropy under an fp32 HF forward, mean over the same late checkpoints"),
    MetricDef("held-out accuracy after RL, own engine (remeasured)", "own/greedy_accuracy", "measured",
              "the same through an engine in the arm's own rollout precision (equals the run's own figure on the same prompts)"),
    MetricDef("malformed (last)", "malformed/train", "tail",
              "fraction of sampled answers that do not parse in the task's format (garbled outputs); mean over the last tail_fraction of steps"),
    MetricDef("malformed (max)", "malformed/train", "max", "largest per-step malformed fraction of sampled answers (a burst of garbled outputs shows here)"),
    MetricDef("malformed after RL (sampled), high-precision engine", "hp/sampled_malformed", "measured",
              "fraction of the high-precision engine's sampled answers that do not parse in the task's format: " + HP_SAMPLED),
    MetricDef("held-out malformed after RL", "eval_malformed_after", "eval",
              "fraction of greedy held-out answers that do not parse in the task's format, after the last RL step"),
    MetricDef("held-out malformed after RL, high-precision engine", "hp/greedy_malformed", "measured",
              "the same fraction of the final weights' greedy answers through a high-precision engine"),
    MetricDef("L (lower bound)", "calib/lower", "mean", "lower clip bound in force (1 - eps_low unless calibrated); mean over all steps"),
    MetricDef("H (upper bound)", "calib/upper", "mean", "upper clip bound in force (1 + eps_high unless calibrated); mean over all steps"),
    MetricDef("alpha target", "calib/alpha_target", "calib",
              "high-precision fraction of negative tokens below 1 - eps_low (the calibration target); mean over calibration steps"),
    MetricDef("alpha achieved", "calib/alpha_achieved", "calib",
              "fraction of negative tokens' low-precision ratios below the solved L; mean over calibration steps"),
    MetricDef("log-ratio error (shadow)", "fp8/log_ratio_abs_err", "mean",
              "mean per-token |low-precision minus high-precision log-ratio|; mean over the steps that ran the shadow pass"),
    MetricDef("train-vs-rollout |dlogp|", "mismatch_abs_dlogp", "mean",
              "mean per-token |learner log-prob - rollout engine log-prob| of the sampled tokens; mean over all steps"),
    MetricDef("train-vs-rollout k3 KL", "mismatch_k3_kl", "mean",
              "per-token k3 estimate of KL(rollout || learner) on the sampled tokens; mean over all steps"),
    MetricDef("token_mult_prob_error", "token_mult_prob_error", "mean",
              "per-token mean of exp|learner - rollout log-prob| (1 = identical); mean over all steps"),
    MetricDef("KV-scale measurement, share of a step", "time/kv_cache_reduce", "share",
              "time measuring and reducing the per-layer K/V amax (precision.kv_cache_scales=recalibrate) over step "
              "time, summed over all steps", per="time/step"),
    MetricDef("rollout log-prob error after RL, own engine", "own/logprob_gap", "measured",
              "mean per-token |log-prob the arm's own engine reported - fp32 forward log-prob| of its sampled tokens, "
              "final weights (the rollout's measurement error; about 1e-6 for a high-precision engine)"),
)
"""The RESULTS.md table, in order."""


LATE_MIN_CHECKPOINTS = 2
"""A run's late-checkpoint value needs at least this many measured checkpoints in the second half of training."""


def late_checkpoint_values(measured_steps: dict[int, dict[str, float]], key: str, steps: int) -> list[float]:
    """`key` at every measured checkpoint step >= steps // 2 - 1 (checkpoint step N holds the weights after step N,
    so a 200-step run's second half is 99, 124, ..., 199); empty when fewer than LATE_MIN_CHECKPOINTS have it."""
    vals = [v[key] for s, v in sorted(measured_steps.items()) if s >= steps // 2 - 1 and _finite(v.get(key))]
    return vals if len(vals) >= LATE_MIN_CHECKPOINTS else []


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_value(rows: Sequence[dict], metric: MetricDef, tail_fraction: float, evals: dict[str, float],
              from_step: int = 0, measured: Optional[dict[str, float]] = None,
              measured_steps: Optional[dict[int, dict[str, float]]] = None, steps: int = 0) -> float:
    """One run's value of `metric` (nan when the run has no finite value for it); `measured`: the final
    checkpoint's hp_measure values ('<view>/<field>'); `measured_steps`: those of every measured checkpoint of a
    `steps`-step run (the late reductions)."""
    if metric.reduce in ("late", "late_std"):
        vals = late_checkpoint_values(measured_steps or {}, metric.key, steps)
        if not vals:
            return math.nan
        return statistics.fmean(vals) if metric.reduce == "late" else statistics.stdev(vals)
    if metric.reduce in ("eval", "measured"):
        v = (evals if metric.reduce == "eval" else measured or {}).get(metric.key, math.nan)
        return float(v) if _finite(v) else math.nan
    if metric.reduce == "window":
        rows = [r for r in rows if r.get("step", 0) >= from_step]
    elif metric.reduce == "tail":
        rows = rows[len(rows) - max(1, math.ceil(len(rows) * tail_fraction)):] if rows else rows
    elif metric.reduce == "calib":
        calib = [r for r in rows if any(_finite(r.get(k)) for k in CALIBRATION_ROW_KEYS)]
        rows = calib if calib else rows
    if metric.reduce == "share":
        both = [r for r in rows if _finite(r.get(metric.key)) and _finite(r.get(metric.per))]
        total = sum(float(r[metric.per]) for r in both)
        return sum(float(r[metric.key]) for r in both) / total if total > 0 else math.nan
    vals = [float(r[metric.key]) for r in rows if _finite(r.get(metric.key))]
    if not vals:
        return math.nan
    return max(vals) if metric.reduce == "max" else sum(vals) / len(vals)


@dataclass
class SeedStats:
    """Statistics of one metric of one arm over its seeds (finite values only)."""

    values: list[float]
    """Per-seed values (nan where a seed had none)."""

    @property
    def finite(self) -> list[float]:
        """The finite per-seed values."""
        return [v for v in self.values if math.isfinite(v)]

    @property
    def mean(self) -> float:
        """Mean over seeds (nan if none)."""
        f = self.finite
        return sum(f) / len(f) if f else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (0 for one seed, nan for none)."""
        f = self.finite
        return statistics.stdev(f) if len(f) > 1 else (0.0 if f else math.nan)

    def span(self, fmt: Callable[[float], str] = lambda v: f"{v:.4g}") -> str:
        """'mean [min, max]' of the finite values, each through `fmt` (n/a without values)."""
        f = self.finite
        return f"{fmt(self.mean)} [{fmt(min(f))}, {fmt(max(f))}]" if f else "n/a"

    def cell(self) -> str:
        """'mean ± std [min, max]' (n/a without values)."""
        f = self.finite
        if not f:
            return "n/a"
        return f"{_fmt(self.mean)} ± {_fmt(self.std)} [{_fmt(min(f))}, {_fmt(max(f))}]"


def _fmt(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.4g}"


@dataclass
class RunRecord:
    """What one arm-seed run left in its directory."""

    arm: str
    seed: int
    run_dir: Path
    status: str
    """done (final checkpoint with the after-RL evaluation), partial, failed, or missing."""
    rows: list[dict] = field(default_factory=list)
    """metrics.jsonl rows."""
    evals: dict[str, float] = field(default_factory=dict)
    """eval_before / eval_after from the final checkpoint's RL state."""
    wall_s: float = 0.0
    """Wall time of the runner's invocations of this run (all attempts)."""
    config: Optional[dict] = None
    """The run's resolved config.yaml."""
    measured: dict[str, float] = field(default_factory=dict)
    """hp_measure.json values of the final checkpoint ('<view>/<field>', e.g. hp/greedy_accuracy)."""
    measured_steps: dict[int, dict[str, float]] = field(default_factory=dict)
    """hp_measure.json values of every measured checkpoint step."""


def read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows, dropping a torn last line (a run killed mid-write leaves one)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    rows = []
    for k, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if k != len(lines) - 1:
                raise ValueError(f"{path}:{k + 1}: invalid JSON in the middle of the file") from None
    return rows


def final_rl_state(run_dir: Path, steps: int) -> Optional[dict]:
    """RL state of the run's final checkpoint (step steps-1, holding eval_after), or None when the run is not finished."""
    from megatron_rl.trainer.checkpoint import RL_STATE_FILE, latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        return None
    state = pickle.loads((Path(path) / RL_STATE_FILE).read_bytes())
    if int(state.get("step", -1)) != steps - 1 or "eval_after" not in state:
        return None
    return state


def resume_step(run_dir: Path) -> int:
    """First step a (re)started run will execute: one past its newest checkpoint, 0 without one."""
    from megatron_rl.trainer.checkpoint import RL_STATE_FILE, latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        return 0
    return int(pickle.loads((Path(path) / RL_STATE_FILE).read_bytes())["step"]) + 1


EVAL_KEYS = ("eval_before", "eval_after", "eval_malformed_before", "eval_malformed_after")
"""Held-out evaluation entries of a finished run's RL state (the malformed ones only for tasks with an answer format)."""

ATTEMPTS_FILE = "study_attempts.jsonl"
"""Per run directory: one JSON line per runner invocation (start, wall time, return code, resumed-from step)."""


def collect(study, steps: int) -> list[RunRecord]:
    """Records of every arm-seed run of a study, in run order."""
    records = []
    for arm, seed in study.runs():
        run_dir = study.run_dir(arm, seed)
        attempts = [json.loads(ln) for ln in (run_dir / ATTEMPTS_FILE).read_text().splitlines() if ln.strip()] \
            if (run_dir / ATTEMPTS_FILE).exists() else []
        state = final_rl_state(run_dir, steps) if run_dir.exists() else None
        if state is not None:
            status = "done"
        elif attempts and attempts[-1].get("returncode", 0) != 0:
            status = "failed"
        elif run_dir.exists() and (run_dir / "metrics.jsonl").exists():
            status = "partial"
        else:
            status = "missing"
        cfg_path = run_dir / "config.yaml"
        hp = read_measurements(run_dir) if run_dir.exists() else None
        by_step = {int(k): flat_values(hp, int(k)) for k in (hp or {}).get("steps", {})}
        records.append(RunRecord(
            arm=arm, seed=seed, run_dir=run_dir, status=status, rows=read_rows(run_dir),
            evals={k: float(state[k]) for k in EVAL_KEYS if state and _finite(state.get(k))},
            wall_s=sum(float(a.get("wall_s", 0.0)) for a in attempts),
            config=load_yaml_file(cfg_path) if cfg_path.exists() else None,
            measured=by_step.get(steps - 1, {}), measured_steps={k: v for k, v in sorted(by_step.items()) if v},
        ))
    return records


def arm_stats(records: Sequence[RunRecord], arms: Sequence[str], tail_fraction: float,
              from_step: int = 0, steps: int = 0) -> dict[str, dict[str, SeedStats]]:
    """{arm: {metric label: SeedStats over the arm's finished seeds}} (`steps`: the runs' length, for the late rows)."""
    out: dict[str, dict[str, SeedStats]] = {}
    for arm in arms:
        runs = [r for r in records if r.arm == arm and r.status == "done"]
        out[arm] = {m.label: SeedStats([run_value(r.rows, m, tail_fraction, r.evals, from_step, r.measured,
                                                  r.measured_steps, steps) for r in runs])
                    for m in METRICS}
    return out


def _reported(metric: MetricDef, records: Sequence[RunRecord]) -> bool:
    """hp-measured rows only once some run was measured (`megatron-rl study SPEC --hp-measure`), share rows only
    where some run logs their numerator (e.g. the KV-scale time of recalibrating runs): other studies' tables keep
    their rows."""
    if metric.reduce == "measured":
        return any(metric.key in r.measured for r in records)
    if metric.reduce in ("late", "late_std"):
        return any(len(r.measured_steps) >= LATE_MIN_CHECKPOINTS and any(metric.key in v for v in r.measured_steps.values())
                   for r in records)
    if metric.reduce == "share":
        return any(_finite(row.get(metric.key)) for r in records for row in r.rows)
    return True


def _relative(metric: MetricDef, arm: SeedStats, ref: SeedStats) -> str:
    """Ratio of means for clip fractions and log-ratio errors (scale-free), difference of means otherwise."""
    a, b = arm.mean, ref.mean
    if not (math.isfinite(a) and math.isfinite(b)):
        return "n/a"
    if metric.key.startswith(("clipfrac", "hp/clipfrac", "offpolicy/clipfrac", "fp8/", "mismatch_")):
        return f"{a / b:.3g}x" if b != 0 else "n/a (reference 0)"
    return f"{a - b:+.4g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def write_results(study, records: Sequence[RunRecord], figures: dict[str, str], notes: Sequence[str]) -> Path:
    """Write <output_dir>/RESULTS.md: arms, per-arm statistics over seeds, comparison to the reference arm, runs, definitions, figures."""
    spec = study.spec
    arms = [a.name for a in spec.arms]
    stats = arm_stats(records, arms, spec.tail_fraction, spec.from_step, spec.steps)
    shown = [m for m in METRICS if _reported(m, records)]
    tail_pct = f"{100 * spec.tail_fraction:g}%"
    label = lambda m: m.label.replace("(last)", f"(last {tail_pct})").replace("step N", f"step {spec.from_step}")  # noqa: E731
    done = sum(r.status == "done" for r in records)
    lines = [
        f"# Study results: {study.spec_path.name}",
        "",
        f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} by `megatron-rl study {study.spec_path}`.",
        f"Base config `{study.base}`, {spec.steps} RL steps per run, seeds {spec.seeds} "
        f"(each sets {', '.join(f'`{f}`' for f in spec.seed_fields)}); {done} of {len(records)} runs finished.",
        f"Every run starts from the same warm start (`{study.warm_dir}`): one SFT and one data set for all arms and seeds."
        if spec.warm_start == "shared" else
        f"Every run trains its own SFT warm start (`<run>/sft`, shaped by its seed and kernel path); the data is shared "
        f"(`{study.warm_dir / 'data'}`).",
        "",
        "## Arms",
        "",
        *_table(["arm", "CPU kernels", "overrides (over the base config and the shared overrides)"],
                [[a.name, a.kernels or "pinned", ", ".join(f"`{k}={json.dumps(v)}`" for k, v in a.overrides.items()) or "(none)"]
                 for a in spec.arms]),
        "",
        f"Shared overrides: {', '.join(f'`{k}={json.dumps(v)}`' for k, v in spec.overrides.items()) or '(none)'}.",
        "",
        "## Results: mean ± std [min, max] over finished seeds",
        "",
        *_table(["metric", *arms],
                [[label(m), *(stats[a][m.label].cell() for a in arms)] for m in shown]),
        "",
    ]
    others = [a for a in arms if a != spec.reference]
    if others:
        ref = stats[spec.reference]
        lines += [
            f"## Relative to `{spec.reference}`",
            "",
            "Clip fractions, log-ratio errors, |dlogp| and k3 KL: ratio of seed means; everything else: difference of seed means.",
            "",
            *_table(["metric", *others],
                    [[label(m), *(_relative(m, stats[a][m.label], ref[m.label]) for a in others)] for m in shown]),
            "",
        ]
    lines += _measured_by_step(records, arms)
    lines += [
        "## Runs",
        "",
        *_table(["arm", "seed", "status", "steps logged", "SFT steps", "held-out accuracy before -> after", "gain",
                 "wall time (s)", "directory"],
                [[r.arm, r.seed, r.status, len(r.rows), _sft_steps(r.run_dir),
                  f"{_pct(r.evals.get('eval_before'))} -> {_pct(r.evals.get('eval_after'))}", _gain(r.evals),
                  f"{r.wall_s:.0f}", f"`{r.run_dir}`"]
                 for r in records]),
        "",
        *_overall(records),
        f"Total wall time of the runs: {sum(r.wall_s for r in records):.0f} s.",
        "",
        "## Metric definitions",
        "",
        f"One value per run, then mean / sample std / min / max over the arm's finished seeds (tail_fraction = "
        f"{spec.tail_fraction:g}, from_step = {spec.from_step}).",
        "",
        *(f"- **{m.label}** (`{m.key}`): {m.definition}." for m in shown),
        "",
    ]
    if figures:
        lines += ["## Figures", ""]
        for title, name in figures.items():
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    lines += [
        "## Reproduce",
        "",
        f"    megatron-rl study {study.spec_path}                 # runs what is missing (resumes killed runs), then rewrites this file",
        f"    megatron-rl study {study.spec_path} --report-only   # this file and the figures from the runs on disk",
        "",
    ]
    out = study.report_out / "RESULTS.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


BY_STEP_KEYS = (("hp/greedy_accuracy", "held-out accuracy, high-precision engine"),
                ("hp/reward_mean", "sampled reward, high-precision engine"),
                ("hp/entropy", "entropy, high-precision forward"),
                ("own/reward_mean", "sampled reward, own engine (same prompts)"))
"""Curves of the hp measurement over checkpoint steps, in RESULTS.md when a run has more than one step measured."""


def _measured_by_step(records: Sequence[RunRecord], arms: Sequence[str]) -> list[str]:
    """Tables of BY_STEP_KEYS against checkpoint step (mean [min, max] over the arm's finished seeds measured there)."""
    done = [r for r in records if r.status == "done" and r.measured_steps]
    if not any(len(r.measured_steps) > 1 for r in done):
        return []
    steps = sorted({s for r in done for s in r.measured_steps})
    lines = ["## High-precision measurement by checkpoint step", "",
             "Checkpoint step N holds the weights after step N. Mean [min, max] over the finished seeds measured at that step.", ""]
    for key, title in BY_STEP_KEYS:
        if not any(key in v for r in done for v in r.measured_steps.values()):
            continue
        rows = []
        for step in steps:
            cells = []
            for arm in arms:
                f = [r.measured_steps[step][key] for r in done if r.arm == arm and key in r.measured_steps.get(step, {})]
                cells.append(f"{_fmt(sum(f) / len(f))} [{_fmt(min(f))}, {_fmt(max(f))}]" if f else "")
            rows.append([step, *cells])
        lines += [f"**{title}** (`{key}`)", "", *_table(["step", *arms], rows), ""]
    return lines


def _pct(v: Optional[float]) -> str:
    return f"{100 * v:.1f}%" if v is not None and math.isfinite(v) else "n/a"


def _gain(evals: dict[str, float]) -> str:
    if "eval_before" in evals and "eval_after" in evals:
        return f"{100 * (evals['eval_after'] - evals['eval_before']):+.1f}"
    return "n/a"


def _sft_steps(run_dir: Path) -> str:
    """Steps the run's own warm start took (and why it stopped), from <run>/sft/warm_start.json; 'shared' without one."""
    path = Path(run_dir) / "sft" / "warm_start.json"
    if not path.exists():
        return "shared"
    record = json.loads(path.read_text())
    return f"{record['steps']}" + (" (stop_accuracy)" if record.get("stopped_by") == "stop_accuracy" else "")


def _overall(records: Sequence[RunRecord]) -> list[str]:
    """One line: ranges over every finished run (all arms and seeds) of the accuracy before and after RL, and the gain."""
    done = [r.evals for r in records if r.status == "done" and {"eval_before", "eval_after"} <= set(r.evals)]
    if not done:
        return []
    before = [100 * e["eval_before"] for e in done]
    after = [100 * e["eval_after"] for e in done]
    gain = [a - b for a, b in zip(after, before)]
    return [f"Over all {len(done)} finished runs: warm start {min(before):.1f}-{max(before):.1f}%, after RL "
            f"{min(after):.1f}-{max(after):.1f}% (spread {max(after) - min(after):.1f} points), gain "
            f"{min(gain):+.1f} to {max(gain):+.1f} points.", ""]
