"""What the launchers start, and with which environment: `megatron-rl engines --dry-run` for the shipped configs (all
GPUs to the engines on a rollout-only node), torchrun's worker variables kept from every child (read from the
children's real /proc/<pid>/environ), and the launch scripts' environment (torchrun_node.sh, Slurm router key)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from megatron_rl import cli
from megatron_rl.config import load_config
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.processes import LAUNCHER_ENV_NAMES, EngineSpec, apply_env, env_changes, start_cluster
from megatron_rl.rollout.sglang_launcher import learner_local_gpus, trainer_local_gpus

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "examples" / "configs").glob("qwen3_*.yaml"))
SGLANG_FLAGS = set(json.loads((ROOT / "tests" / "fixtures" / "sglang_server_flags.json").read_text())["flags"])
# what torchrun exports to its workers (torch/distributed/elastic/agent/server/api.py and local_elastic_agent.py)
TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "16",
                "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_ERROR_FILE": "/tmp/err.json"}


def _is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_ENV_NAMES or name.startswith(("TORCHELASTIC_", "ROLE_"))


@pytest.fixture
def torchrun_env(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KEEP_ME", "yes")


def _dry_run(capsys, *args: str) -> list[dict]:
    assert cli.main(["engines", *args, "--dry-run"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.stem)
def test_dry_run_gives_every_gpu_to_the_engines(config, capsys, torchrun_env):
    """An 8-GPU rollout node, even when the command inherits torchrun variables: engines on GPUs 0-7, none kept."""
    cfg = load_config(config)
    lines = _dry_run(capsys, str(config), "--gpus", "8")
    engines = [ln for ln in lines if "sglang.launch_server" in ln["argv"]]
    routers = [ln for ln in lines if "sglang_router.launch_router" in ln["argv"]]
    assert len(engines) == cfg.rollout.num_engines and len(routers) == int(cfg.rollout.use_router)
    assert lines == engines + routers, "engines first, then the router"
    groups = [[int(d) for d in ln["env"]["CUDA_VISIBLE_DEVICES"].split(",")] for ln in engines]
    k = cfg.rollout.engine_tp_size * cfg.rollout.engine_dp_size
    assert all(len(g) == k for g in groups) and sorted(d for g in groups for d in g) == list(range(8))
    for ln in lines:
        removed = {n for n, v in ln["env"].items() if v is None}
        assert {n for n in TORCHRUN_ENV} <= removed, "every torchrun variable is removed"
        assert all(_is_launcher_variable(n) for n in removed) and "KEEP_ME" not in ln["env"]
    for ln in engines:
        argv = ln["argv"]
        assert argv[:3] == [cfg.rollout.sglang_executable, "-m", "sglang.launch_server"]
        assert {a for a in argv if a.startswith("--")} <= SGLANG_FLAGS
        assert argv[argv.index("--tp-size") + 1] == str(cfg.rollout.engine_tp_size)
    ports = [ln["argv"][ln["argv"].index("--port") + 1] for ln in engines]
    assert ports == [str(cfg.rollout.base_port + i) for i in range(len(engines))]
    if routers:
        workers = routers[0]["argv"][routers[0]["argv"].index("--worker-urls") + 1:routers[0]["argv"].index("--policy")]
        assert [u.rsplit(":", 1)[1] for u in workers] == ports


def test_dry_run_reports_what_does_not_fit(capsys):
    config = str(ROOT / "examples" / "configs" / "qwen3_8b_fp8_grpo.yaml")
    assert cli.main(["engines", config, "--dry-run", "--gpus", "4"]) == 2
    assert "rollout.num_engines=8" in capsys.readouterr().err
    assert cli.main(["engines", config, "--gpus", "8"]) == 2
    assert "--gpus applies to --dry-run" in capsys.readouterr().err


def test_dry_run_of_embedded_engines(capsys, tmp_path):
    lines = _dry_run(capsys, str(ROOT / "examples/configs/tiny_grpo.yaml"), f"run_dir={tmp_path}", "rollout.num_engines=2",
                     f"model.init_checkpoint={tmp_path / 'hf'}")
    assert [ln["argv"][1:3] for ln in lines] == [["-m", "megatron_rl.engine.server"]] * 2
    assert "CUDA_VISIBLE_DEVICES" not in lines[0]["env"] and not list(tmp_path.iterdir()), "nothing written"


def test_learner_gpus_on_this_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert learner_local_gpus() == 0, "outside torchrun no learner holds a GPU of this node"
    assert trainer_local_gpus() == 0, "a CPU trainer holds no GPU"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert learner_local_gpus() == 4 and trainer_local_gpus() == 4


def test_env_changes_remove_launcher_variables():
    base = {**TORCHRUN_ENV, "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "4,5"}
    changes = env_changes({"CUDA_VISIBLE_DEVICES": "5"}, base)
    assert apply_env(changes, base) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "5"}


PROBE = """# Stand-in engine / sglang-router: records its environment as its process sees it, answers /health and /workers.
import argparse, http.server, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--worker-urls", nargs="*", default=[])
args, _ = p.parse_known_args()
with open(os.path.join(os.environ["PROBE_DIR"], f"{args.port}.json"), "w") as f:
    json.dump(dict(os.environ), f)
