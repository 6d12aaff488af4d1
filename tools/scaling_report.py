"""Gather a scaling study's runs into a table and plots: throughput and step-time breakdown vs nodes, efficiency
vs ideal scaling, and the plan's estimate beside the measurement.

    python tools/scaling_report.py sweeps/qwen3_8b/manifest.json --out reports/qwen3_8b [--skip-steps 1]

Reads the manifest of tools/scaling_sweep.py and each run's metrics.jsonl (loop.py writes one row per step
with `time/<phase>` timers). Per cell: mean seconds per phase over the steps after `--skip-steps` warm-up
steps, samples/s and response tokens/s. Efficiency of a cell = its throughput / (throughput of the same
layout and precision at the fewest nodes x nodes ratio). Writes OUT/scaling.md (table + the commands
that produced it) and OUT/scaling.png.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("rollout", "reward", "advantages", "logprobs", "train", "weight_sync")
"""Timers of loop.py, in step order."""


def _mean(values: list) -> float:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else math.nan


def measure(cell: dict, skip_steps: int) -> dict | None:
    """Phase means and throughput of one cell's run (None when it has no metrics after the warm-up)."""
    from megatron_rl.tracking import read_metrics

    path = Path(cell["run_dir"]) / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [r for r in read_metrics(path) if r.get("step", 0) >= skip_steps]
    if not rows:
        return None
    out = {phase: _mean([r.get(f"time/{phase}") for r in rows]) for phase in PHASES}
    out["step"] = _mean([r.get("time/step") for r in rows])
    out["steps"] = len(rows)
    samples = cell["samples_per_step"]
    out["samples_per_s"] = samples / out["step"] if out["step"] > 0 else math.nan
    out["tokens_per_s"] = samples * _mean([r.get("rollout/response_len_mean") for r in rows]) / out["step"]
    return out


def efficiencies(cells: list[dict]) -> None:
    """Fill cell['efficiency'] = throughput / (smallest-nodes throughput x nodes ratio), per (layout, precision)."""
    series = defaultdict(list)
    for c in cells:
        if c.get("measured"):
            series[(c["layout"], c["precision"])].append(c)
    for members in series.values():
        base = min(members, key=lambda c: c["nodes"])
        for c in members:
            ideal = base["measured"]["samples_per_s"] * c["nodes"] / base["nodes"]
            c["efficiency"] = c["measured"]["samples_per_s"] / ideal if ideal > 0 else math.nan


def table(cells: list[dict]) -> str:
    """Markdown table of every cell."""
    head = ("| cell | nodes | DP | steps | samples/s | tokens/s | efficiency | step s (measured) | step s (plan) | "
            + " | ".join(PHASES) + " |")
    lines = [head, "|" + "---|" * (10 + len(PHASES))]
    for c in cells:
        m, plan = c.get("measured"), c["plan"]
        if not plan["ok"]:
            lines.append(f"| {c['name']} | {c['nodes']} | - | skipped: {', '.join(plan['errors'])} |" + " |" * (6 + len(PHASES)))
            continue
        if not m:
            lines.append(f"| {c['name']} | {c['nodes']} | {plan['dp']} | no metrics |" + " |" * (6 + len(PHASES)))
            continue
        phases = " | ".join(f"{m[p]:.2f}" for p in PHASES)
        lines.append(f"| {c['name']} | {c['nodes']} | {plan['dp']} | {m['steps']} | {m['samples_per_s']:.2f} | "
                     f"{m['tokens_per_s']:.1f} | {c.get('efficiency', math.nan):.2f} | {m['step']:.2f} | "
                     f"{plan['step_s']:.3g} | {phases} |")
    return "\n".join(lines)


def plot(cells: list[dict], path: Path) -> None:
    """Four panels: throughput vs nodes (with ideal), step-time breakdown, efficiency, plan vs measured step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in cells if c.get("measured")]
    series = defaultdict(list)
    for c in done:
        series[(c["layout"], c["precision"])].append(c)
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    for (layout, prec), members in sorted(series.items()):
        members.sort(key=lambda c: c["nodes"])
        nodes = [c["nodes"] for c in members]
        thr = [c["measured"]["samples_per_s"] for c in members]
        line, = ax[0][0].plot(nodes, thr, "o-", label=f"{layout} {prec}")
        ax[0][0].plot(nodes, [thr[0] * n / nodes[0] for n in nodes], "--", color=line.get_color(), alpha=0.4)
        ax[1][0].plot(nodes, [c["efficiency"] for c in members], "o-", color=line.get_color(), label=f"{layout} {prec}")
        ax[1][1].plot(nodes, [c["measured"]["step"] for c in members], "o-", color=line.get_color(), label=f"{layout} {prec} measured")
        ax[1][1].plot(nodes, [c["plan"]["step_s"] for c in members], "x:", color=line.get_color(), label=f"{layout} {prec} plan")
    ax[0][0].set(title="throughput (dashed: ideal linear scaling)", xlabel="nodes", ylabel="samples / s")
    ax[0][0].legend(fontsize=7)
    names = [c["name"] for c in done]
    bottom = [0.0] * len(done)
    for phase in PHASES:
        vals = [c["measured"][phase] if math.isfinite(c["measured"][phase]) else 0.0 for c in done]
        ax[0][1].bar(range(len(done)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[0][1].set_xticks(range(len(done)), names, rotation=60, ha="right", fontsize=7)
    ax[0][1].set(title="step time by phase", ylabel="seconds / step")
    ax[0][1].legend(fontsize=7)
    ax[1][0].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax[1][0].set(title="scaling efficiency vs ideal", xlabel="nodes", ylabel="efficiency", ylim=(0, 1.2))
    ax[1][0].legend(fontsize=7)
    ax[1][1].set(title="step time: measured vs plan estimate", xlabel="nodes", ylabel="seconds / step", yscale="log")
    ax[1][1].legend(fontsize=6)
    for a in (ax[0][0], ax[1][0], ax[1][1]):
        a.set_xticks(sorted({c["nodes"] for c in done}))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """Write OUT/scaling.md and OUT/scaling.png; 1 when no cell has metrics."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest")
    p.add_argument("--out", required=True)
    p.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of the means (default 1)")
    p.add_argument("--title", default="Scaling study")
    p.add_argument("--note", default="", help="text placed under the title (e.g. the command that ran the sweep)")
    args = p.parse_args(argv)
    manifest = json.loads(Path(args.manifest).read_text())
    cells = manifest["cells"]
    for c in cells:
        c["measured"] = measure(c, args.skip_steps) if c["plan"]["ok"] else None
    if not any(c["measured"] for c in cells):
        print(f"no cell of {args.manifest} has metrics after step {args.skip_steps}", file=sys.stderr)
        return 1
    efficiencies(cells)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(cells, out / "scaling.png")
    report = [f"# {args.title}", "", args.note, "",
              f"Sweep: `{manifest['command']}`", "",
              f"Report: `python tools/scaling_report.py {args.manifest} --out {args.out} --skip-steps {args.skip_steps}`",
              "", f"Means over steps >= {args.skip_steps}; efficiency = samples/s / (fewest-nodes samples/s x nodes ratio) "
              "per layout and precision; `step s (plan)` is `megatron-rl plan`'s analytic estimate for the cell.", "",
              table(cells), "", "![scaling](scaling.png)", ""]
    (out / "scaling.md").write_text("\n".join(report))
    print(f"wrote {out / 'scaling.md'} and {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
