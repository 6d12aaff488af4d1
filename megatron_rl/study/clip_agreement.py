"""Which tokens a run's clipping zeroes: its clip decisions against high precision's, token by token, from the
calibration token dumps (issue 27 item 6: are the clipped tokens noise-pushed or truly moved?).

    python tools/dose_response.py examples/studies/deep_addtrace_dose.yaml   # -> <report_dir>/CLIP_AGREEMENT.md (and DOSE.md)

Every dumped token with a high-precision ratio (the shadow rows of shadow steps; under the dose instrument every
step) has a high-precision decision: a negative-advantage token is clipped when r_hp < 1 - eps_low, a positive one
when r_hp > 1 + eps_high (the vanilla bounds on the exact ratio: what a high-precision run clips). The run's decision
takes its dumped ratio (the one the loss decides on: r_k under algo.experimental.clip_error_scale) against
- the bounds it trained with: the held bounds logged at the end of the step before (step 0: the vanilla ones); exact
  for bounds_update per_step and per_calibration, the step's first bounds for per_minibatch;
- the vanilla bounds, on the same tokens: what a vanilla run would have zeroed there.
Per decision: clipped tokens per 1000 of the side, precision (the share of them high precision clips too: truly
moved) and recall (the share of high precision's clips they include). Pure reading: nothing is trained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_rl.study import results
from megatron_rl.study.dose import arm_dose
from megatron_rl.study.plots import read_ratio_dumps


@dataclass
class SideCounts:
    """Clip decisions of one side (A < 0 against the lower bound, or A > 0 against the upper) over some tokens."""

    tokens: int = 0
    """Tokens of this side with a finite high-precision ratio."""
    hp_clipped: int = 0
    """Of them, clipped by the high-precision decision."""
    clipped: int = 0
    """Clipped by the decision under study."""
    both: int = 0
    """Clipped by both."""

    def add(self, other: "SideCounts") -> None:
        """Add another set of counts (seeds, steps)."""
        self.tokens += other.tokens
        self.hp_clipped += other.hp_clipped
        self.clipped += other.clipped
        self.both += other.both

    @property
    def per_mille(self) -> float:
        """Clipped tokens per 1000 of the side (nan without tokens)."""
        return 1000.0 * self.clipped / self.tokens if self.tokens else math.nan

    @property
    def precision(self) -> float:
        """Share of the clipped tokens high precision clips too (nan when nothing was clipped)."""
        return self.both / self.clipped if self.clipped else math.nan

    @property
    def recall(self) -> float:
        """Share of high precision's clipped tokens this decision clips too (nan when high precision clipped none)."""
        return self.both / self.hp_clipped if self.hp_clipped else math.nan


def side_counts(ratio: np.ndarray, ratio_hp: np.ndarray, adv: np.ndarray, lower: np.ndarray, upper: np.ndarray,
                eps_low: float, eps_high: float) -> tuple[SideCounts, SideCounts]:
    """(negative side, positive side) counts of the decision `ratio < lower` / `ratio > upper` (per-token bounds)
    against high precision's `ratio_hp < 1 - eps_low` / `ratio_hp > 1 + eps_high`; tokens without a finite
    ratio_hp are left out."""
    ok = np.isfinite(ratio_hp) & np.isfinite(ratio)
    neg, pos = ok & (adv < 0), ok & (adv > 0)
    hp_lo, hp_hi = ratio_hp < 1.0 - eps_low, ratio_hp > 1.0 + eps_high
    lo, hi = ratio < lower, ratio > upper
    count = lambda side, hp, run: SideCounts(int(side.sum()), int((side & hp).sum()), int((side & run).sum()),  # noqa: E731
                                             int((side & hp & run).sum()))
    return count(neg, hp_lo, lo), count(pos, hp_hi, hi)


