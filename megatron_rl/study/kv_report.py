"""One table across FP8 KV-cache studies: per study and arm the train-vs-rollout mismatch
(|dlogp|, k3 KL, token_mult_prob_error), reward, held-out accuracy and the KV-scale measurement's share of a step,
with each arm's k3 KL against its study's reference arm (the BF16 cache) seed by seed, and whether the target
(recalibrated FP8 KV at most `K3_TARGET` x the BF16 cache's k3 KL, in every seed) holds.

    python tools/kv_cache_report.py examples/studies/kv_cache_*.yaml --out docs/studies/kv_cache/KV_CACHE.md

Reads the finished runs only; each study's own RESULTS.md (`megatron-rl study SPEC --report-only`) has the rest.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from megatron_rl.study import results

K3_TARGET = 1.1
"""Recalibrated FP8 KV may add at most 10% to the BF16 cache's train-vs-rollout k3 KL (the target of the KV-cache studies)."""

COLUMNS = ("train-vs-rollout |dlogp|", "train-vs-rollout k3 KL", "token_mult_prob_error", "reward (mean)",
           "held-out accuracy after RL", "KV-scale measurement, share of a step")
"""METRICS labels shown per arm, in order."""


def _percent(v: float) -> str:
    return f"{100 * v:.1f}%"


def _three_digits(v: float) -> str:
    return f"{v:.3g}"


def _k3_by_seed(records: Sequence[results.RunRecord], arm: str) -> dict[int, float]:
    metric = next(m for m in results.METRICS if m.key == "mismatch_k3_kl")
    return {r.seed: results.run_value(r.rows, metric, 0.0, r.evals) for r in records if r.arm == arm and r.status == "done"}


def kv_rows(study) -> list[list[str]]:
    """Table rows of one study: one per arm."""
    records = results.collect(study, study.spec.steps)
    names = [a.name for a in study.spec.arms]
    stats = results.arm_stats(records, names, study.spec.tail_fraction)
    ref = _k3_by_seed(records, study.spec.reference)
    rows = []
    for arm in study.spec.arms:
        mine = _k3_by_seed(records, arm.name)
        ratios = [mine[s] / ref[s] for s in sorted(set(mine) & set(ref)) if ref[s] > 0 and math.isfinite(mine[s])]
        ratio = "reference" if arm.name == study.spec.reference else \
            (f"{sum(ratios) / len(ratios):.3g}x [{min(ratios):.3g}, {max(ratios):.3g}]" if ratios else "n/a")
        verdict = ""
        if arm.overrides.get("precision.kv_cache_scales") == "recalibrate" and ratios:
            verdict = "holds" if max(ratios) <= K3_TARGET else "misses"
        cells = [stats[arm.name][c].span(_percent if c.startswith("held-out") else _three_digits) for c in COLUMNS]
        rows.append([study.spec_path.stem, arm.name, str(len(mine)), *cells, ratio, verdict])
    return rows


def write_kv_report(studies: Sequence, out: Path) -> Path:
    """Write the cross-study table to `out` (markdown)."""
    header = ["study", "arm", "seeds", *COLUMNS, "k3 KL / reference, per seed", f"<= {K3_TARGET:g}x in every seed"]
    lines = ["# FP8 KV cache: BF16 against FP8 at unit and recalibrated scales", "",
             "Mean [min, max] over finished seeds. Mismatch metrics: per-token means over all steps of the run "
             "(learner vs rollout engine log-probs of the sampled tokens). k3 KL / reference: each seed's ratio to the "
             "reference arm's k3 KL on the same seed (the same warm start, data and seed).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for study in studies:
        lines += ["| " + " | ".join(row) + " |" for row in kv_rows(study)]
    lines += ["", "Studies: " + ", ".join(f"`{s.spec_path}` ({s.spec.steps} steps, seeds {s.spec.seeds})" for s in studies) + ".", ""]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out
