"""The table a user decides from: each precision split or calibration of a frontier study, its quality on the deep
miniature at FP8's real error (k = 1) and at 8x it (k = 8), beside what it costs at 8B and 32B, and the plot of
quality against step time.

    megatron-rl study examples/studies/deep_addtrace_frontier.yaml               # runs, RESULTS.md, FRONTIER.md
    megatron-rl study examples/studies/deep_addtrace_frontier.yaml --report-only # FRONTIER.md again from the runs

A spec with `frontier: true` gets <report_dir>/FRONTIER.md and frontier.png with its report. Its arms are grouped into
settings: an arm's overrides without algo.experimental.clip_error_scale name its setting, that field its k (1 when
unset). A setting whose clip decision does not depend on k (a high-precision learner, strength=decision) fills both
columns from its one arm. Quality: the reward of the last tail_fraction of steps and the greedy held-out accuracy
after RL, mean over seeds, and each minus vanilla FP8 at the same k seed by seed (paired mean, 95% bootstrap
interval, sign-flip p). Cost: `megatron-rl plan` of PLAN_POINTS with the setting's precision and calibration
overrides (the point's own FP8 recipe is kept: the miniature's tensorwise stands for FP8), learner and step seconds,
serial and with rollout.overlap=one_step_off (the step is then the slower of rollout and learner), and the learner
time against vanilla FP8's; plus the runs' own CPU seconds per step at k = 1 (the runs ran one after another, not side
by side: benchmarks/calibration_step_cost.py measures the ratio side by side).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_rl.study import results
from megatron_rl.study.dose import paired_summary

K_COLUMNS = (1.0, 8.0)
"""The error scales of the table's quality columns."""
QUALITY = ("reward (last)", "held-out accuracy after RL")
"""results.METRICS labels of the quality columns."""
PLAN_CARRIED = ("precision.rollout_quantization", "precision.first_last_layers_high_precision",
                "algo.calibration.enabled", "algo.calibration.strength", "algo.calibration.calibrate_every",
                "algo.calibration.bounds_update", "algo.calibration.shadow_fraction", "algo.calibration.targeted_fraction",
                "algo.policy_loss.clip_decision")
"""Fields of an arm's resolved config that its planned cost takes over (and precision.recipe where it is none)."""
NOT_SETTING = ("algo.experimental.clip_error_scale", "tracking.")
"""Override keys (or prefixes) that do not change what a user would run."""


@dataclass(frozen=True)
class PlanPoint:
    """A cluster a user would rent, planned for each setting."""

    label: str
    """Column label (model size)."""
    config: str
    """Run config, relative to the repository root."""
    nodes: int
    """Learner nodes (--nodes)."""
    engine_nodes: int = 1
    """Engine nodes when disaggregated (--engine-nodes)."""


PLAN_POINTS = (PlanPoint("8B", "examples/configs/qwen3_8b_fp8_grpo.yaml", nodes=2),
               PlanPoint("32B", "examples/configs/qwen3_32b_fp8_dapo.yaml", nodes=6, engine_nodes=2))
"""8B GRPO on 2 x 8 H100 and 32B DAPO on 6 x 8 learner + 2 x 8 engine H100s."""
REPO = Path(__file__).resolve().parents[2]


def _matches(key: str, keys: Sequence[str]) -> bool:
    """Whether `key` is one of `keys` or lies under one ending in a dot."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in keys)


@dataclass
class Setting:
    """One thing a user could run: the arms that share its overrides, by k."""

    name: str
    """The k = 1 arm's name (else the first arm's)."""
    overrides: dict[str, Any]
    """The arms' shared overrides without the instrument's."""
    arms: dict[float, str]
    """k -> arm name."""
    k_free: bool
    """Whether its clip decision does not depend on k (one arm fills every k column)."""
    config: Any = None
    """The k = 1 (else first) arm's resolved RunConfig."""

    def arm_at(self, k: float) -> Optional[str]:
        """The arm giving this setting's quality at k."""
        if self.k_free:
            return next(iter(self.arms.values()))
        return self.arms.get(k)

    @property
    def vanilla(self) -> bool:
        """FP8 learner with nothing else: no calibration, no high-precision decision or layers."""
        c = self.config
        return (c.precision.recipe != "none" and not c.algo.calibration.enabled and c.algo.every_step_hp_share(
            c.precision.recipe) == 0.0 and not c.precision.first_last_layers_high_precision)


