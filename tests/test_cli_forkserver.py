"""tests/cli_forkserver.py, the forkserver that runs the end-to-end tests' one-process `megatron-rl` runs: a forked run
prints, exits and fails as a fresh `python -m megatron_rl.cli` does, reports its CPU-seconds, and is killed past its
timeout. (Its runs' metrics against fresh interpreters: tests/distributed/test_loop_parallel.py compares forked
single-process references with torchrun's ranks.)"""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import cli_forkserver
from cli_forkserver import run_cli
from rl_runs import CONFIG, cli_env


def _fresh(argv):
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *argv], env=cli_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ["config", str(CONFIG), "train.steps=7"],       # success: the resolved config on stdout
    ["config", str(CONFIG), "train.no_such_key=1"],  # a refused override: exit 2, the error names the key
], ids=["ok", "refused"])
def test_a_forked_run_prints_and_exits_as_a_fresh_one(tmp_path, argv):
    before = cli_forkserver.forked_cpu_seconds
    result = run_cli(argv, cli_env(), tmp_path / "out", tmp_path / "err", timeout=120)
    fresh = _fresh(argv)
    assert result.returncode == fresh.returncode
    assert (tmp_path / "out").read_text() == fresh.stdout
    assert (tmp_path / "err").read_text() == fresh.stderr
    assert cli_forkserver.forked_cpu_seconds > before  # the run's CPU reaches the suite's accounting
    if fresh.returncode:
        assert fresh.returncode == 2 and "train.no_such_key" in fresh.stderr


def test_a_run_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(TimeoutError, match="still running"):
        run_cli(["config", str(CONFIG)], cli_env(), tmp_path / "out", tmp_path / "err", timeout=0.0)


@pytest.mark.parametrize("module", cli_forkserver.PRELOAD)
def test_every_preloaded_module_imports(module):
    """The forkserver passes over a preload that fails to import (the runs would just import it themselves, slower):
    a renamed module shows here."""
    importlib.import_module(module)
