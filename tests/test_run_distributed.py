"""tests/conftest.py:run_distributed starts the ranks as torchrun would (its worker variables, an env:// rendezvous
that works), and, like torchrun, a rank that fails takes the others down at once instead of leaving them to wait
in a collective until the test's timeout; a taken rendezvous port is retried with another."""
from __future__ import annotations

import socket
import time

import pytest

import conftest
from conftest import run_distributed

WORKER = '''
import os, sys, time
import torch.distributed as dist
sys.path.insert(0, REPORT_DIR)
from dist_report import report
mode = sys.argv[1]
if mode == "fail" and os.environ["RANK"] == "1":
    sys.exit(3)
if mode == "fail":
    time.sleep(120)
dist.init_process_group("gloo")
import torch
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
report({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} | {"sum": total.item()})
dist.destroy_process_group()
'''


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER.replace("REPORT_DIR", repr(str(conftest.REPO_ROOT / "tests" / "distributed"))))
    return path


def test_ranks_get_torchruns_variables_and_meet(worker):
    results = run_distributed(worker, 3, ["ok"], timeout=120)
    assert [r["RANK"] for r in results] == ["0", "1", "2"] == [r["LOCAL_RANK"] for r in results]
    assert {r["WORLD_SIZE"] for r in results} == {"3"} == {r["LOCAL_WORLD_SIZE"] for r in results}
    assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]


def test_a_failing_rank_takes_the_others_down(worker):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"failed \(rc=3\)"):
        run_distributed(worker, 2, ["fail"], timeout=100)
    assert time.monotonic() - start < 30  # not the 120 s rank 0 would sleep, nor the timeout


def test_a_taken_rendezvous_port_is_retried(worker, monkeypatch):
    probe = conftest._free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]  # the first launch is handed a port another process holds
        monkeypatch.setattr(conftest, "_free_port", lambda: ports.pop() if ports else probe())
        assert [r["sum"] for r in run_distributed(worker, 2, ["ok"], timeout=120)] == [3.0, 3.0]
        assert not ports
