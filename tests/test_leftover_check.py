"""The conftest check at the end of a test run: a process left behind (a child, or a grandchild orphaned by
its parent) fails the run and is named, then killed; a clean run passes. Runs pytest on a scratch suite
that uses this repository's conftest.py."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

LEAKY = '''
import subprocess
import sys

def test_leaves_a_child():
    subprocess.Popen(["sleep", "60.5"])

def test_leaves_an_orphaned_grandchild():
    subprocess.run(["sh", "-c", "sleep 61.5 & exit 0"], check=True)

def test_sigkilled_child_orphans_its_manager():
    # what a SIGKILLed trainer leaves: megatron's writer Manager and its resource tracker, with no parent to stop them
    code = ("import multiprocessing, os, signal\\n"
            "if __name__ == '__main__':\\n"
            "    q = multiprocessing.get_context('spawn').Manager().Queue()\\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
'''

CLEAN = '''
import multiprocessing
import subprocess

_QUEUE = []

def test_waits_for_its_child():
    subprocess.run(["sleep", "0.1"], check=True)

def test_keeps_a_process_wide_manager():
    # as megatron-core's checkpoint writer does: a spawn Manager (and resource tracker) for the life of the process
    _QUEUE.append(multiprocessing.get_context("spawn").Manager().Queue())
'''


def _run_suite(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_scratch.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _sleepers(*args: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if cmd[:1] == ["sleep"] and cmd[1:2] and cmd[1] in args and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def test_a_leftover_process_fails_the_run_and_is_named(tmp_path):
    proc = _run_suite(tmp_path, LEAKY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed" in out and "left processes behind" in out
    assert "sleep 60.5" in out and "sleep 61.5" in out  # the orphan is found too (pytest is its subreaper)
    assert "multiprocessing.resource_tracker" in out and "multiprocessing.spawn" in out
    deadline = time.monotonic() + 10
    while _sleepers("60.5", "61.5") and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _sleepers("60.5", "61.5")
    for p in left:
        p.kill()
    assert not left, "the check did not kill what it reported"


def test_a_clean_run_passes(tmp_path):
    proc = _run_suite(tmp_path, CLEAN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "left processes behind" not in proc.stdout + proc.stderr
