"""No port race: a port probed free and bound later can be taken in between by another process.

Each test holds the port a probe returns (the probe is monkeypatched to hand out a port this test keeps
listening on) and the start still succeeds: the embedded engine binds port 0 itself and reports its port
(`--port-file`), a stand-in for an SGLang engine and the real sglang-router are started again on a fresh port
when theirs was taken (rollout/processes.py), the `distributed` weight sync serves its rendezvous on a socket
it bound before telling the engines its port, and a learner's world of one probes no port at all.

Run: pytest -q tests/test_port_races.py
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

from megatron_rl.rollout import processes
from megatron_rl.rollout.launcher import EngineSpec, LaunchError, launch_engines, start_cluster

torch.set_num_threads(1)


@pytest.fixture
def held_port():
    """A port this test keeps bound and listening: what another process grabbing a probed port looks like."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def probe_returning(monkeypatch, *ports):
    """Make the launcher's probe return `ports` in turn (None: a real free port), then real free ports."""
    real, queue = processes.free_port, list(ports)

    def probe(host: str = "127.0.0.1") -> int:
        port = queue.pop(0) if queue else None
        return real(host) if port is None else port

    monkeypatch.setattr(processes, "free_port", probe)
    return queue


def get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_rl.engine.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ports")
    make_tiny_model(str(root / "m"))
    return str(root / "m")


def test_embedded_engine_binds_its_own_port(model, tmp_path, monkeypatch, held_port):
    probe_returning(monkeypatch, *[held_port] * 5)
    with launch_engines(model, 1, log_dir=str(tmp_path), engine_args=["--weight-update-timeout-s", "30"]) as cluster:
        engine = cluster.engines[0]
        port = int(engine.url.rsplit(":", 1)[1])
        assert port != held_port and get(engine.url, "/server_info")["port"] == port
        assert (tmp_path / "engine_0.port").read_text().strip() == str(port)
        # a restart binds the port it reported (the URL the router and the weight sync know stays valid)
        assert engine.cmd[engine.cmd.index("--port") + 1] == str(port) and "--port-file" not in engine.cmd
        cluster.restart_engine(engine.url)
        assert engine.restarts == 1
        assert get(engine.url, "/server_info")["port"] == port
        _distributed_sync_without_a_probe(engine.url, model, monkeypatch, held_port)


def _distributed_sync_without_a_probe(url, model, monkeypatch, held_port):
    """The sender hosts its group on its own listening socket: a probe handing out a taken port is never asked."""
    from megatron_rl.parallel import weight_group
    from megatron_rl.rollout.sync import DistributedWeightSync

    monkeypatch.setattr(weight_group, "free_port", lambda host="127.0.0.1": held_port)
    name = "model.norm.weight"
    before = torch.tensor(get_weights(url, name))
    new = before + 0.5
    transport = DistributedWeightSync([url], timeout_s=30)
    try:
        transport.begin("v-ports")
        transport.begin_stage(0, 1, "v-ports")
        transport.send_bucket([(name, new)], final=True)
        transport.end_stage()
        transport.commit("v-ports")
        transport.finish()
        assert transport.group is not None
    finally:
        transport.close()
    assert torch.equal(torch.tensor(get_weights(url, name)), new)