body = json.dumps({"workers": [{"url": u, "is_healthy": True} for u in args.worker_urls]}).encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(body if self.path == "/workers" else b"{}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
"""


def test_children_never_see_launcher_variables(tmp_path, torchrun_env, monkeypatch):
    """Engines and the router started under torchrun's variables record the environment they really got.

    The processes are stand-ins (the real sglang-router renames its process, which overwrites what
    /proc/<pid>/environ shows), started through the launcher's own start_cluster: `python -m
    sglang_router.launch_router` resolves to the stand-in through PYTHONPATH, which children keep.
    """
    (tmp_path / "sglang_router").mkdir()
    (tmp_path / "sglang_router" / "__init__.py").write_text("")
    (tmp_path / "sglang_router" / "launch_router.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    specs = [EngineSpec(lambda port: [sys.executable, str(tmp_path / "sglang_router" / "launch_router.py"), "--port",
                                      str(port)], {"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(2)]
    cluster = start_cluster(specs, use_router=True, log_dir=str(tmp_path / "logs"), startup_timeout_s=60)
    try:
        procs = [(cluster.engines[0], "0"), (cluster.engines[1], "1"), (cluster.router, None)]
        assert "sglang_router.launch_router" in cluster.router.cmd
        for proc, devices in procs:
            env = json.loads((tmp_path / f"{proc.url.rsplit(':', 1)[1]}.json").read_text())
            assert not [n for n in env if _is_launcher_variable(n)], (proc.name, env)
            assert env["KEEP_ME"] == "yes" and env.get("CUDA_VISIBLE_DEVICES") == devices
    finally:
        cluster.stop()


def test_dp_engines_are_refused_with_weight_update_transports():
    for transport in ("distributed", "tensor"):
        with pytest.raises(ValidationError, match=rf"rollout.engine_dp_size=2 .*weight_sync.transport={transport}"):
            RolloutConfig(engine="sglang", engine_dp_size=2, weight_sync={"transport": transport})
    assert RolloutConfig(engine="sglang", engine_dp_size=2, weight_sync={"transport": "disk"}).engine_dp_size == 2


def test_torchrun_node_applies_overrides_and_honours_python(tmp_path):
    """NVTE_* come from the config as overridden on the command line, and $PYTHON runs everything."""
    record = tmp_path / "torchrun.txt"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m torch.distributed.run" ]; then\n'
                       f'  {{ echo "NVTE=${{NVTE_FP8_BLOCK_SCALING_FP32_SCALES:-unset}}"; echo "ARGS=$*"; }} > {record}; exit 0\n'
                       f'fi\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PYTHON=str(wrapper), PYTHONPATH=str(ROOT))
    env.pop("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", None)
    script = str(ROOT / "examples" / "launch" / "torchrun_node.sh")
    for overrides, expected in (([], "NVTE=1"), (["precision.power_of_two_scales=true"], "NVTE=unset")):
        proc = subprocess.run(["bash", script, str(SHIPPED[0]), *overrides], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = record.read_text().splitlines()
        assert lines[0] == expected and lines[1].endswith(" ".join(["train", str(SHIPPED[0]), *overrides]))
    proc = subprocess.run(["bash", script, str(SHIPPED[0]), "precision.no_such_field=1"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "error: " in proc.stderr and "precision.no_such_field" in proc.stderr


def test_slurm_router_key_is_assigned_not_exported(capsys):
    from megatron_rl.plan.launch import main

    assert main([str(SHIPPED[0]), "rollout.api_key=s3cret", "--gpus-per-node", "8", "--hosts", "a", "b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "ROUTER_API_KEY=s3cret" in out and "export ROUTER_API_KEY=s3cret" not in out
    script = (ROOT / "examples" / "launch" / "slurm_common.sh").read_text()
    router_line = next(ln for ln in script.splitlines() if "--policy \"$ROUTER_POLICY\"" in ln)
    assert '${ROUTER_API_KEY:+--api-key "$ROUTER_API_KEY"}' in router_line


def test_no_import_circle_between_the_launchers():
    """launcher.py imports sglang_launcher.py (its engine registry); neither reaches back: both use processes.py."""
    import ast

    def imports(name: str) -> set[str]:
        tree = ast.parse((ROOT / "megatron_rl" / "rollout" / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    assert "megatron_rl.rollout.launcher" not in imports("sglang_launcher")
    assert "megatron_rl.rollout.launcher" not in imports("processes")
    assert "megatron_rl.rollout.sglang_launcher" not in imports("processes")
