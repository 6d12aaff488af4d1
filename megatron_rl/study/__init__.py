"""Experiment runner: arms x seeds of RL runs from one shared warm start, resumable, reported in RESULTS.md.

    megatron-rl study examples/studies/tiny_precision.yaml [--report-only]

Modules: spec (the YAML spec and the run configs it implies), runner (warm start, runs, report),
results (per-run values, statistics over seeds, RESULTS.md), plots (PNG figures, token-dump reader).
"""
from megatron_rl.study.spec import Study, StudyError, StudySpec, load_study

__all__ = ["Study", "StudyError", "StudySpec", "load_study"]
