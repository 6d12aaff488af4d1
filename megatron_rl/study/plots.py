"""The study's PNG figures (matplotlib, Agg): curves per arm with seed bands, clip bounds, and per-token
log-ratio error histograms from the calibration token dumps.

Token dumps (written with ``tracking.dump_ratios: true`` on calibration steps):
``RUN_DIR/calibration/step_{step:06d}.rank{r}.npz`` with float64 ``ratio`` (low precision), ``ratio_hp``
(high-precision shadow), ``adv`` and int64 ``minibatch``. An arm without dumps gets an empty panel
and a note; nothing fails.
"""
from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

DUMP_RE = re.compile(r"step_(\d+)\.rank(\d+)\.npz$")
"""File name of one calibration step's token dump of one rank."""
CURVE_KEYS = ("clipfrac_lower_neg", "hp/clipfrac_lower_neg", "clipfrac_upper_pos", "entropy", "reward/mean",
              "accuracy/train", "malformed/train", "accuracy/eval", "malformed/eval", "fp8/log_ratio_abs_err")
"""Panels of curves.png (a metric no run logged gets no panel: malformed/* needs a task with an answer format,
*/eval needs train.eval_every)."""
OPTIONAL_CURVE_KEYS = ("malformed/train", "accuracy/eval", "malformed/eval")
"""Curve keys left out of curves.png when no run of the study logged them."""
BOUND_KEYS = (("calib/lower", "calib/solve_lower", "L"), ("calib/upper", "calib/solve_upper", "H"))
"""(bound in force, raw solve drawn as markers, panel title) of bounds.png."""
SPARSE_FRACTION = 0.5
"""A metric present on fewer than this fraction of an arm's steps is drawn as markers (shadow-step metrics)."""


def read_ratio_dumps(run_dir: Path) -> Optional[dict[str, np.ndarray]]:
    """All token dumps of a run concatenated (plus a `step` array), or None when it has none."""
    files = sorted((Path(run_dir) / "calibration").glob("step_*.rank*.npz"))
    parts: dict[str, list[np.ndarray]] = {"ratio": [], "ratio_hp": [], "adv": [], "minibatch": [], "step": []}
    for f in files:
        m = DUMP_RE.search(f.name)
        if m is None:
            continue
        with np.load(f) as z:
            missing = {"ratio", "ratio_hp", "adv"} - set(z.files)
            if missing:
                raise ValueError(f"{f}: token dump lacks {sorted(missing)}")
            n = len(z["ratio"])
            for k in ("ratio", "ratio_hp", "adv"):
                parts[k].append(np.asarray(z[k], dtype=np.float64).reshape(-1))
            parts["minibatch"].append(np.asarray(z["minibatch"], dtype=np.int64).reshape(-1) if "minibatch" in z.files
                                      else np.full(n, -1, dtype=np.int64))
            parts["step"].append(np.full(n, int(m.group(1)), dtype=np.int64))
    if not parts["ratio"]:
        return None
    return {k: np.concatenate(v) for k, v in parts.items()}


