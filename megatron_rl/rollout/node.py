"""`megatron-rl engines CONFIG [overrides]`: start this node's rollout engines (+ router), print their URLs, block until killed.

    megatron-rl engines examples/configs/qwen3_8b_fp8_grpo.yaml rollout.engine=sglang rollout.host=0.0.0.0

rollout.engine embedded or sglang says which engines start; a trainer config saying external (the
example GPU configs) starts SGLang engines. Prints one line per process once everything is healthy,
then `ready`:

    engine http://node12:30000
    engine http://node12:30001
    router http://node12:30002
    ready

(`--urls-file PATH` also writes {"generate": [...], "workers": [...]} as JSON.)

`--dry-run [--gpus N]` starts nothing and writes nothing: it prints one JSON line per process the
command would start, engines first, then the router:

    {"argv": ["/opt/sglang/bin/python", "-m", "sglang.launch_server", ...], "env": {"RANK": null, ..., "CUDA_VISIBLE_DEVICES": "0"}}

`argv` is the exact command line (an embedded engine on a free port says `--port 0 --port-file F`: it
binds a port the OS picks and writes it to F, so a router line names its workers at port 0); `env` holds the changes to this command's own environment, a
string for a variable set, null for one removed (torchrun's worker variables, rollout/processes.py).
`--gpus N` is the node's GPU count (default: the CUDA devices this process sees), so a login node
without GPUs can show an 8-GPU node's layout. No GPU is kept for a learner here: this command is no
torchrun worker (a LOCAL_WORLD_SIZE in its environment describes some other launch), so the engines
take the node's devices from 0 on, or those rollout.engine_gpus names when learners share the node. The trainer then
uses rollout.engine=external with rollout.urls = the router (or the engines) and, without a
router, rollout.weight_update_urls left empty. An engine that dies is reported on stderr and not
restarted here: a restarted engine would serve the start checkpoint's weights to the router before
the trainer's next sync. The router retries its requests on the others and the trainer drops it from
the weight-sync targets. The command exits 1 when the router or every engine is gone; SIGTERM or
SIGINT stops everything (process groups, no orphans) and exits 0.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

POLL_S = 2.0
"""How often the engines' processes are checked while serving."""


def model_dir(cfg, model_path: Optional[str], must_exist: bool = True) -> str:
    """The HF directory engines start from: --model-path, else model.init_checkpoint (ValueError naming both)."""
    path = model_path or cfg.model.init_checkpoint
    if not path or (must_exist and not os.path.isfile(os.path.join(path, "config.json"))):
        raise ValueError(f"engines need an HF model directory (config.json + safetensors): pass --model-path or set "
                         f"model.init_checkpoint to one (got {path!r})")
    return path


def node_rollout_config(rollout):
    """The rollout section as this node's launcher reads it: a trainer config saying engine=external
    (it reaches the engines at rollout.urls) starts SGLang engines here; urls are the trainer's business."""
    engine = rollout.engine if rollout.engine in ("embedded", "sglang") else "sglang"
    return rollout.model_copy(update={"engine": engine, "urls": [], "weight_update_urls": []})


def node_log_dir(cfg) -> str:
    """Where this node's engines log (and the embedded engines write their port files)."""
    return str(Path(cfg.run_dir) / "logs" / f"engines_{socket.gethostname()}")


def dry_run(cfg, model_path: Optional[str] = None, gpus: Optional[int] = None) -> list[dict]:
    """{"argv", "env"} of every process `serve_engines` would start (engines, then the router); starts nothing."""
    from megatron_rl.rollout.launcher import plan_from_config

    r = node_rollout_config(cfg.rollout)
    path = model_dir(cfg, model_path, must_exist=False)
    plan = plan_from_config(r, path, tokenizer_path=cfg.data.tokenizer_dir or path, precision=cfg.precision,
                            launch_dir=str(Path(cfg.run_dir) / "weights"), visible_gpus=gpus, learner_gpus=0,
                            log_dir=node_log_dir(cfg))
    return [p.to_json() for p in plan.processes]


def serve_engines(cfg, model_path: Optional[str] = None, urls_file: Optional[str] = None,
                  max_wait_s: Optional[float] = None) -> int:
    """Start this node's engines for `cfg`, print their URLs, keep them alive until SIGTERM/SIGINT; returns the exit code."""
    from megatron_rl.rollout.launcher import launch_from_config

    r = node_rollout_config(cfg.rollout)
    path = model_dir(cfg, model_path)
    log_dir = node_log_dir(cfg)
    cluster = launch_from_config(r, path, tokenizer_path=cfg.data.tokenizer_dir or path, log_dir=log_dir,
                                 precision=cfg.precision, launch_dir=str(Path(cfg.run_dir) / "weights"), learner_gpus=0)
    stop = {"signal": None}

    def on_signal(signum, frame) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for e in cluster.engines:
            print(f"engine {e.url}", flush=True)
        if cluster.router is not None:
            print(f"router {cluster.router.url}", flush=True)
        if urls_file:
            Path(urls_file).write_text(json.dumps({"generate": cluster.generate_urls, "workers": cluster.worker_urls}))
        print("ready", flush=True)
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        reported: set[str] = set()
        while stop["signal"] is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(POLL_S)
            if cluster.router is not None and cluster.router.proc.poll() is not None:
                print(f"error: router exited with code {cluster.router.proc.returncode}; log tail:\n"
                      f"{cluster.router.log_tail()}", file=sys.stderr, flush=True)
                return 1
            for e in cluster.engines:
                if e.proc.poll() is not None and e.url not in reported:
                    reported.add(e.url)
                    print(f"warning: {e.name} ({e.url}) exited with code {e.proc.returncode}; log tail:\n{e.log_tail()}",
                          file=sys.stderr, flush=True)
            if len(reported) == len(cluster.engines):
                print("error: every engine exited", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
