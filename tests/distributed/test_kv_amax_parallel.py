"""The learner's FP8 KV cache amax probe under TP / DP / CP / PP on gloo equals the single-process measurement on the
same weights and batch (K/V heads TP-sharded, rows DP-sharded, sequences CP-chunked, layers PP-staged: the MAX
all-reduce over every rank must put each layer's true amax on every rank).

Run: pytest -q -m distributed tests/distributed/test_kv_amax_parallel.py
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_distributed, run_distributed_cases

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one launch of every layout, a minute or two on two cores
WORKER = Path(__file__).with_name("kv_amax_worker.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """World 1, the whole batch in one micro-batch: (its directory with init.pt, its amax)."""
    out = tmp_path_factory.mktemp("ref")
    res = run_distributed(WORKER, 1, ["--mbs", "8", "--out", str(out)], timeout=300)
    amax = torch.tensor(res[0]["amax"])
    assert (amax > 0).all()
    return out, amax


LAYOUTS = {"tp2": ["--tp", "2"], "dp2": [], "cp2": ["--cp", "2"], "pp2": ["--pp", "2"]}


@pytest.fixture(scope="module")
def two_process(reference, tmp_path_factory):
    """Every layout's per-rank reports, from one 2-process launch (the worker rebuilds megatron's groups per case)."""
    ref_dir, _ = reference
    root = tmp_path_factory.mktemp("world2")
    cases = [[*args, "--init", str(ref_dir / "init.pt"), "--out", str(root)] for args in LAYOUTS.values()]
    return dict(zip(LAYOUTS, run_distributed_cases(WORKER, 2, cases, root / "cases.json", timeout=400)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_probe_under_a_layout_matches_one_process(reference, two_process, layout):
    _, want = reference
    for res in two_process[layout]:  # every rank holds every layer's amax
        torch.testing.assert_close(torch.tensor(res["amax"]), want, rtol=1e-5, atol=1e-6)
