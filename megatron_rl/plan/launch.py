"""Lay a planned run out on concrete Slurm hosts, as shell assignments the launch scripts `eval`.

    eval "$(python -m megatron_rl.plan.launch CONFIG [overrides] --gpus-per-node 8 --hosts $(scontrol show hostnames))"

Disaggregated: the first `--engine-nodes` hosts each run rollout.num_engines SGLang engines (as
`megatron-rl engines` starts them per node), the first of them also the one sglang-router in front of
all of them; the other hosts run the learner. Colocated (one host: `megatron-rl plan` refuses more, since the
tensor transport reaches engines on the controller's host only): the host runs both, and every URL names
127.0.0.1, the address the config's tensor-transport check accepts as this host. Engine k of a host
listens on ENGINE_BASE_PORT + k, the router on ROUTER_PORT. Printed variables: ENGINE_HOSTS,
ENGINES_PER_NODE, WORKER_URLS, ROUTER_URL, ROUTER_POLICY, LEARNER_HOSTS, LEARNER_NNODES, MASTER_ADDR, and
ROUTER_API_KEY (rollout.api_key, empty without one; assigned, not exported, so no other process inherits the key).
Fails (exit 2, one line) when the layout does not fit: run `megatron-rl plan` for why.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional, Sequence


def assign(cfg, hosts: Sequence[str], gpus_per_node: int, gpu: str = "h100", router_port: int = 30000,
           engine_base_port: int = 30001, engine_nodes: int = 1) -> dict[str, str]:
    """The shell variables of the layout (see the module docstring); ValueError when it does not fit."""
    from megatron_rl.plan import PlanOptions, make_plan

    plan = make_plan(cfg, len(hosts), gpus_per_node, gpu, PlanOptions(engine_nodes=engine_nodes))
    if not plan.ok:
        raise ValueError(f"layout does not fit {len(hosts)} x {gpus_per_node} GPUs: {', '.join(plan.codes())} "
                         "(megatron-rl plan shows the details)")
    r = cfg.rollout
    if r.placement == "colocated":
        engine_hosts, learner_hosts = list(hosts), list(hosts)
    else:
        engine_hosts, learner_hosts = list(hosts[:engine_nodes]), list(hosts[engine_nodes:])
    address = (lambda h: "127.0.0.1") if r.placement == "colocated" else (lambda h: h)
    urls = [f"http://{address(h)}:{engine_base_port + k}" for h in engine_hosts for k in range(r.num_engines)]
    return {
        "ENGINE_HOSTS": " ".join(engine_hosts),
        "ENGINES_PER_NODE": str(r.num_engines),
        "WORKER_URLS": " ".join(urls),
        "ROUTER_URL": f"http://{address(engine_hosts[0])}:{router_port}",
        "ROUTER_POLICY": r.router_policy,
        "LEARNER_HOSTS": " ".join(learner_hosts),
        "LEARNER_NNODES": str(len(learner_hosts)),
        "MASTER_ADDR": learner_hosts[0],
        "ROUTER_API_KEY": r.api_key or "",
    }


NOT_EXPORTED = ("ROUTER_API_KEY",)
"""Variables the scripts use themselves and no child should inherit."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print `export NAME=value` lines for the launch scripts; 2 with a one-line error when the layout does not fit."""
    from megatron_rl.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="python -m megatron_rl.plan.launch", description=__doc__)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--hosts", nargs="+", required=True)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--engine-nodes", type=int, default=1, help="disaggregated: hosts running engines (the first ones)")
    p.add_argument("--router-port", type=int, default=30000)
    p.add_argument("--engine-base-port", type=int, default=30001)
    args = p.parse_intermixed_args(argv)
    try:
        values = assign(load_config(args.config, args.overrides), args.hosts, args.gpus_per_node, args.gpu,
                        args.router_port, args.engine_base_port, args.engine_nodes)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, value in values.items():
        print(f"{'' if name in NOT_EXPORTED else 'export '}{name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