def get_weights(url, name):
    req = urllib.request.Request(url + "/get_weights_by_name", data=json.dumps({"name": name}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


STAND_IN = """# Stand-in SGLang engine: binds --port itself (as uvicorn does, late) and answers every GET with {}.
import argparse, http.server
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); a, _ = p.parse_known_args()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
"""


def stand_in_spec(tmp_path) -> EngineSpec:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return EngineSpec(lambda port: [sys.executable, str(script), "--port", str(port)])


def test_engine_on_a_taken_probed_port_starts_again_on_a_fresh_one(tmp_path, monkeypatch, held_port):
    probe_returning(monkeypatch, held_port)
    with start_cluster([stand_in_spec(tmp_path)], log_dir=str(tmp_path), startup_timeout_s=30) as cluster:
        engine = cluster.engines[0]
        port = int(engine.url.rsplit(":", 1)[1])
        assert port != held_port and get(engine.url, "/health") == {}
        assert engine.cmd[-1] == str(port), "a restart keeps the port that worked"
        log = (tmp_path / "engine_0.log").read_text()
        assert "Address already in use" in log and "Address already in use" not in engine.start_output()


def test_a_port_taken_every_time_is_reported_after_the_bounded_retries(tmp_path, monkeypatch, held_port):
    probe_returning(monkeypatch, *[held_port] * (processes.PORT_ATTEMPTS + 2))
    with pytest.raises(LaunchError, match=f"taken before it could bind it in {processes.PORT_ATTEMPTS} starts"):
        start_cluster([stand_in_spec(tmp_path)], log_dir=str(tmp_path), startup_timeout_s=30)
    log = (tmp_path / "engine_0.log").read_text()
    assert log.count("Address already in use") == processes.PORT_ATTEMPTS


def test_a_start_that_fails_otherwise_is_not_retried(tmp_path, monkeypatch):
    script = tmp_path / "dies.py"
    script.write_text("import sys; print('model not found'); sys.exit(3)\n")
    probe_returning(monkeypatch)
    with pytest.raises(LaunchError, match="exited with code 3"):
        start_cluster([EngineSpec(lambda port: [sys.executable, str(script), "--port", str(port)])],
                      log_dir=str(tmp_path), startup_timeout_s=30)
    assert (tmp_path / "engine_0.log").read_text().count("model not found") == 1, "started once"


needs_router = pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import sglang_router"]).returncode != 0,
                                  reason="sglang-router is not installed")


@needs_router
def test_router_on_a_taken_probed_port_starts_again(tmp_path, monkeypatch, held_port):
    # probes: the engine's port (taken), its fresh one, then the router's port (taken) and its metrics port
    probe_returning(monkeypatch, held_port, None, held_port)
    with start_cluster([stand_in_spec(tmp_path)], use_router=True, log_dir=str(tmp_path), startup_timeout_s=60) as cluster:
        port = int(cluster.router.url.rsplit(":", 1)[1])
        assert port != held_port
        assert "Address already in use" in (tmp_path / "router.log").read_text()
        from megatron_rl.rollout.topology import router_workers

        assert router_workers(cluster.router.url) == cluster.worker_urls


def test_world_of_one_probes_no_port(tmp_path):
    """init_distributed without torchrun: the store binds port 0 itself; no Python-level probe bind happens."""
    script = """
import socket, torch, torch.distributed as dist
binds = []
real = socket.socket.bind
def bind(self, address):
    binds.append(address)
    return real(self, address)
socket.socket.bind = bind
from megatron_rl.config.model import ParallelConfig
from megatron_rl.parallel import state
state.init_distributed(ParallelConfig(), seed=1)
t = torch.ones(2)
dist.all_reduce(t)
assert dist.get_world_size() == 1 and t.tolist() == [1.0, 1.0]
state.destroy_distributed()
print("binds", binds)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "binds []"


def test_what_counts_as_a_taken_port():
    """The texts uvicorn / Python, sglang-router (Rust) and SGLang's own port wait print; nothing else retries."""
    assert processes.port_taken("ERROR: [Errno 98] error while attempting to bind on address ('0.0.0.0', 30000): "
                                "address already in use")
    assert processes.port_taken("RuntimeError: Address already in use (os error 98)")
    assert processes.port_taken("ValueError: port at 30001 is not available in 30 seconds.")
    assert not processes.port_taken("FP8 DeepGEMM is not available in this build; CUDA out of memory")


def test_a_fixed_port_in_use_is_tried_again_then_reported_naming_the_fields(tmp_path, monkeypatch, held_port):
    monkeypatch.setattr(processes, "FIXED_PORT_RETRY_S", 0.05)
    with pytest.raises(LaunchError, match=f"port {held_port} on 127.0.0.1 stayed in use .*rollout.base_port") as err:
        start_cluster([stand_in_spec(tmp_path)], base_port=held_port, log_dir=str(tmp_path), startup_timeout_s=30)
    assert "\n" not in str(err.value)
    assert (tmp_path / "engine_0.log").read_text().count("Address already in use") == processes.PORT_ATTEMPTS


def test_a_fixed_port_freed_meanwhile_is_served_as_given(tmp_path, monkeypatch):
    """A previous job's engine still holding the port: the start is tried again on the same port once it is free."""
    import threading
    import time

    monkeypatch.setattr(processes, "FIXED_PORT_RETRY_S", 0.5)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    log = tmp_path / "engine_0.log"

    def free_after_first_refusal():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (log.exists() and "Address already in use" in log.read_text()):
            time.sleep(0.02)
        holder.close()

    closer = threading.Thread(target=free_after_first_refusal)
    closer.start()
    try:
        with start_cluster([stand_in_spec(tmp_path)], base_port=port, log_dir=str(tmp_path), startup_timeout_s=30) as c:
            assert c.engines[0].url.endswith(f":{port}") and get(c.engines[0].url, "/health") == {}
    finally:
        closer.join()
        holder.close()
    assert log.read_text().count("Address already in use") == 1


FOREIGN = """# Another server that took the port first: healthy, but not the engine that was launched.
import http.server, json, sys
port = int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"model_path": "/someone/elses", "port": port, "random_seed": 0}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_health_from_a_process_that_took_the_port_is_not_the_engines(tmp_path):
    """wait_healthy checks /server_info names the launch (model path, port, seed): the engine below never binds, and
    the foreign server's answers must not make it healthy."""
    (tmp_path / "foreign.py").write_text(FOREIGN)
    port = processes.free_port()
    foreign = subprocess.Popen([sys.executable, str(tmp_path / "foreign.py"), str(port)])
    try:
        for _ in range(200):
            try:
                get(f"http://127.0.0.1:{port}", "/health")
                break
            except OSError:
                import time

                time.sleep(0.05)
        slow = EngineSpec(lambda p: [sys.executable, "-c", "import time; time.sleep(60)", "--model-path", "/m",
                                     "--port", str(p), "--random-seed", "0"])
        with pytest.raises(LaunchError, match=r"another process answers on .*'/someone/elses'.*'/m'"):
            start_cluster([slow], base_port=port, log_dir=str(tmp_path), startup_timeout_s=3)
    finally:
        foreign.kill()
        foreign.wait()
    assert processes.launch_identity(["x", "--model-path", "/m", "--port", "0"], "http://h:31234") == {
        "model_path": "/m", "port": 31234}
    assert processes.launch_identity(["router", "--port", "1"], "http://h:1") == {}
