"""Launcher: engine subprocesses on loopback, the real sglang-router in front, failure reporting."""
import importlib.util
import json
import urllib.request

import pytest
import torch

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.launcher import LaunchError, engine_command, launch_engines, router_command
from megatron_rl.rollout.sync import DiskWeightSync
from megatron_rl.engine.testing import make_tiny_model, teacher_forced_logprobs

torch.set_num_threads(1)


def test_commands():
    cmd = engine_command("/m", 1234, tokenizer_path="/t", random_seed=3, model_loader="pkg.mod:fn")
    assert cmd[1:3] == ["-m", "megatron_rl.engine.server"]
    for flag, value in [("--model-path", "/m"), ("--port", "1234"), ("--tokenizer-path", "/t"),
                        ("--random-seed", "3"), ("--model-loader", "pkg.mod:fn"), ("--host", "127.0.0.1")]:
        assert cmd[cmd.index(flag) + 1] == value
    r = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], 99)
    assert r[r.index("--worker-urls") + 1: r.index("--worker-urls") + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert r[r.index("--policy") + 1] == "round_robin" and r[r.index("--port") + 1] == "99"
    with pytest.raises(ValueError, match="policy"):
        router_command(["http://x"], 1, policy="best")


def test_router_flags_exist_in_installed_package():
    pytest.importorskip("sglang_router")
    from sglang_router.router_args import RouterArgs
    import argparse

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    known = {s for a in parser._actions for s in a.option_strings}
    cmd = router_command(["http://127.0.0.1:1"], 5)
    assert {c for c in cmd if c.startswith("--")} <= known


def test_engine_that_dies_reports_its_log(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch_engines(str(tmp_path / "no_model"), 1, startup_timeout_s=60, log_dir=str(tmp_path / "logs"))
    msg = str(info.value)
    assert "engine 0" in msg and "exited with code 1" in msg and "no_model" in msg


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="needs sglang-router")
def test_router_in_front_of_two_engines(tmp_path):
    model = make_tiny_model(str(tmp_path / "m"), seed=0)
    new = make_tiny_model(str(tmp_path / "new"), seed=9)
    with launch_engines(str(tmp_path / "m"), 2, use_router=True, startup_timeout_s=120,
                        log_dir=str(tmp_path / "logs")) as cluster:
        assert cluster.router is not None and len(cluster.worker_urls) == 2
        client = RolloutClient(cluster.generate_url, concurrency=4)
        prompts = [[3, 4], [5, 6, 7], [8], [9, 10]]
        groups = client.generate_batch_sync(prompts, {"max_new_tokens": 4, "n": 2, "temperature": 1.0})
        for p, g in zip(prompts, groups):
            assert len(g) == 2
            for r in g:
                ref = teacher_forced_logprobs(model, p, r.output_ids)
                assert torch.allclose(torch.tensor(r.logprobs), ref.gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0], atol=1e-4)
        with urllib.request.urlopen(cluster.router.url + "/workers", timeout=10) as resp:
            workers = json.loads(resp.read())["workers"]
        assert sorted(w["url"] for w in workers) == sorted(cluster.worker_urls)
        # weight sync goes to the workers; generation through the router then sees the new version
        DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "m"), cluster.worker_urls).push(new.state_dict(), 1)
        outs = client.generate_batch_sync([[3, 4]] * 4, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        for g in outs:
            assert g[0].weight_version == "1"
            assert g[0].output_ids == teacher_forced_logprobs(new, [3, 4], g[0].output_ids).argmax(-1).tolist()
    for proc in cluster.engines + [cluster.router]:
        assert proc.proc.poll() is not None  # everything stopped
    # the router's HTTP/2 protocol probe of each worker is not an error (engine/http.py)
    for log in sorted((tmp_path / "logs").glob("engine_*.log")):
        assert not [line for line in log.read_text().splitlines() if " ERROR " in line or "Traceback" in line], log


def test_launch_from_config_rejects_external():
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.launcher import launch_from_config

    with pytest.raises(ValueError, match="rollout.engine='external'"):
        launch_from_config(RolloutConfig(engine="external", urls=["http://127.0.0.1:1"]), "/m")


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="needs sglang-router")
@pytest.mark.parametrize("fixed_serving_port", [False, True], ids=["probed_port", "fixed_port"])
def test_router_whose_metrics_port_was_taken_starts_again(tmp_path, monkeypatch, fixed_serving_port):
    """Another process takes the probed metrics port before the router binds it (the xdist race that panicked the
    real router): the start is retried with a fresh metrics port on the same serving port, fixed or probed."""
    import socket

    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.rollout import processes

    make_tiny_model(str(tmp_path / "m"))
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_free_port = processes.free_port
    handed = []

    def free_port_that_first_hands_out_a_taken_metrics_port(host="127.0.0.1"):
        # router_command asks for the metrics port last, after plan_router's serving port (when that is probed)
        handed.append(taken if not any(p == taken for p in handed) and len(handed) == (0 if fixed_serving_port else 1)
                      else real_free_port(host))
        return handed[-1]

    monkeypatch.setattr(processes, "free_port", free_port_that_first_hands_out_a_taken_metrics_port)
    serving = real_free_port() if fixed_serving_port else 0
    try:
        with ThreadedServer(str(tmp_path / "m")) as engine:
            router = processes.start_router([engine.url], port=serving, log_dir=str(tmp_path), startup_timeout_s=60)
            try:
                first = open(router.log_path, errors="replace").read(router.log_start)
                assert processes.METRICS_PORT_TAKEN.search(first), first[-2000:]
                argv = router.cmd
                assert int(argv[argv.index("--prometheus-port") + 1]) != taken
                if fixed_serving_port:
                    assert router.url.endswith(f":{serving}")
                assert RolloutClient(router.url).generate_batch_sync([[3, 4]], {"max_new_tokens": 2})[0]
            finally:
                router.stop()
    finally:
        squatter.close()
    assert taken in handed
