"""The learner's FP8 KV cache amax probe under TP / DP / CP / PP on gloo equals the single-process measurement on the
same weights and batch (K/V heads TP-sharded, rows DP-sharded, sequences CP-chunked, layers PP-staged: the MAX
all-reduce over every rank must put each layer's true amax on every rank).

Run: pytest -q -m distributed tests/distributed/test_kv_amax_parallel.py
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # about a minute per layout on two cores
WORKER = Path(__file__).with_name("kv_amax_worker.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """World 1, the whole batch in one micro-batch: (its directory with init.pt, its amax)."""
    out = tmp_path_factory.mktemp("ref")
    res = run_distributed(WORKER, 1, ["--mbs", "8", "--out", str(out)], timeout=300)
    amax = torch.tensor(res[0]["amax"])
    assert (amax > 0).all()
    return out, amax


@pytest.mark.parametrize("layout", [["--tp", "2"], [], ["--cp", "2"], ["--pp", "2"]], ids=["tp2", "dp2", "cp2", "pp2"])
def test_probe_under_a_layout_matches_one_process(reference, tmp_path, layout):
    ref_dir, want = reference
    results = run_distributed(WORKER, 2, [*layout, "--init", str(ref_dir / "init.pt"), "--out", str(tmp_path)],
                              timeout=300)
    for res in results:  # every rank holds every layer's amax
        torch.testing.assert_close(torch.tensor(res["amax"]), want, rtol=1e-5, atol=1e-6)
