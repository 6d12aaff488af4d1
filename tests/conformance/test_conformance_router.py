"""Conformance with the real sglang-router (the trainer's own pin, constraints/cpu.txt): every router command line the
project builds (each policy, with and without an API key; the Slurm script's) parses with its RouterArgs and gives
the intended fields.

Run: pytest -q tests/conformance/test_conformance_router.py
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance_packages import trainer_pin
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.processes import ROUTER_POLICIES, router_command

pytestmark = pytest.mark.conformance
ROOT = Path(__file__).resolve().parents[2]


def test_the_pinned_router_is_installed():
    import sglang_router

    assert sglang_router.__version__ == trainer_pin("sglang-router")


def test_router_policies_are_the_routers_own():
    import typing

    assert set(typing.get_args(RolloutConfig.model_fields["router_policy"].annotation)) == set(ROUTER_POLICIES)


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
@pytest.mark.parametrize("key", [None, "s3cret"])
def test_router_command_parses_with_router_args(policy, key):
    from sglang_router.launch_router import parse_router_args

    workers = ["http://node-0:30000", "http://node-0:30001"]
    argv = router_command(workers, 30002, "0.0.0.0", policy, ["--api-key", key] if key else [])
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    args = parse_router_args(argv[3:])
    assert (args.worker_urls, args.policy, args.host, args.port) == (workers, policy, "0.0.0.0", 30002)
    assert (args.worker_startup_check_interval, args.health_check_interval_secs, args.health_failure_threshold) == (1, 5, 2)
    assert args.api_key == key and args.prometheus_host == "0.0.0.0" and args.prometheus_port > 0


def test_slurm_router_line_parses_with_router_args():
    """The router line of examples/launch/slurm_common.sh, its variables filled in as the script fills them."""
    from sglang_router.launch_router import parse_router_args

    script = (ROOT / "examples" / "launch" / "slurm_common.sh").read_text()
    line = " ".join(part.strip().rstrip("\\").strip() for part in
                    re.search(r'"\$PY" -m sglang_router\.launch_router(.*?)&\n', script, re.S).group(1).splitlines())
    values = {'"${worker_urls[@]}"': "http://n0:30001 http://n0:30002", '"$router_port"': "30000",
              '"$ROUTER_POLICY"': "cache_aware", '${ROUTER_API_KEY:+--api-key "$ROUTER_API_KEY"}': "--api-key k"}
    for name, value in values.items():
        assert name in line, name
        line = line.replace(name, value)
    args = parse_router_args(line.split())
    assert args.worker_urls == ["http://n0:30001", "http://n0:30002"] and args.policy == "cache_aware"
    assert args.port == 30000 and args.api_key == "k"


def _router_on(port: int, tries: int, env: dict) -> "subprocess.Popen":
    import subprocess
    import sys

    return subprocess.Popen(
        ["bash", str(ROOT / "examples" / "launch" / "retry_port_in_use.sh"), str(tries), str(port), sys.executable,
         "-m", "sglang_router.launch_router", "--worker-urls", "http://127.0.0.1:9", "--host", "127.0.0.1",
         "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)


def test_the_slurm_router_step_starts_again_on_its_port_once_the_port_is_free():
    """The real router exits at once on a port in use; the Slurm step's wrapper starts it again on the same port."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    import threading

    router = _router_on(port, 5, {**os.environ, "RETRY_WAIT_S": "2"})
    lines: list[str] = []
    first_try_failed = threading.Event()

    def read() -> None:
        for line in router.stdout:
            lines.append(line)
            if f"port {port} in use (try 1 of 5)" in line:
                first_try_failed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # the port is freed only once the first try has failed on it (0.6 s measured on a quiet box; a loaded one
        # can take several seconds just to start the router)
        assert first_try_failed.wait(120), "the first try never reported the held port"
        assert router.poll() is None
        holder.close()
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert router.poll() is None and time.time() < deadline, "the router never came up on its port"
                time.sleep(0.5)
    finally:
        holder.close()
        os.killpg(router.pid, signal.SIGKILL)  # the wrapper and the router it started
        router.wait(timeout=30)
        reader.join(timeout=30)
    out = "".join(lines)
    assert "Address already in use" in out and f"port {port} in use (try 1 of 5)" in out


def test_the_slurm_router_step_gives_up_on_a_port_that_stays_in_use():
    import os
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        router = _router_on(port, 2, {**os.environ, "RETRY_WAIT_S": "0"})
        out = router.communicate(timeout=60)[0]
    assert router.returncode != 0
    assert f"port {port} in use (try 1 of 2)" in out and f"port {port} still in use after 2 tries" in out
    assert "ROUTER_PORT" in out
