"""The dose-response view of a study: harm against the instrument's k (algo.experimental.clip_error_scale).

    python tools/dose_response.py examples/studies/deep_addtrace_dose.yaml   # -> <report_dir>/DOSE.md, dose.png

Each arm's k is its `algo.experimental.clip_error_scale` override (1 without one), and its variant is `vanilla`, or
`calibrated` when it sets `algo.calibration.enabled: true` (`calibrated, strength=full`, `calibrated, upper=fixed`
and the like when it also overrides other `algo.calibration.*` settings, shadow_fraction where it is not the default);
arms with a recipe of none are the high-precision reference. For every
(k, variant) pair the table gives mean [min, max] over finished seeds of the metrics below (definitions:
megatron_rl/study/results.py); the figure draws them against k, vanilla and calibrated, with the reference's
seed range as a band. Then, seed by seed, every variant minus vanilla at the same k (and vanilla minus the reference):
the runs of one seed share the warm start and the first rollouts, so the paired difference removes the part of the
seed spread the arms have in common; its mean comes with a bootstrap 95% interval and a sign-flip p-value (numpy; the
project has no scipy). An arm at k = 0 (the clip decided on the high-precision ratio: a perfect clip decision with the
arm's own gradients) is the ceiling of every clip rule, so every arm is also paired with it; dose.png draws it as a
level. An arm whose every clip is decided on the high-precision ratio (strength=decision) trains the same
at any k, so it is also paired with vanilla at every other k. Pure reading of finished runs: nothing is trained here.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from megatron_rl.config.algo import CalibrationConfig
from megatron_rl.study import StudyError, results

DOSE_METRICS = ("clipfrac_lower_neg", "reward (mean)", "reward (last)", "entropy (last)", "entropy (max)",
                "malformed (last)", "held-out accuracy after RL", "held-out malformed after RL")
"""Rows of the dose table (labels of results.METRICS)."""
DOSE_MEASURED = ("entropy after RL, high-precision forward", "sampled reward after RL, high-precision engine",
                 "held-out accuracy after RL, high-precision engine",
                 "held-out accuracy, high-precision engine, late checkpoints",
                 "held-out accuracy, high-precision engine, checkpoint-to-checkpoint std",
                 "sampled reward, high-precision engine, late checkpoints",
                 "entropy, high-precision forward, late checkpoints")
"""Further rows once runs were measured in high precision (`megatron-rl study SPEC --hp-measure [--hp-steps late|all]`)."""
DOSE_PLOTTED_MEASURED = ("held-out accuracy, high-precision engine, late checkpoints",
                         "sampled reward, high-precision engine, late checkpoints")
"""Measured rows also drawn in dose.png when some run has them (the outcome least moved by one checkpoint's swing)."""


def arm_dose(overrides: dict[str, Any]) -> tuple[Optional[float], str]:
    """(k, variant) of an arm from its overrides; k is None for a high-precision arm (recipe none)."""
    if overrides.get("precision.recipe", "none") == "none":
        return None, "reference"
    k = float(overrides.get("algo.experimental.clip_error_scale", 1.0))
    if overrides.get("algo.policy_loss.clip_decision") == "high_precision":
        k = 0.0  # the supported form of the instrument at k = 0
    if not overrides.get("algo.calibration.enabled", False):
        return k, "vanilla"
    # every calibration setting but those that only feed the instrument or the cost names the variant
    settings = sorted((key.removeprefix(CALIBRATION), value) for key, value in overrides.items()
                      if key.startswith(CALIBRATION) and key != f"{CALIBRATION}enabled"
                      and not (key == f"{CALIBRATION}shadow_fraction" and float(value) == DEFAULT_SHADOW_FRACTION))
    return k, ", ".join(["calibrated", *(f"{key}={value}" for key, value in settings)])


CALIBRATION = "algo.calibration."
DEFAULT_SHADOW_FRACTION = CalibrationConfig.model_fields["shadow_fraction"].default
"""An arm that sets shadow_fraction to the default is the default calibration (the k > 1 arms spell it out); any other
value is a variant of its own (the shadow sees fewer rows, its targets are noisier)."""


PAIRED_METRICS = ("held-out accuracy, high-precision engine, late checkpoints",
                  "sampled reward, high-precision engine, late checkpoints", "held-out accuracy after RL", "reward (last)")
"""Outcomes compared seed by seed (labels of results.METRICS); a metric no pair has is left out."""
PAIRED_RESAMPLES = 10_000
"""Bootstrap resamples of the paired mean (and Monte Carlo sign flips once 2^n exceeds them); fixed seed 0."""


def paired_summary(diffs: Sequence[float], resamples: int = PAIRED_RESAMPLES) -> dict[str, float]:
    """n, mean, sd, se, 95% bootstrap interval (lo, hi) of the mean, two-sided sign-flip p-value of mean 0, and the
    counts above and below 0 of paired differences (nan statistics where n is too small for them)."""
    d = np.asarray([x for x in diffs if math.isfinite(x)], dtype=np.float64)
    n = d.size
    out = {"n": n, "mean": float(d.mean()) if n else math.nan, "sd": float(d.std(ddof=1)) if n > 1 else math.nan,
           "above": int((d > 0).sum()), "below": int((d < 0).sum())}
    out["se"] = out["sd"] / math.sqrt(n) if n > 1 else math.nan
    if n < 2:
        return {**out, "lo": math.nan, "hi": math.nan, "p": math.nan}
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    if 2 ** n <= resamples:
        signs = np.array(list(itertools.product((-1.0, 1.0), repeat=n)))
    else:
        signs = rng.choice((-1.0, 1.0), size=(resamples, n))
    flipped = np.abs((signs * d).mean(axis=1))
    # a tolerance so that the observed arrangement counts itself despite rounding in the sums
    p = float((flipped >= abs(d.mean()) - 1e-12 * max(1.0, abs(d.mean()))).mean())
    return {**out, "lo": float(lo), "hi": float(hi), "p": p}


def paired_table(study, records, owner: dict[tuple, str], ref_name: Optional[str],
                 k_free: frozenset[str] = frozenset()) -> list[str]:
    """Markdown lines: for every k with a vanilla arm, each other variant minus vanilla seed by seed, and vanilla minus
    the reference; with a vanilla arm at k = 0, every arm minus it too; each arm of `k_free` (whose training does not
    depend on k: AlgoConfig.every_step_decision_scale 0) minus vanilla at every other k; one row per (pair, metric) that
    some seed has on both sides."""
    by_label = {m.label: m for m in results.METRICS}
    value = {}
    for r in records:
        if r.status != "done":
            continue
        for label in PAIRED_METRICS:
            value[(r.arm, r.seed, label)] = results.run_value(r.rows, by_label[label], study.spec.tail_fraction, r.evals,
                                                              0, r.measured, r.measured_steps, study.spec.steps)
    pairs = []
    ordered = sorted(owner.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, _variant_order(kv[0][1])))
    for (k, variant), name in ordered:
        vanilla = owner.get((k, "vanilla"))
        if k is None or vanilla is None:
            continue
        if variant == "vanilla":
            if ref_name:
                pairs.append((f"vanilla k={k:g} - {ref_name}", vanilla, ref_name))
        else:
            pairs.append((f"{variant} k={k:g} - vanilla", name, vanilla))
    # k = 0 decides every clip on the high-precision ratio: the best any clip rule could do with these gradients, so
    # every other arm is also paired with it (how much of the perfect decision an arm gives up)
    perfect = owner.get((0.0, "vanilla"))
    if perfect is not None:
        for (k, variant), name in ordered:
            if k is not None and name != perfect:
                pairs.append((f"{variant} k={k:g} - vanilla k=0", name, perfect))
    # an arm that decides every clip on the high-precision ratio (strength=decision) trains the same at any k (only its
    # calibration events see the instrument), so it is also paired with vanilla at every other k: one run per seed
    # answers "is the default below vanilla at k = 1, above it at k = 8"
    for (k, variant), name in ordered:
        if k is None or k == 0.0 or name not in k_free:
            continue
        for (k_other, other_variant), other in ordered:
            if other_variant == "vanilla" and k_other not in (None, 0.0, k):
                pairs.append((f"{variant} (any k) - vanilla k={k_other:g}", name, other))
    lines = []
    for title, a, b in pairs:
        for label in PAIRED_METRICS:
            seeds = sorted(s for s in study.spec.seeds if math.isfinite(value.get((a, s, label), math.nan))
                           and math.isfinite(value.get((b, s, label), math.nan)))
            if not seeds:
                continue
            scale = 100.0 if "accuracy" in label else 1.0
            diffs = [scale * (value[(a, s, label)] - value[(b, s, label)]) for s in seeds]
            st = paired_summary(diffs)
            fmt = (lambda v: f"{v:+.2f}") if scale == 100.0 else (lambda v: f"{v:+.4f}")
            show = (lambda v: fmt(v) if math.isfinite(v) else "n/a")
            sd = fmt(st["sd"]).lstrip("+") if math.isfinite(st["sd"]) else "n/a"
            p_value = f"{st['p']:.3f}" if math.isfinite(st["p"]) else "n/a"
            lines.append(f"| {title} | {label}{' (points)' if scale == 100.0 else ''} | {st['n']} | {show(st['mean'])} | "
                         f"{sd} | [{show(st['lo'])}, {show(st['hi'])}] | {p_value} | {st['above']} / {st['below']} | "
                         f"{' '.join(fmt(x) for x in diffs)} |")
    if not lines:
        return []
    return ["## Seed by seed: each variant minus vanilla at the same k", "",
            "Paired over the seeds both arms finished (accuracy in points); 95% interval: bootstrap of the mean "
            f"({PAIRED_RESAMPLES} resamples); p: two-sided sign-flip test of mean 0; above / below: seeds with a "
            "positive / negative difference.", "",
            "| pair | metric | seeds | mean | sd | 95% interval | p | above / below | per seed |",
            "|---|---|---|---|---|---|---|---|---|", *lines, ""]


