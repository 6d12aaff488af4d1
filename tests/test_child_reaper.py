"""The trainer's watchdog (megatron_rl/child_reaper.py) starts in any interpreter: run as a script, its directory
must not shadow the standard library (megatron_rl/types.py is a module of ours). An interpreter whose site hooks
import nothing (python -S, like a venv without setuptools' .pth files) is where that showed: the watchdog died on its
first import and the trainer went on unguarded."""
from __future__ import annotations

import os
import site
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.child_reaper import trainer_mark, watchdog_command

REPO = Path(__file__).resolve().parents[1]


def test_the_watchdog_runs_in_an_interpreter_whose_site_hooks_imported_nothing(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        argv = watchdog_command(target.pid, 0.1, trainer_mark(target.pid))
        argv.insert(1, "-S")  # no site hooks: nothing imports the standard library's `types` before the script runs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *site.getsitepackages()])}
        watchdog = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert watchdog.poll() is None, f"the watchdog died on start:\n{watchdog.stderr.read()[-2000:]}"
        target.kill()
        target.wait()
        # its trainer gone, it reaps and exits by itself
        assert watchdog.wait(timeout=30) == 0, watchdog.stderr.read()[-2000:]
    finally:
        if target.poll() is None:
            target.kill()
