"""The Slurm launch scripts, run on CPU with stub `srun`, `scontrol`, `sbatch` and `curl` executables on PATH that
record their arguments: `megatron-rl plan` runs first, engines + router start on the right nodes before the
learners, the learners get the router URL, a layout that does not fit stops before any step starts."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.plan.launch import assign

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "qwen3_8b_fp8_grpo.yaml"
STUB = """#!/usr/bin/env bash
if [ "$(basename "$0")" = curl ]; then
  # like real engines, /health answers only once the engine and router steps have started
  for _ in $(seq 600); do grep -q ' engines ' "$STUB_LOG" && grep -q launch_router "$STUB_LOG" && break; sleep 0.1; done
fi
# one append per call: background steps (engines, router) and curl write concurrently, and a line written in pieces
# could interleave with another call's under load (CI saw the engines call split by a curl call at load ~20)
line=$(basename "$0")
for a in "$@"; do line+=" $a"; done
printf '%s\\n' "$line" >> "$STUB_LOG"
if [ "$(basename "$0")" = scontrol ]; then for h in $STUB_HOSTS; do echo "$h"; done; fi
exit 0
"""


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "sbatch", "curl"):
        path = bin_dir / name
        path.write_text(STUB)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def run_script(script: str, stubs: Path, hosts: list[str], *args: str) -> tuple[int, list[str], str]:
    """Run an sbatch script as Slurm would inside the allocation; returns (rc, recorded calls, stderr)."""
    log = stubs.parent / "calls.log"
    log.write_text("")
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(log),
               STUB_HOSTS=" ".join(hosts), SLURM_JOB_NODELIST=f"node-[0-{len(hosts) - 1}]", SLURM_GPUS_ON_NODE="8",
               PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, [line for line in log.read_text().splitlines() if line], proc.stdout + proc.stderr


@pytest.mark.slow
def test_disaggregated_layout(stubs):
    hosts = ["node-0", "node-1"]
    rc, calls, out = run_script("slurm_disaggregated.sbatch", stubs, hosts, str(CONFIG))
    assert rc == 0, out
    assert "result: OK" in out, "megatron-rl plan ran and passed before anything started"
    assert calls[0] == "scontrol show hostnames node-[0-1]"
    engines = [c for c in calls if c.startswith("srun") and " engines " in c]
    router = [c for c in calls if "sglang_router.launch_router" in c]
    learners = [c for c in calls if "torchrun_node.sh" in c]
    health = [c for c in calls if c.startswith("curl")]
    assert len(engines) == 1 and "--nodelist=node-0" in engines[0] and "rollout.use_router=false" in engines[0]
    assert "rollout.base_port=30001" in engines[0] and "rollout.host=0.0.0.0" in engines[0]
    workers = [f"http://node-0:{30001 + k}" for k in range(8)]
    assert len(router) == 1 and "--nodelist=node-0" in router[0] and " ".join(workers) in router[0]
    assert len(health) == 9 and all(any(u in c for c in health) for u in workers + ["http://node-0:30000"])
    assert len(learners) == 1
    learner = learners[0]
    assert "--nodelist=node-1" in learner and "NNODES=1" in learner and "MASTER_ADDR=node-1" in learner
    assert "rollout.urls=[http://node-0:30000]" in learner and "rollout.engine=external" in learner
    started = max(calls.index(engines[0]), calls.index(router[0]))  # both background steps, in either order
    assert started < min(calls.index(h) for h in health) <= max(calls.index(h) for h in health) < calls.index(learner), \
        "engines and router, then health checks, then learners"


@pytest.mark.slow
def test_colocated_layout(stubs):
    rc, calls, out = run_script("slurm_colocated.sbatch", stubs, ["node-0"], str(CONFIG), "rollout.mem_fraction_static=0.3")
    assert rc == 0, out
    engines = [c for c in calls if c.startswith("srun") and " engines " in c]
    assert len(engines) == 1 and "--nodelist=node-0" in engines[0]
    assert "rollout.placement=colocated" in engines[0] and "rollout.weight_sync.transport=tensor" in engines[0]
    router = next(c for c in calls if "sglang_router.launch_router" in c)
    assert all(f"http://127.0.0.1:{30001 + k}" in router for k in range(8))
    learner = next(c for c in calls if "torchrun_node.sh" in c)
    assert "--nodelist=node-0" in learner and "NNODES=1" in learner and "--overlap" in learner
    assert "MASTER_ADDR=node-0" in learner and "rollout.urls=[http://127.0.0.1:30000]" in learner
    # the learner's overrides pass the config's checks (tensor transport to engines on this host)
    learner_overrides = learner.split(f" _ {CONFIG} ")[1].split()
    learner_cfg = load_config(CONFIG, learner_overrides)
    assert learner_cfg.rollout.weight_sync.transport == "tensor"
    # engine k (GPU k) is the k-th weight target: the learner ranks on its GPU feed it (rollout/colocation.py)
    assert learner_cfg.rollout.weight_update_urls == [f"http://127.0.0.1:{30001 + k}" for k in range(8)]
    # engines on other nodes cannot receive the learner's handles: refused by the plan before any step
    rc, calls, out = run_script("slurm_colocated.sbatch", stubs, ["node-0", "node-1"], str(CONFIG),
                                "rollout.mem_fraction_static=0.3")
    assert rc == 2 and "colocated-multi-node" in out and not [c for c in calls if c.startswith("srun")]


@pytest.mark.slow
def test_a_layout_that_does_not_fit_stops_before_any_step(stubs):
    rc, calls, out = run_script("slurm_disaggregated.sbatch", stubs, ["node-0"], str(CONFIG))
    assert rc == 2 and "no-gpus-for-learner" in out
    assert not [c for c in calls if c.startswith("srun")]


@pytest.mark.slow
def test_sweep_jobs_submit_through_sbatch(stubs, tmp_path):
    sweep = [sys.executable, str(ROOT / "tools" / "scaling_sweep.py"), str(CONFIG), "--nodes", "2", "3",
             "--layouts", "tp2", "--precisions", "fp8", "--out", str(tmp_path / "sweep")]
    subprocess.run(sweep, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, timeout=300)
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(log))
    subprocess.run(["bash", str(tmp_path / "sweep" / "submit_all.sh")], check=True, env=env, timeout=60)
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("sbatch ") and c.endswith(".sbatch") for c in calls)


def test_host_assignment_per_engine_node():
    cfg = load_config(CONFIG, ["rollout.num_engines=4", "rollout.engine_tp_size=2"])
    values = assign(cfg, ["a", "b", "c"], 8, engine_nodes=2)
    assert values["ENGINE_HOSTS"] == "a b" and values["ENGINES_PER_NODE"] == "4" and values["LEARNER_HOSTS"] == "c"
    assert values["WORKER_URLS"].split() == [f"http://{h}:{30001 + k}" for h in "ab" for k in range(4)]
    assert values["ROUTER_URL"] == "http://a:30000" and values["MASTER_ADDR"] == "c"
    with pytest.raises(ValueError, match="no-gpus-for-learner"):
        assign(cfg, ["a", "b"], 8, engine_nodes=2)