def _variant_order(variant: str) -> tuple[int, str]:
    """vanilla, then the default calibration, then the other strengths by name."""
    return ({"vanilla": 0, "calibrated": 1}.get(variant, 2), variant)


def dose_table(study) -> tuple[str, dict]:
    """(markdown, {metric: {(k, variant): SeedStats}} plus the reference arm's stats under key None); StudyError when
    two arms give the same (k, variant), which one table cell cannot show."""
    records = results.collect(study, study.spec.steps)
    names = [a.name for a in study.spec.arms]
    stats = results.arm_stats(records, names, study.spec.tail_fraction, steps=study.spec.steps)
    measured = [m for m in DOSE_MEASURED if any(stats[a][m].finite for a in names)]
    dose: dict[str, dict] = {m: {} for m in (*DOSE_METRICS, *measured)}
    ref_name = None
    owner: dict[tuple, str] = {}
    for arm in study.spec.arms:
        k, variant = arm_dose(arm.overrides)
        if k is not None and (k, variant) in owner:
            raise StudyError(f"arms {owner[(k, variant)]!r} and {arm.name!r} both are {variant} at k={k:g}: the dose table "
                             "has one cell for them (set algo.calibration.strength or clip_error_scale apart)")
        owner[(k, variant)] = arm.name
        if k is None:
            ref_name = ref_name or arm.name
            for m in dose:
                dose[m][None] = stats[arm.name][m]
            continue
        for m in dose:
            dose[m][(k, variant)] = stats[arm.name][m]
    keys = sorted({key for m in dose.values() for key in m if key is not None}, key=lambda x: (_variant_order(x[1]), x[0]))
    header = ["metric", *(f"{v} k={k:g}" for k, v in keys)]
    if ref_name:
        header.insert(1, f"{ref_name} (reference)")
    lines = [f"# Dose-response: {study.spec_path.name}", "",
             "Mean [min, max] over finished seeds; k multiplies the low-precision ratio error the clip decision sees "
             "(algo.experimental.clip_error_scale, experiment only).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m in dose:
        row = [m] + ([dose[m][None].span()] if ref_name else []) + [dose[m][key].span() for key in keys]
        lines.append("| " + " | ".join(row) + " |")
    seeds = {name: sum(r.status == "done" for r in records if r.arm == name) for name in names}
    lines += ["", "Finished seeds per arm: " + ", ".join(f"`{n}` {c}" for n, c in seeds.items()) + ".", ""]
    # read from each arm's resolved config, so that an arm relying on the default strength counts
    configs = [study.run_config(a.name, study.spec.seeds[0], study.warm_overrides()) for a in study.spec.arms]
    k_free = frozenset(a.name for a, cfg in zip(study.spec.arms, configs)
                       if cfg.algo.every_step_decision_scale(cfg.precision.recipe) == 0.0)
    lines += paired_table(study, records, owner, ref_name, k_free)
    return "\n".join(lines), dose


def plot_dose(dose: dict, out: Path) -> Path:
    """dose.png: one panel per metric (DOSE_METRICS, then DOSE_PLOTTED_MEASURED where measured), the metric against k
    (log2 axis), vanilla and calibrated, reference band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*DOSE_METRICS, *(m for m in DOSE_PLOTTED_MEASURED if m in dose)]
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, m in zip(axes.flat, panels):
        ref = dose[m].get(None)
        if ref is not None and ref.finite:
            ax.axhspan(min(ref.finite), max(ref.finite), color="gray", alpha=0.25, lw=0, label="reference (seed range)")
        cells = {key: s for key, s in dose[m].items() if key is not None}
        perfect = cells.get((0.0, "vanilla"))
        if perfect is not None and perfect.finite:
            # k = 0 has no place on a log axis: drawn as a level, the outcome of a perfect clip decision
            ax.axhline(perfect.mean, color="black", ls="--", lw=1.2, label="k = 0 (clip on the high-precision ratio)")
        for variant in sorted({v for _, v in cells}, key=_variant_order):
            color = {"vanilla": "tab:red", "calibrated": "tab:blue"}.get(variant)
            pts = sorted((k, s) for (k, v), s in cells.items() if v == variant and s.finite and k > 0)
            if not pts:
                continue
            ks = [k for k, _ in pts]
            mean = [s.mean for _, s in pts]
            lo = [s.mean - min(s.finite) for _, s in pts]
            hi = [max(s.finite) - s.mean for _, s in pts]
            ax.errorbar(ks, mean, yerr=[lo, hi], marker="o", ms=4, capsize=2, color=color, label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (error scale)")
        ax.set_title(m, fontsize=9)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_dose_report(study) -> Path:
    """<report_dir>/DOSE.md and dose.png from the study's runs as they are."""
    text, dose = dose_table(study)
    study.report_out.mkdir(parents=True, exist_ok=True)
    plot_dose(dose, study.report_out / "dose.png")
    out = study.report_out / "DOSE.md"
    out.write_text(text + "\n![Harm against k](dose.png)\n")
    return out
