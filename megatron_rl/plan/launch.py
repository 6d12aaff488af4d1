"""Lay a planned run out on concrete Slurm hosts, as shell assignments the launch scripts `eval`.

    eval "$(python -m megatron_rl.plan.launch CONFIG [overrides] --gpus-per-node 8 --hosts $(scontrol show hostnames))"

Disaggregated: the first `engine_nodes` hosts run SGLang engines (filled with as many engines of
engine_tp_size x engine_dp_size GPUs as fit, in order) and the first of them also the sglang-router;
the other hosts run the learner. Colocated: every host runs both, engines split evenly. Engine k of a
host listens on ENGINE_BASE_PORT + k, the router on ROUTER_PORT. Printed variables: ENGINE_HOSTS,
ENGINE_COUNTS (engines per engine host), WORKER_URLS, ROUTER_URL, ROUTER_POLICY, LEARNER_HOSTS,
LEARNER_NNODES, MASTER_ADDR. Fails (exit 2, one line) when the layout does not fit: run `megatron-rl plan` for why.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional, Sequence


def assign(cfg, hosts: Sequence[str], gpus_per_node: int, gpu: str = "h100", router_port: int = 30000,
           engine_base_port: int = 30001) -> dict[str, str]:
    """The shell variables of the layout (see the module docstring); ValueError when it does not fit."""
    from megatron_rl.plan import make_plan

    plan = make_plan(cfg, len(hosts), gpus_per_node, gpu)
    if not plan.ok:
        raise ValueError(f"layout does not fit {len(hosts)} x {gpus_per_node} GPUs: {', '.join(plan.codes())} "
                         "(megatron-rl plan shows the details)")
    r, lay = cfg.rollout, plan.layout
    per_engine = r.engine_tp_size * r.engine_dp_size
    if r.placement == "colocated":
        engine_hosts, learner_hosts = list(hosts), list(hosts)
        base, extra = divmod(r.num_engines, len(hosts))
        counts = [base + (1 if i < extra else 0) for i in range(len(hosts))]
        if max(counts) * per_engine > gpus_per_node:
            raise ValueError(f"{max(counts)} engines of {per_engine} GPU(s) do not fit one {gpus_per_node}-GPU node")
    else:
        engine_hosts, learner_hosts = list(hosts[: lay.engine_nodes]), list(hosts[lay.engine_nodes:])
        fit, left, counts = gpus_per_node // per_engine, r.num_engines, []
        for _ in engine_hosts:
            counts.append(min(fit, left))
            left -= counts[-1]
    counts, engine_hosts = [c for c in counts if c > 0], [h for h, c in zip(engine_hosts, counts) if c > 0]
    urls = [f"http://{h}:{engine_base_port + k}" for h, c in zip(engine_hosts, counts) for k in range(c)]
    return {
        "ENGINE_HOSTS": " ".join(engine_hosts),
        "ENGINE_COUNTS": " ".join(map(str, counts)),
        "WORKER_URLS": " ".join(urls),
        "ROUTER_URL": f"http://{engine_hosts[0]}:{router_port}" if engine_hosts else "",
        "LEARNER_HOSTS": " ".join(learner_hosts),
        "LEARNER_NNODES": str(len(learner_hosts)),
        "MASTER_ADDR": learner_hosts[0] if learner_hosts else "",
        "ROUTER_POLICY": r.router_policy,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print `export NAME=value` lines for the launch scripts; 2 with a one-line error when the layout does not fit."""
    from megatron_rl.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="python -m megatron_rl.plan.launch", description=__doc__)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--hosts", nargs="+", required=True)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--router-port", type=int, default=30000)
    p.add_argument("--engine-base-port", type=int, default=30001)
    args = p.parse_intermixed_args(argv)
    try:
        values = assign(load_config(args.config, args.overrides), args.hosts, args.gpus_per_node, args.gpu,
                        args.router_port, args.engine_base_port)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, value in values.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
