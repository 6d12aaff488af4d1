"""Human-facing output: the progress bar (or plain progress lines), the end-of-run summary table and its plots.

Words used in the summary and in tools/compare_runs.py mean the same thing in both:
"final" is the last logged value of a metric, "mean of last 20%" the mean over the last fifth of the steps.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

RL_KEYS = (("reward/mean", "rew"), ("accuracy/train", "acc"), ("clipfrac_lower_neg", "clipN"), ("calib/lower", "L"),
           ("time/step", "s/it"))
"""(metric key, short label) pairs the RL progress bar shows."""

def terminal_columns(stream: TextIO) -> int:
    """Columns of the terminal behind `stream`; 0 when it is not a terminal or reports no width (CI logs, `script`)."""
    try:
        if not stream.isatty():
            return 0
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class Progress:
    """Progress over steps with the latest metrics: a tqdm bar on a terminal; elsewhere (no TTY, or a terminal that
    reports 0 columns, where a bar would vanish) plain lines every 10% of the steps or every `line_every_s` seconds."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "RL",
                 keys: Sequence[tuple[str, str]] = RL_KEYS, stream: Optional[TextIO] = None,
                 line_every_s: float = 30.0) -> None:
        """Start at `initial` of `total` steps (resume); `keys` are the (metric, label) pairs shown; nothing when not enabled."""
        self.total, self.n, self.desc, self.keys = total, initial, desc, tuple(keys)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.line_every_s = line_every_s
        self.bar = None
        self.plain = enabled and terminal_columns(self.stream) <= 0
        self._start = self._last_line = time.monotonic()
        self._start_n = initial
        self._next_pct = self._pct_mark(initial)
        self._shown: dict[str, str] = {}
        if enabled and not self.plain:
            from tqdm.auto import tqdm

            # miniters=1: tqdm's adaptive miniters would skip redraws (and the metrics) when steps are fast
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=self.stream,
                            miniters=1, mininterval=0.1)
        elif self.plain:
            start = f"resuming at step {initial}/{total}" if initial else f"{total} steps"
            self._print(f"{desc}: {start}")

    def _pct_mark(self, n: int) -> int:
        """The next multiple of 10% strictly above step `n`."""
        return (100 * n // max(self.total, 1)) // 10 * 10 + 10

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self._last_line = time.monotonic()

    def update(self, metrics: dict[str, Any]) -> None:
        """Advance one step and show its metrics."""
        if not self.enabled:
            return
        self.n += 1
        for key, short in self.keys:
            v = metrics.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._shown[short] = f"{v:.3g}"
        if self.bar is not None:
            self.bar.set_postfix(self._shown, refresh=False)
            self.bar.update(1)
            return
        pct = 100 * self.n // max(self.total, 1)
        now = time.monotonic()
        if pct >= self._next_pct or self.n >= self.total or now - self._last_line >= self.line_every_s:
            self._next_pct = self._pct_mark(self.n)
            done = self.n - self._start_n
            rate = (now - self._start) / done if done else math.nan
            left = f", ~{rate * (self.total - self.n):.0f} s left" if math.isfinite(rate) and self.n < self.total else ""
            shown = " ".join(f"{k}={v}" for k, v in self._shown.items())
            self._print(f"{self.desc}: step {self.n}/{self.total} ({pct}%) {shown} | {now - self._start:.0f} s{left}".replace("  ", " "))

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


def _finite_values(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def mean_of(rows: Sequence[dict], key: str) -> float:
    """Mean of `key` over the rows that log it as a finite number (nan if none)."""
    vals = _finite_values(rows, key)
    return sum(vals) / len(vals) if vals else math.nan


def final_value(rows: Sequence[dict], key: str) -> float:
    """The last finite value of `key` ("final"), nan if never logged."""
    vals = _finite_values(rows, key)
    return vals[-1] if vals else math.nan


def head_rows(rows: Sequence[dict]) -> Sequence[dict]:
    """The first 20% of the steps (at least one row)."""
    return rows[: max(1, len(rows) // 5)]


def tail_rows(rows: Sequence[dict]) -> Sequence[dict]:
    """The last 20% of the steps (at least one row): what "mean of last 20%" averages."""
    return rows[-max(1, len(rows) // 5):]


def summary_rows(rows: Sequence[dict], eval_before: float, eval_after: float, wall_s: float, sessions: int = 1,
                 plots: Sequence[Path] = (), context: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """(label, value) pairs of the end-of-run summary; `context` pairs (where the run started, its CPU kernels) go last."""
    head, tail = head_rows(rows), tail_rows(rows)

    def fmt(v: float, pct: bool = False) -> str:
        if not math.isfinite(v):
            return "n/a"
        return f"{100 * v:.1f}%" if pct else f"{v:.4g}"

    def final_pair(a: str, b: str) -> str:
        return f"{fmt(final_value(rows, a))} / {fmt(final_value(rows, b))}"

    def quantiles(side: str) -> str:
        return " ".join(fmt(mean_of(rows, f"ratio_{side}_q{q}")) for q in ("0.1", "1", "50", "99", "99.9"))

    out = [
        ("steps", str(len(rows))),
        ("held-out greedy accuracy (before RL)", fmt(eval_before, True)),
        ("held-out greedy accuracy (after RL)", fmt(eval_after, True)),
        ("gain", f"{100 * (eval_after - eval_before):+.1f} points" if math.isfinite(eval_after - eval_before) else "n/a"),
        ("train reward (mean of first 20% -> mean of last 20% of steps)",
         f"{fmt(mean_of(head, 'reward/mean'))} -> {fmt(mean_of(tail, 'reward/mean'))}"),
        ("entropy (mean of first 20% -> mean of last 20% of steps)",
         f"{fmt(mean_of(head, 'entropy'))} -> {fmt(mean_of(tail, 'entropy'))}"),
        ("clipfrac_lower_neg / clipfrac_upper_pos / clipfrac (mean)",
         f"{fmt(mean_of(rows, 'clipfrac_lower_neg'))} / {fmt(mean_of(rows, 'clipfrac_upper_pos'))} / {fmt(mean_of(rows, 'clipfrac'))}"),
        ("high-precision shadow clipfrac_lower_neg (mean)", fmt(mean_of(rows, "hp/clipfrac_lower_neg"))),
        ("calibrated L / H (final)", final_pair("calib/lower", "calib/upper")),
        ("alpha target / achieved (final)", final_pair("calib/alpha_target", "calib/alpha_achieved")),
        ("rho target / achieved (final)", final_pair("calib/rho_target", "calib/rho_achieved")),
        ("ratio quantiles A<0 (0.1% 1% 50% 99% 99.9%)", quantiles("neg")),
        ("ratio quantiles A>0 (0.1% 1% 50% 99% 99.9%)", quantiles("pos")),
        ("ppo_kl (mean)", fmt(mean_of(rows, "ppo_kl"))),
        ("train-vs-rollout |dlogp| / k3 KL (mean)", f"{fmt(mean_of(rows, 'mismatch_abs_dlogp'))} / {fmt(mean_of(rows, 'mismatch_k3_kl'))}"),
        ("token_mult_prob_error (mean)", fmt(mean_of(rows, "token_mult_prob_error"))),
        ("FP8 vs high-precision |dlogp| (shadow steps)", fmt(mean_of(rows, "fp8/logprob_abs_err_mean"))),
        ("TIS weight mean / clipfrac", f"{fmt(mean_of(rows, 'tis_weight_mean'))} / {fmt(mean_of(rows, 'tis_clipfrac'))}"),
        ("step time (mean, s)", fmt(mean_of(rows, "time/step"))),
        ("wall time (s)", f"{wall_s:.1f}" + (f" (summed over {sessions} sessions; earlier ones up to their last checkpoint)" if sessions > 1 else "")),
        *context,
    ]
    if any("malformed/train" in r for r in rows):  # tasks with an answer format (data/tasks.py)
        out.insert(6, ("malformed answers, train (mean of first 20% -> mean of last 20% of steps)",
                       f"{fmt(mean_of(head, 'malformed/train'))} -> {fmt(mean_of(tail, 'malformed/train'))}"))
    if any("calib/gate_ratio" in r for r in rows):  # strength=decision: the distortion the shadow measured
        ratio, tokens = final_value(rows, "calib/gate_ratio"), final_value(rows, "calib/gate_hp_tokens")
        at = next(i for i, (label, _) in enumerate(out) if label.startswith("calibrated L / H")) + 1
        out.insert(at, ("distortion: low/high-precision clip fraction below 1 - eps_low on the shadow's tokens, pooled (final)",
                        f"{fmt(ratio)}x on {fmt(tokens)} shadow-clipped tokens"))
    decided = [r for r in rows if isinstance(r.get("calib/hp_decision"), (int, float))]
    if decided:  # strength=decision
        on = [int(r["step"]) for r in decided if r["calib/hp_decision"] == 1.0]
        at = next(i for i, (label, _) in enumerate(out) if label.startswith("calibrated L / H")) + 1
        out.insert(at, ("clip decided on high-precision ratios (vanilla bounds)",
                        f"{len(on)} of {len(decided)} steps" + (f", first at step {on[0]}" if on else "")))
    if any("calib/targeted_token_share" in r for r in rows):  # strength=targeted: how much of the batch it decided
        at = next(i for i, (label, _) in enumerate(out) if label.startswith("clip decided on high-precision")) + 1
        out.insert(at, ("off-policy answer tokens decided so (targeted, mean)", fmt(mean_of(rows, "calib/targeted_token_share"))))
    if plots:
        stems = [Path(p).stem for p in plots]
        names = stems[0] if len(stems) == 1 else "{" + ",".join(stems) + "}"
        out.append(("plots", f"{Path(plots[0]).parent}/{names}.png"))
    return out


def print_summary(rows: Sequence[dict], eval_before: float, eval_after: float, wall_s: float,
                  title: str = "megatron_rl run summary", sessions: int = 1, plots: Sequence[Path] = (),
                  context: Sequence[tuple[str, str]] = ()) -> str:
    """Print the summary table (rich) and return it as plain text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    pairs = summary_rows(rows, eval_before, eval_after, wall_s, sessions, plots, context)
    for label, value in pairs:
        if label != "plots":
            table.add_row(label, value)
    console = Console(width=max(100, Console().width))
    console.print(table)
    if plots:  # under the table, whole: a path is no use cut or folded
        console.print(f"plots: {dict(pairs)['plots']}", soft_wrap=True, highlight=False)
    return "\n".join(f"{label}: {value}" for label, value in pairs)


def write_run_report(run_dir: str | Path, rows: Sequence[dict], eval_before: float, eval_after: float, wall_s: float,
                     sessions: int = 1, plots: bool = True, context: Sequence[tuple[str, str]] = ()) -> str:
    """End of a run: draw RUN_DIR/plots/*.png (when `plots`), print the summary naming them, write RUN_DIR/summary.txt."""
    run_dir = Path(run_dir)
    written = []
    if plots:
        from megatron_rl.tracking.plots import plot_run

        written = plot_run(rows, run_dir / "plots")
    text = print_summary(rows, eval_before, eval_after, wall_s, sessions=sessions, plots=written, context=context)
    (run_dir / "summary.txt").write_text(text + "\n")
    return text
