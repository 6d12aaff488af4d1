"""The suite's scheduling list (tests/conftest.py LONGEST_FILES_FIRST) names test files that exist, each once, and a
collection puts them first in that order (a renamed file would otherwise silently lose its place), and the test command
keeps that order on its xdist workers (xdist's loadfile reorders files by test count unless told not to)."""
from __future__ import annotations

import subprocess
import sys

from conftest import LONGEST_FILES_FIRST, REPO_ROOT


def test_every_listed_file_exists_once():
    assert len(set(LONGEST_FILES_FIRST)) == len(LONGEST_FILES_FIRST)
    missing = [name for name in LONGEST_FILES_FIRST if not (REPO_ROOT / name).is_file()]
    assert not missing, f"LONGEST_FILES_FIRST names files that are gone: {missing}"


def test_collection_starts_with_the_listed_files_in_order():
    chosen = [LONGEST_FILES_FIRST[2], "tests/test_config.py", LONGEST_FILES_FIRST[0]]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *chosen],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = list(dict.fromkeys(line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line))
    assert files == [LONGEST_FILES_FIRST[0], LONGEST_FILES_FIRST[2], "tests/test_config.py"]


def test_the_test_command_keeps_the_collection_order_on_its_workers():
    script = (REPO_ROOT / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script