def log_ratio_error(dump: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(log r - log r_hp of negative-advantage tokens, same of positive-advantage tokens), non-finite tokens dropped."""
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.log(dump["ratio"]) - np.log(dump["ratio_hp"])
    ok = np.isfinite(d)
    return d[ok & (dump["adv"] < 0)], d[ok & (dump["adv"] > 0)]


def _series(records, key: str, steps: int) -> np.ndarray:
    """[seeds, steps] array of a metric (nan where a step lacks it)."""
    out = np.full((len(records), steps), np.nan)
    for i, r in enumerate(records):
        for row in r.rows:
            s, v = row.get("step"), row.get(key)
            if isinstance(s, int) and 0 <= s < steps and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[i, s] = v
    return out


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centered rolling mean along steps, ignoring nan (window 1: unchanged)."""
    if window <= 1:
        return y
    out = np.full_like(y, np.nan)
    half = window // 2
    for t in range(y.shape[-1]):
        seg = y[..., max(0, t - half): t + half + 1]
        with np.errstate(invalid="ignore"):
            cnt = np.sum(np.isfinite(seg), axis=-1)
            out[..., t] = np.where(cnt > 0, np.nansum(seg, axis=-1) / np.maximum(cnt, 1), np.nan)
    return out


def _draw(ax, series: np.ndarray, color, label: str, window: int) -> bool:
    """Mean over seeds with a min-max band (dense metric) or markers with min-max bars (sparse); False when empty."""
    present = np.isfinite(series).any(axis=0)
    if not present.any():
        return False
    steps = np.arange(series.shape[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nan-reductions over steps no seed reached
        if present.mean() < SPARSE_FRACTION:
            x = steps[present]
            mean = np.nanmean(series[:, present], axis=0)
            lo, hi = np.nanmin(series[:, present], axis=0), np.nanmax(series[:, present], axis=0)
            ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], fmt="o", ms=4, color=color, label=label, capsize=2)
            return True
        sm = _smooth(series, window)
        mean, lo, hi = np.nanmean(sm, axis=0), np.nanmin(sm, axis=0), np.nanmax(sm, axis=0)
    ax.plot(steps, mean, color=color, label=label, lw=1.5)
    if series.shape[0] > 1:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(by_arm: dict[str, Sequence], steps: int, out: Path, keys: Sequence[str] = CURVE_KEYS, window: int = 1) -> Path:
    """curves.png: one panel per metric, a line per arm (mean over seeds, band = min-max over seeds); sparse metrics as markers."""
    plt = _pyplot()
    keys = [k for k in keys if k not in OPTIONAL_CURVE_KEYS
            or any(k in row for recs in by_arm.values() for r in recs for row in r.rows)]
    cols = 3
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, keys):
        drawn = [_draw(ax, _series(recs, key, steps), colors[i % len(colors)], arm, window)
                 for i, (arm, recs) in enumerate(by_arm.items())]
        ax.set_title(key + ("" if any(drawn) else " (no data)"), fontsize=10)
        ax.set_xlabel("step")
        if any(drawn):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_bounds(by_arm: dict[str, Sequence], steps: int, out: Path, window: int = 1) -> Path:
    """bounds.png: L and H in force over steps per arm (seed bands), raw solves as markers, 1 -/+ eps as dotted lines."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, solve_key, title) in zip(axes.flat, BOUND_KEYS):
        eps_lines = set()
        for i, (arm, recs) in enumerate(by_arm.items()):
            c = colors[i % len(colors)]
            _draw(ax, _series(recs, key, steps), c, arm, 1)
            _draw(ax, _series(recs, solve_key, steps), c, f"{arm} (solve)", 1)
            for r in recs:
                pl = ((r.config or {}).get("algo") or {}).get("policy_loss") or {}
                if "eps_low" in pl and "eps_high" in pl:
                    eps_lines.add(1 - pl["eps_low"] if title == "L" else 1 + pl["eps_high"])
        for y in sorted(eps_lines):
            ax.axhline(y, color="gray", ls=":", lw=1)
        ax.set_title(f"{title} ({key})", fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_ratio_histograms(dumps_by_arm: dict[str, Optional[dict[str, np.ndarray]]], out: Path, bins: int = 80) -> Path:
    """ratio_hist.png: per arm, histograms of per-token log r - log r_hp for A < 0 and A > 0 (pooled over seeds and steps)."""
    plt = _pyplot()
    arms = list(dumps_by_arm)
    cols = min(3, len(arms))
    rows = math.ceil(len(arms) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, arm in zip(axes.flat, arms):
        dump = dumps_by_arm[arm]
        if dump is None:
            ax.text(0.5, 0.5, "no token dumps", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(arm, fontsize=10)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        neg, pos = log_ratio_error(dump)
        both = np.concatenate([neg, pos])
        lim = float(np.quantile(np.abs(both), 0.995)) if both.size else 1.0
        edges = np.linspace(-max(lim, 1e-6), max(lim, 1e-6), bins + 1)
        for vals, name, color in ((neg, "A < 0", "tab:red"), (pos, "A > 0", "tab:blue")):
            if vals.size:
                ax.hist(np.clip(vals, edges[0], edges[-1]), bins=edges, density=True, histtype="step", lw=1.5,
                        color=color, label=f"{name} (n={vals.size}, std={vals.std():.3g})")
        ax.set_title(f"{arm}: log r - log r_hp per token", fontsize=10)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(arms):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