def settings(study) -> list[Setting]:
    """The study's arms grouped into settings, in arm order."""
    warm = study.warm_overrides()
    out: dict[tuple, Setting] = {}
    for arm in study.spec.arms:
        own = {k: v for k, v in arm.overrides.items() if not _matches(k, NOT_SETTING)}
        key = tuple(sorted((k, repr(v)) for k, v in own.items()))
        cfg = study.run_config(arm.name, study.spec.seeds[0], warm)
        k = float(arm.overrides.get("algo.experimental.clip_error_scale", 1.0))
        k_free = cfg.precision.recipe == "none" or cfg.algo.every_step_decision_scale(cfg.precision.recipe) == 0.0
        s = out.setdefault(key, Setting(name=arm.name, overrides=own, arms={}, k_free=k_free, config=cfg))
        s.arms[k] = arm.name
        if k == 1.0:
            s.name, s.config = arm.name, cfg
    return list(out.values())


def plan_overrides(setting: Setting) -> list[str]:
    """The setting's resolved fields that change a planned cost (the plan config keeps its own FP8 recipe)."""
    def value(dotted: str) -> Any:
        obj = setting.config
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj

    out = ["precision.recipe=none"] if setting.config.precision.recipe == "none" else []
    for k in PLAN_CARRIED:
        v = value(k)
        out.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return out


def planned_cost(setting: Setting, points: Sequence[PlanPoint] = PLAN_POINTS) -> dict[str, dict[str, float]]:
    """{point label: learner_s, step_s, step_overlap_s} of the setting on each plan point."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import PlanOptions, make_plan

    out = {}
    for p in points:
        row = {}
        for overlap, suffix in (("none", ""), ("one_step_off", "_overlap")):
            cfg = load_config(REPO / p.config, [*plan_overrides(setting), f"rollout.overlap={overlap}"], check_layout=False,
                              check_device=False, engine_device=False)
            plan = make_plan(cfg, p.nodes, 8, "h100", PlanOptions(engine_nodes=p.engine_nodes))
            row["learner_s"] = plan.step_time.learner
            row[f"step{suffix}_s"] = plan.step_time.total
        out[p.label] = row
    return out


def _run_values(records, arm: Optional[str], label: str, tail_fraction: float) -> dict[int, float]:
    metric = next(m for m in results.METRICS if m.label == label)
    return {r.seed: results.run_value(r.rows, metric, tail_fraction, r.evals) for r in records
            if arm is not None and r.arm == arm and r.status == "done"}


def _cpu_step(records, arm: Optional[str]) -> float:
    vals = [float(row["time/step"]) for r in records if r.arm == arm and r.status == "done" for row in r.rows
            if isinstance(row.get("time/step"), (int, float)) and math.isfinite(row["time/step"])]
    return sum(vals) / len(vals) if vals else math.nan


def frontier_table(study, points: Sequence[PlanPoint] = PLAN_POINTS) -> dict[str, Any]:
    """Every number of FRONTIER.md: per setting its quality per k (mean, paired against vanilla), cost and CPU step."""
    records = results.collect(study, study.spec.steps)
    groups = settings(study)
    vanilla = next((s for s in groups if s.vanilla), None)
    rows = []
    for s in groups:
        row: dict[str, Any] = {"name": s.name, "setting": s, "quality": {}, "cost": planned_cost(s, points),
                               "cpu_step_s": _cpu_step(records, s.arm_at(1.0))}
        for k in K_COLUMNS:
            for label in QUALITY:
                mine = _run_values(records, s.arm_at(k), label, study.spec.tail_fraction)
                base = _run_values(records, vanilla.arm_at(k), label, study.spec.tail_fraction) if vanilla else {}
                finite = [v for v in mine.values() if math.isfinite(v)]
                cell = {"mean": sum(finite) / len(finite) if finite else math.nan, "n": len(finite)}
                if vanilla is not None and s is not vanilla:
                    cell["vs_vanilla"] = paired_summary([mine[x] - base[x] for x in sorted(mine) if x in base])
                row["quality"][(k, label)] = cell
        rows.append(row)
    return {"rows": rows, "vanilla": vanilla.name if vanilla else None, "seeds": list(study.spec.seeds),
            "points": [p.label for p in points]}


def _pts(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.1f}"


def _diff(cell: dict[str, Any]) -> str:
    d = cell.get("vs_vanilla")
    if d is None:
        return "(vanilla)"
    if not d["n"]:
        return "n/a"
    ci = f" [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}], p {d['p']:.2f}" if math.isfinite(d["lo"]) else ""
    return f"{100 * d['mean']:+.1f}{ci}"


def markdown(t: dict[str, Any], spec_path: str) -> str:
    """FRONTIER.md from frontier_table's numbers."""
    v = t["vanilla"]
    lines = [f"# What to run: quality on the deep miniature against cost at {' and '.join(t['points'])}", "",
             f"Regenerate: `megatron-rl study {spec_path}` (`--report-only` once the runs exist). Seeds "
             f"{', '.join(map(str, t['seeds']))}; quality in points (x 100), each setting minus `{v}` seed by seed "
             "(mean [95% bootstrap interval], two-sided sign-flip p). k = 8 scales FP8's ratio error 8x "
             "(algo.experimental.clip_error_scale) to show how a setting holds up where FP8 hurts.", ""]
    for k in K_COLUMNS:
        lines += [f"## Quality at k = {k:g}", "", "| setting | seeds | reward (last) | vs vanilla | held-out accuracy | vs vanilla |",
                  "|---|---|---|---|---|---|"]
        for r in t["rows"]:
            rew, acc = r["quality"][(k, QUALITY[0])], r["quality"][(k, QUALITY[1])]
            lines.append(f"| `{r['name']}` | {acc['n']} | {_pts(rew['mean'])} | {_diff(rew)} | {_pts(acc['mean'])} | {_diff(acc)} |")
        lines.append("")
    lines += ["## Cost", "", "Planned seconds per step on H100s (`megatron-rl plan`, MFU 0.4, FP8 speed-up 1.2); "
              "overlap: rollout.overlap=one_step_off. CPU s/step: the runs' own mean at k = 1 (one after another on a "
              "shared box; benchmarks/calibration_step_cost.py gives side-by-side ratios).", ""]
    head = ["setting"]
    for p in t["points"]:
        head += [f"{p} learner s", f"{p} x vanilla", f"{p} step s", f"{p} step s, overlap"]
    lines += ["| " + " | ".join(head + ["CPU s/step"]) + " |", "|" + "---|" * (len(head) + 1)]
    base = next((r for r in t["rows"] if r["name"] == v), None)
    for r in t["rows"]:
        cells = [f"`{r['name']}`"]
        for p in t["points"]:
            c = r["cost"][p]
            ratio = c["learner_s"] / base["cost"][p]["learner_s"] if base else math.nan
            cells += [f"{c['learner_s']:.1f}", f"{ratio:.3f}", f"{c['step_s']:.1f}", f"{c['step_overlap_s']:.1f}"]
        cells.append("n/a" if not math.isfinite(r["cpu_step_s"]) else f"{r['cpu_step_s']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![Quality against planned step time](frontier.png)", ""]
    return "\n".join(lines)


