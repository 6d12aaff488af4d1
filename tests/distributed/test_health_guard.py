"""Training-health guard under DP=2 on gloo: a NaN loss or an inf gradient on one rank of two skips that optimizer
update on both ranks (same decision everywhere, weights untouched, LR schedule not advanced), training continues,
and the final weights equal a single-process run that skipped the same step.
Run: pytest -q -m distributed tests/distributed/test_health_guard.py
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("health_worker.py")
POISON_STEP = 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """World-1 run whose only rank has a NaN loss on POISON_STEP."""
    out = tmp_path_factory.mktemp("health_ref")
    run_distributed(WORKER, 1, ["--poison", "loss", "--poison-rank", "0", "--poison-step", str(POISON_STEP),
                                "--out", str(out)], timeout=300)
    return out, torch.load(out / "rank0.pt")


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_nonfinite_on_one_rank_skips_the_update_on_every_rank(reference, tmp_path, poison):
    ref_dir, ref = reference
    assert [s["update_skipped"] for s in ref["steps"]] == [0.0, 1.0, 0.0]
    run_distributed(WORKER, 2, ["--poison", poison, "--poison-rank", "1", "--poison-step", str(POISON_STEP),
                                "--init", str(ref_dir / "init.pt"), "--out", str(tmp_path)], timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, res in enumerate(results):
        assert [s["update_skipped"] for s in res["steps"]] == [0.0, 1.0, 0.0], f"rank {rank}"
        # the skipped update left this rank's weights exactly as they were; the others changed them
        d = res["digests"]
        assert d[POISON_STEP] == d[POISON_STEP - 1] and d[POISON_STEP + 1] != d[POISON_STEP], f"rank {rank}: {d}"
        assert res["step_count"] == 2 and res["steps"][POISON_STEP]["lr"] == res["steps"][0]["lr"]
        assert all(math.isfinite(s["loss"]) for i, s in enumerate(res["steps"]) if i != POISON_STEP)
    # training went on from the same state on both ranks: the result equals the single process that skipped the step
    for name, want in ref["final"].items():
        torch.testing.assert_close(results[0]["final"][name], want, atol=2e-5, rtol=0, msg=name)
