"""Human-facing output: the progress bar and the end-of-run summary table."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence


class Progress:
    """A tqdm bar over RL steps showing the latest key metrics (disabled off the controller)."""

    KEYS = (("reward/mean", "rew"), ("accuracy/train", "acc"), ("clipfrac_lower_neg", "clipN"), ("calib/lower", "L"), ("time/step", "s/it"))

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        """Create the bar (starting at `initial` when resuming)."""
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="RL", unit="step", disable=not enabled, dynamic_ncols=True)

    def update(self, metrics: dict[str, Any]) -> None:
        """Advance one step and show its metrics."""
        shown = {}
        for key, short in self.KEYS:
            v = metrics.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                shown[short] = f"{v:.3g}"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


def _mean(rows: Sequence[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else math.nan


def summary_rows(rows: Sequence[dict], eval_before: float, eval_after: float, wall_s: float) -> list[tuple[str, str]]:
    """(label, value) pairs of the end-of-run summary."""
    head, tail = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5):]

    def fmt(v: float, pct: bool = False) -> str:
        if not math.isfinite(v):
            return "n/a"
        return f"{100 * v:.1f}%" if pct else f"{v:.4g}"

    last = rows[-1] if rows else {}

    def pair(a: str, b: str, source=None) -> str:
        src = last if source is None else source
        return f"{fmt(src.get(a, math.nan) if isinstance(src.get(a), (int, float)) else math.nan)} / " \
               f"{fmt(src.get(b, math.nan) if isinstance(src.get(b), (int, float)) else math.nan)}"

    def quantiles(side: str) -> str:
        return " ".join(fmt(_mean(rows, f"ratio_{side}_q{q}")) for q in ("0.1", "1", "50", "99", "99.9"))

    out = [
        ("steps", str(len(rows))),
        ("held-out greedy accuracy (before RL)", fmt(eval_before, True)),
        ("held-out greedy accuracy (after RL)", fmt(eval_after, True)),
        ("gain", f"{100 * (eval_after - eval_before):+.1f} points" if math.isfinite(eval_after - eval_before) else "n/a"),
        ("train reward (first 20% -> last 20% of steps)", f"{fmt(_mean(head, 'reward/mean'))} -> {fmt(_mean(tail, 'reward/mean'))}"),
        ("entropy (first -> last)", f"{fmt(_mean(head, 'entropy'))} -> {fmt(_mean(tail, 'entropy'))}"),
        ("clipfrac_lower_neg / clipfrac_upper_pos / clipfrac (mean)",
         f"{fmt(_mean(rows, 'clipfrac_lower_neg'))} / {fmt(_mean(rows, 'clipfrac_upper_pos'))} / {fmt(_mean(rows, 'clipfrac'))}"),
        ("high-precision shadow clipfrac_lower_neg (mean)", fmt(_mean(rows, "hp/clipfrac_lower_neg"))),
        ("calibrated L / H (last)", pair("calib/lower", "calib/upper")),
        ("alpha target / achieved (last)", pair("calib/alpha_target", "calib/alpha_achieved")),
        ("rho target / achieved (last)", pair("calib/rho_target", "calib/rho_achieved")),
        ("ratio quantiles A<0 (0.1% 1% 50% 99% 99.9%)", quantiles("neg")),
        ("ratio quantiles A>0 (0.1% 1% 50% 99% 99.9%)", quantiles("pos")),
        ("ppo_kl (mean)", fmt(_mean(rows, "ppo_kl"))),
        ("train-vs-rollout |dlogp| / k3 KL (mean)", f"{fmt(_mean(rows, 'mismatch_abs_dlogp'))} / {fmt(_mean(rows, 'mismatch_k3_kl'))}"),
        ("token_mult_prob_error (mean)", fmt(_mean(rows, "token_mult_prob_error"))),
        ("FP8 vs high-precision |dlogp| (shadow steps)", fmt(_mean(rows, "fp8/logprob_abs_err_mean"))),
        ("TIS weight mean / clipfrac", f"{fmt(_mean(rows, 'tis_weight_mean'))} / {fmt(_mean(rows, 'tis_clipfrac'))}"),
        ("step time (mean, s)", fmt(_mean(rows, "time/step"))),
        ("wall time (s)", f"{wall_s:.1f}"),
    ]
    return out


def print_summary(rows: Sequence[dict], eval_before: float, eval_after: float, wall_s: float, title: str = "megatron_rl run summary") -> str:
    """Print the summary table (rich) and return it as plain text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    pairs = summary_rows(rows, eval_before, eval_after, wall_s)
    for label, value in pairs:
        table.add_row(label, value)
    Console(width=max(100, Console().width)).print(table)
    return "\n".join(f"{label}: {value}" for label, value in pairs)