def bounds_in_force(rows: list[dict], steps: np.ndarray, eps_low: float, eps_high: float) -> tuple[np.ndarray, np.ndarray]:
    """Per token of step s: the held bounds logged by step s - 1 (vanilla for step 0 or a step without them)."""
    held = {int(r["step"]): (r.get("calib/lower"), r.get("calib/upper")) for r in rows}
    lower = np.full(len(steps), 1.0 - eps_low)
    upper = np.full(len(steps), 1.0 + eps_high)
    for s in np.unique(steps):
        lo, hi = held.get(int(s) - 1, (None, None))
        at = steps == s
        if isinstance(lo, (int, float)) and math.isfinite(lo):
            lower[at] = lo
        if isinstance(hi, (int, float)) and math.isfinite(hi):
            upper[at] = hi
    return lower, upper


def run_agreement(run_dir: Path, config: dict, rows: Optional[list[dict]] = None
                  ) -> Optional[dict[str, tuple[SideCounts, SideCounts]]]:
    """{"in force": (neg, pos), "vanilla bounds": (neg, pos)} of one run's dumps, or None without dumps (`rows`: its
    metrics.jsonl rows when already read)."""
    dump = read_ratio_dumps(run_dir)
    if dump is None:
        return None
    loss = config["algo"]["policy_loss"]
    eps_low, eps_high = float(loss["eps_low"]), float(loss["eps_high"])
    rows = results.read_rows(run_dir) if rows is None else rows
    lower, upper = bounds_in_force(rows, dump["step"], eps_low, eps_high)
    n = len(dump["ratio"])
    args = (dump["ratio"], dump["ratio_hp"], dump["adv"])
    return {"in force": side_counts(*args, lower, upper, eps_low, eps_high),
            "vanilla bounds": side_counts(*args, np.full(n, 1.0 - eps_low), np.full(n, 1.0 + eps_high), eps_low, eps_high)}


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.0f}%"


def agreement_report(study) -> str:
    """CLIP_AGREEMENT.md of a study: one row per (arm with dumps, decision), counts summed over its finished seeds."""
    records = results.collect(study, study.spec.steps)
    overrides = {a.name: a.overrides for a in study.spec.arms}
    lines = [f"# Clip decisions against high precision: {study.spec_path.name}", "",
             "Token by token over the calibration dumps (megatron_rl/study/clip_agreement.py says how): per 1000 tokens "
             "of the side, the share of the clipped that high precision clips too (precision: truly moved) and the share "
             "of high precision's clips included (recall). Summed over finished seeds.", "",
             "| arm | k | decision | seeds | A<0 tokens | high precision clips /1000 | A<0 clipped /1000 | precision | recall "
             "| A>0 clipped /1000 | precision | recall | high precision A>0 clips /1000 |",
             "|" + "---|" * 13]
    for arm in study.spec.arms:
        runs = [r for r in records if r.arm == arm.name and r.status == "done" and r.config is not None]
        total: dict[str, tuple[SideCounts, SideCounts]] = {}
        seeds = 0
        for r in runs:
            got = run_agreement(r.run_dir, r.config, r.rows)
            if got is None:
                continue
            seeds += 1
            for decision, (neg, pos) in got.items():
                acc = total.setdefault(decision, (SideCounts(), SideCounts()))
                acc[0].add(neg)
                acc[1].add(pos)
        k, _ = arm_dose(overrides[arm.name])
        for decision, (neg, pos) in total.items():
            hp_neg = 1000.0 * neg.hp_clipped / neg.tokens if neg.tokens else math.nan
            hp_pos = 1000.0 * pos.hp_clipped / pos.tokens if pos.tokens else math.nan
            lines.append("| " + " | ".join([
                arm.name, "n/a" if k is None else f"{k:g}", decision, str(seeds), str(neg.tokens), f"{hp_neg:.1f}",
                f"{neg.per_mille:.1f}", _pct(neg.precision), _pct(neg.recall), f"{pos.per_mille:.1f}", _pct(pos.precision),
                _pct(pos.recall), f"{hp_pos:.1f}"]) + " |")
    return "\n".join(lines) + "\n"


def write_agreement_report(study) -> Path:
    """<report_dir>/CLIP_AGREEMENT.md from the study's runs as they are."""
    study.report_out.mkdir(parents=True, exist_ok=True)
    out = study.report_out / "CLIP_AGREEMENT.md"
    out.write_text(agreement_report(study))
    return out

