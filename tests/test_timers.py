"""The loop's phase timers: wall seconds and the process's CPU seconds, per phase and summed."""
import time

from megatron_rl.tracking.timers import Timers


def test_timers_split_wall_from_cpu_time_and_reset():
    """A sleep is wall time without CPU time; a busy loop is both; repeated names add up; pop() resets."""
    timers = Timers()
    with timers("wait"):
        time.sleep(0.2)
    for _ in range(2):
        with timers("work"):
            end = time.process_time() + 0.1
            while time.process_time() < end:
                pass
    out = timers.pop()
    assert out["time/wait"] >= 0.19 and out["cpu/wait"] < 0.1
    assert out["cpu/work"] >= 0.19 and out["time/work"] >= out["cpu/work"] * 0.9
    assert out["time/step"] == out["time/wait"] + out["time/work"]
    assert out["cpu/step"] == out["cpu/wait"] + out["cpu/work"]
    assert timers.pop() == {"time/step": 0.0, "cpu/step": 0.0}