def plot_frontier(t: dict[str, Any], out: Path, point: str = "8B") -> Path:
    """frontier.png: held-out accuracy and reward at each k against the planned serial step time at `point`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(K_COLUMNS), figsize=(4.2 * 2 * len(K_COLUMNS), 3.6), squeeze=False)
    panels = [(k, label) for label in reversed(QUALITY) for k in K_COLUMNS]
    for ax, (k, label) in zip(axes.flat, panels):
        for r in t["rows"]:
            y = r["quality"][(k, label)]["mean"]
            if not math.isfinite(y):
                continue
            x = r["cost"][point]["step_s"]
            ax.scatter([x], [100 * y], s=30)
            ax.annotate(r["name"].replace("fp8_tensorwise_", "fp8_"), (x, 100 * y), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel(f"planned step s, {point} (serial)")
        ax.set_title(f"{label}, k = {k:g}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_frontier_report(study) -> Path:
    """<report_dir>/FRONTIER.md and frontier.png from the study's runs as they are."""
    t = frontier_table(study)
    study.report_out.mkdir(parents=True, exist_ok=True)
    plot_frontier(t, study.report_out / "frontier.png")
    out = study.report_out / "FRONTIER.md"
    try:
        spec = study.spec_path.resolve().relative_to(REPO)
    except ValueError:
        spec = study.spec_path
    out.write_text(markdown(t, str(spec)))
    return out
