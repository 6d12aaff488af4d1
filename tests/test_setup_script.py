"""scripts/setup_cpu.sh: a no-op while the install inputs are unchanged (the stamp of scripts/install_stamp.sh),
one line of output when it installs, pip's output only when a step fails.

The scripts run for real in a temporary copy of the install inputs, with a fake `.venv/bin/python` that logs
its calls and answers like pip (noise included), so no test installs anything.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
INPUTS = ["setup.py", "pyproject.toml", "constraints/cpu.txt", "scripts/setup_cpu.sh", "scripts/install_stamp.sh"]

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: logs each call; `-m pip` prints setuptools-like noise and exits $FAKE_PIP_RC.
echo "$*" >> "$(dirname "$0")/../calls.log"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "BuildBackendWarning: Editable installation."
  echo "********************************************************************************"
  [ "${FAKE_PIP_RC:-0}" = 0 ] || echo "ERROR: No matching distribution found for torch==2.13.0"
  exit "${FAKE_PIP_RC:-0}"
fi
case "$*" in *"print(sys.version)"*) echo "${FAKE_VERSION:-3.11.9 (fake)}" ;; esac
exit 0
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the install inputs with an existing (fake) .venv, never set up."""
    for rel in INPUTS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / rel, tmp_path / rel)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return tmp_path


def _setup(checkout: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", "scripts/setup_cpu.sh", *args], cwd=checkout, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def _calls(checkout: Path) -> list[str]:
    log = checkout / ".venv" / "calls.log"
    return [c for c in log.read_text().splitlines() if "print(sys.version)" not in c] if log.exists() else []


def test_install_is_silent_then_a_noop_until_an_input_changes(checkout):
    first = _setup(checkout)
    assert first.returncode == 0, first.stderr
    assert first.stdout == ""
    assert len(first.stderr.splitlines()) == 1 and "installing" in first.stderr  # one line, no warning box
    installs = _calls(checkout)
    assert any("torch==2.13.0" in c for c in installs) and any("-e .[test]" in c for c in installs)
    assert (checkout / ".venv" / ".install_stamp").exists()

    again = _setup(checkout)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert _calls(checkout) == installs  # nothing ran
    assert _setup(checkout, "--check").returncode == 0


@pytest.mark.parametrize("rel", INPUTS)
def test_each_install_input_invalidates_the_stamp(checkout, rel):
    assert _setup(checkout).returncode == 0
    assert _setup(checkout, "--check").returncode == 0
    with (checkout / rel).open("a") as fh:
        fh.write("\n# changed\n")
    check = _setup(checkout, "--check")
    assert check.returncode == 1 and "would install" in check.stdout


def test_python_version_invalidates_the_stamp(checkout):
    assert _setup(checkout).returncode == 0
    assert _setup(checkout, "--check", FAKE_VERSION="3.11.9 (fake)").returncode == 0
    assert _setup(checkout, "--check", FAKE_VERSION="3.12.1 (fake)").returncode == 1


def test_no_venv_means_install(checkout):
    shutil.rmtree(checkout / ".venv")
    assert _setup(checkout, "--check").returncode == 1


def test_failed_install_shows_the_error_and_leaves_no_stamp(checkout):
    failed = _setup(checkout, FAKE_PIP_RC="1")
    assert failed.returncode != 0
    assert "setup failed" in failed.stderr and "No matching distribution found for torch==2.13.0" in failed.stderr
    assert not (checkout / ".venv" / ".install_stamp").exists()
    assert _setup(checkout, "--check").returncode == 1
