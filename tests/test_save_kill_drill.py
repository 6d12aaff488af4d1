"""No process outlives a trainer SIGKILLed during a checkpoint save, and the next run resumes from the newest checkpoint.

tests/save_kill_drill.py kills a trainer at 12 points of a save (see its KILL_POINTS: before, as the watchdog and
megatron's writer helpers start, as a shard writer forks and while it writes, before and after the checkpoint is
published; and with a forked child that would block for ever); after each kill, every process the trainer started,
forked or spawned, must be gone, and the next trainer resumes from the newest complete checkpoint with its weights.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_runs import cli_env

DRILL = Path(__file__).with_name("save_kill_drill.py")


@pytest.mark.slow
def test_no_process_outlives_a_trainer_killed_during_a_save(tmp_path):
    proc = subprocess.run([sys.executable, str(DRILL), str(tmp_path / "ckpt")], env=cli_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    trials = report["trials"]
    assert len(trials) >= 11
    newest = None  # the newest complete checkpoint's step, as the trainers' own words say
    for trial in trials:
        point, said = trial["kill_point"], [line.split() for line in trial["said"]]
        assert trial["left"] == [], f"killed at {point}: left alive {trial['left']}"
        assert said[0] == (["fresh"] if newest is None else ["resumed", str(newest), "1"]), (point, trial["said"][:2])
        if point is None:
            assert trial["exit"] == 0
            continue
        assert trial["killed"], f"{point}: the kill point never fired: {trial['said']}"
        ended = [int(w[1]) for w in said if w[0] == "end"]
        begun = [int(w[1]) for w in said if w[0] == "begin"]
        newest = begun[-1] if point[0] in report["published"] else (ended[-1] if ended else newest)
    assert newest is not None and newest >= 3
