"""Start rollout engines (embedded CPU servers or real SGLang servers) and optionally the real sglang-router.

    with launch_engines(model_path, num_engines=2, use_router=True) as cluster:
        client = RolloutClient(cluster.generate_url)     # the router when there is one
        sync_targets = cluster.worker_urls                # weight updates go to every worker

The router forwards /generate but not weight updates, so weight sync always addresses
`worker_urls`. Embedded engines run `sys.executable -m megatron_rl.engine.server ...`; SGLang
engines run `sglang.launch_server` (rollout/sglang_launcher.py builds those command lines).
`launch_from_config` starts what a RolloutConfig asks for, `plan_from_config` says what it would
start without starting it (`megatron-rl engines --dry-run`). Process management (start, health,
environment, no orphans) is rollout/processes.py's; its names are re-exported here. Embedded
engines also watch their parent pid.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator, Optional, Sequence

from megatron_rl.rollout import sglang_launcher
from megatron_rl.rollout.processes import (  # noqa: F401  (re-exported: the launcher's public names)
    ROUTER_POLICIES, ClusterPlan, EngineSpec, LaunchError, ManagedProcess, PlannedProcess, RolloutCluster, _spawn,
    free_port, plan_cluster, plan_router, public_host, router_command, start_cluster, start_router,
    wait_healthy, wait_router,
)


def engine_command(model_path: str, port: int, host: str = "127.0.0.1", tokenizer_path: Optional[str] = None,
                   random_seed: int = 0, model_loader: Optional[str] = None, num_threads: int = 1,
                   extra_args: Sequence[str] = (), deterministic: bool = False,
                   parent_pid: Optional[int] = None, kv_cache_dtype: str = "auto", api_key: Optional[str] = None,
                   max_n: Optional[int] = None) -> list[str]:
    """argv of one embedded engine (with `parent_pid` it exits when that process dies; with `api_key`
    it requires that bearer key; `max_n` raises its limit on samples per prompt)."""
    cmd = [sys.executable, "-m", "megatron_rl.engine.server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--random-seed", str(random_seed), "--num-threads", str(num_threads)]
    if tokenizer_path:
        cmd += ["--tokenizer-path", tokenizer_path]
    if model_loader:
        cmd += ["--model-loader", model_loader]
    if deterministic:
        cmd += ["--enable-deterministic-inference"]
    if kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    if api_key:
        cmd += ["--api-key", api_key]
    if max_n:
        cmd += ["--max-n", str(max_n)]
    return cmd + list(extra_args)


def engine_max_n(n_samples_per_prompt: int) -> Optional[int]:
    """The --max-n an embedded engine needs for GRPO groups of this size (None: the server's default suffices)."""
    from megatron_rl.engine.validation import DEFAULT_MAX_N

    return n_samples_per_prompt if n_samples_per_prompt > DEFAULT_MAX_N else None


def embedded_specs(model_path: str, num_engines: int = 1, *, tokenizer_path: Optional[str] = None,
                   host: str = "127.0.0.1", random_seed: int = 0, model_loader: Optional[str] = None,
                   num_threads: int = 1, engine_args: Sequence[str] = (), deterministic: bool = False,
                   kv_cache_dtype: str = "auto", api_key: Optional[str] = None,
                   max_n: Optional[int] = None,
                   visible_devices: Optional[Sequence[Sequence[str]]] = None) -> list[EngineSpec]:
    """How to start each of `num_engines` embedded engines (engine i seeded random_seed + i, watching this process;
    with `visible_devices`, engine i sees only the devices visible_devices[i]: --visible-devices)."""
    if num_engines < 1:
        raise ValueError("num_engines must be >= 1")
    if visible_devices is not None and len(visible_devices) != num_engines:
        raise ValueError(f"visible_devices lists {len(visible_devices)} engines, not {num_engines}")
    parent = os.getpid()

    def spec(i: int) -> EngineSpec:
        args = list(engine_args) + (["--visible-devices", ",".join(visible_devices[i])] if visible_devices else [])
        # the engine binds the port it serves on (port 0 + --port-file; rollout/processes.py), so no probe can race it
        return EngineSpec(lambda port: engine_command(model_path, port, host, tokenizer_path, random_seed + i, model_loader,
                                                      num_threads, args, deterministic=deterministic,
                                                      parent_pid=parent, kv_cache_dtype=kv_cache_dtype,
                                                      api_key=api_key, max_n=max_n), port_file_flag="--port-file")

    return [spec(i) for i in range(num_engines)]


def launch_engines(model_path: str, num_engines: int = 1, *, tokenizer_path: Optional[str] = None,
                   host: str = "127.0.0.1", base_port: int = 0, random_seed: int = 0,
                   model_loader: Optional[str] = None, num_threads: int = 1, use_router: bool = False,
                   router_policy: str = "round_robin", startup_timeout_s: float = 120.0,
                   log_dir: Optional[str] = None, engine_args: Sequence[str] = (),
                   router_args: Sequence[str] = (), deterministic: bool = False,
                   kv_cache_dtype: str = "auto", api_key: Optional[str] = None,
                   max_n: Optional[int] = None) -> RolloutCluster:
    """Start `num_engines` embedded engines (engine i seeded random_seed + i), wait for /health, optionally start the router.

    `model_loader` is a 'package.module:function' path handed to each server. Engines exit on
    their own when this process dies (even by SIGKILL), so none is left orphaned.
    `deterministic` makes each engine generate requests one at a time (batch-invariant samples);
    `kv_cache_dtype="fp8_e4m3"` emulates SGLang's FP8 KV cache. `api_key` is required by every
    engine (their /health stays open) and by the router; `max_n` raises the engines' limit on
    sampling_params.n for large GRPO groups.
    """
    specs = embedded_specs(model_path, num_engines, tokenizer_path=tokenizer_path, host=host, random_seed=random_seed,
                           model_loader=model_loader, num_threads=num_threads, engine_args=engine_args,
                           deterministic=deterministic, kv_cache_dtype=kv_cache_dtype, api_key=api_key, max_n=max_n)
    return start_cluster(specs, host=host, base_port=base_port, use_router=use_router,
                         router_policy=router_policy, startup_timeout_s=startup_timeout_s, log_dir=log_dir,
                         router_args=router_args, api_key=api_key)


def _embedded_config_specs(cfg, precision, launch_path: str, tokenizer_path: Optional[str] = None,
                           model_loader: Optional[str] = None, num_threads: int = 1, **_gpus) -> list[EngineSpec]:
    """rollout.engine=embedded: CPU engines speaking the SGLang protocol, started from the rollout-format checkpoint
    (an engine keeps the format it starts in: weight updates are checked against it). Colocated engines see only
    their own device, as SGLang's do (rollout/colocation.py names it)."""
    visible = None
    if cfg.placement == "colocated":
        from megatron_rl.rollout.colocation import device_identity, engine_device_groups

        visible = [[device_identity(i) for i in group] for group in engine_device_groups(cfg)]
    return embedded_specs(launch_path, cfg.num_engines, tokenizer_path=tokenizer_path, host=cfg.host,
                          visible_devices=visible,
                          random_seed=cfg.seed, model_loader=model_loader, num_threads=num_threads,
                          deterministic=cfg.deterministic_inference, kv_cache_dtype=precision.kv_cache_dtype,
                          api_key=cfg.api_key, max_n=engine_max_n(cfg.n_samples_per_prompt),
                          engine_args=["--weight-update-timeout-s", str(cfg.weight_sync.timeout_s)]
                          # colocated: released weights come back on resume, as SGLang's flag of the same name does
                          + (["--enable-weights-cpu-backup"] if cfg.placement == "colocated" else []))


def _sglang_config_specs(cfg, precision, launch_path: str, tokenizer_path: Optional[str] = None,
                         model_loader: Optional[str] = None, num_threads: int = 1, visible_gpus: Optional[int] = None,
                         learner_gpus: Optional[int] = None) -> list[EngineSpec]:
    """rollout.engine=sglang: real SGLang servers on this node's free GPUs (rollout/sglang_launcher.py)."""
    if model_loader is not None:
        raise ValueError("model_loader applies to embedded engines only")
    return sglang_launcher.sglang_specs(cfg, precision, launch_path, sglang_launcher.node_gpu_groups(cfg, visible_gpus, learner_gpus))


ENGINE_SPECS: dict[str, Callable[..., list[EngineSpec]]] = {"embedded": _embedded_config_specs, "sglang": _sglang_config_specs}
"""rollout.engine value -> how to start each engine of that kind (external engines are not started here)."""


def _engine_kind(cfg) -> Callable[..., list[EngineSpec]]:
    if cfg.engine not in ENGINE_SPECS:
        raise ValueError(f"rollout.engine={cfg.engine!r}: engines of this kind are not started here; "
                         "external servers are reached through rollout.urls")
    return ENGINE_SPECS[cfg.engine]


def _precision(precision):
    if precision is None:
        from megatron_rl.config.precision import PrecisionConfig

        precision = PrecisionConfig()
    return precision


def planned_launch_path(model_path: str, precision, launch_dir: str) -> str:
    """The directory engines will start from (as `write_launch_checkpoint` returns it), writing nothing; a model
    directory that is not readable here is taken to be a high-precision source."""
    from megatron_rl.precision.rollout_formats import read_config, rollout_format

    fmt = rollout_format(precision)
    try:
        config = read_config(model_path)
    except (OSError, ValueError):
        config = {}
    if fmt.quantization_config is None or fmt.matches(config):
        return model_path
    return os.path.join(launch_dir, f"launch_{fmt.name}")


def _launch_embedded(cfg, precision, model_path: str, tokenizer_path: Optional[str], log_dir: Optional[str],
                     model_loader: Optional[str] = None, num_threads: int = 1, launch_dir: Optional[str] = None,
                     **_gpus) -> RolloutCluster:
    """rollout.engine=embedded: write the rollout-format checkpoint, start the engines (+ router)."""
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint

    launch_path = write_launch_checkpoint(model_path, precision, launch_dir or os.path.join(log_dir or ".", "launch"))
    return start_cluster(_embedded_config_specs(cfg, precision, launch_path, tokenizer_path, model_loader, num_threads),
                         host=cfg.host, base_port=cfg.base_port, use_router=cfg.use_router,
                         router_policy=cfg.router_policy, startup_timeout_s=cfg.startup_timeout_s, log_dir=log_dir,
                         api_key=cfg.api_key)


def _launch_sglang(cfg, precision, model_path: str, tokenizer_path: Optional[str], log_dir: Optional[str],
                   model_loader: Optional[str] = None, num_threads: int = 1, launch_dir: Optional[str] = None,
                   visible_gpus: Optional[int] = None, learner_gpus: Optional[int] = None) -> RolloutCluster:
    """rollout.engine=sglang: real SGLang servers on this node's free GPUs (rollout/sglang_launcher.py)."""
    if model_loader is not None:
        raise ValueError("model_loader applies to embedded engines only")
    return sglang_launcher.launch_sglang_engines(cfg, precision, model_path, log_dir=log_dir, launch_dir=launch_dir,
                                                 learner_gpus=learner_gpus, visible_gpus=visible_gpus)


ENGINE_LAUNCHERS: dict[str, Callable[..., RolloutCluster]] = {"embedded": _launch_embedded, "sglang": _launch_sglang}
"""rollout.engine value -> function starting that kind of engine (its ENGINE_SPECS entry says how each starts)."""


def launch_from_config(cfg, model_path: str, tokenizer_path: Optional[str] = None, model_loader: Optional[str] = None,
                       log_dir: Optional[str] = None, num_threads: int = 1, precision=None,
                       launch_dir: Optional[str] = None, visible_gpus: Optional[int] = None,
                       learner_gpus: Optional[int] = None) -> RolloutCluster:
    """Start the engines a `RolloutConfig` asks for (engine=embedded or sglang) under the `PrecisionConfig`.

    `launch_dir` receives the checkpoint engines start from when the weights must first be converted
    to the rollout format (default: <log_dir>/launch). `visible_gpus` / `learner_gpus` (SGLang engines)
    default to this node's CUDA devices and torchrun's LOCAL_WORLD_SIZE (0 outside torchrun).
    """
    _engine_kind(cfg)
    return ENGINE_LAUNCHERS[cfg.engine](cfg, _precision(precision), model_path, tokenizer_path, log_dir, model_loader,
                                        num_threads, launch_dir, visible_gpus=visible_gpus, learner_gpus=learner_gpus)


def plan_from_config(cfg, model_path: str, tokenizer_path: Optional[str] = None, precision=None,
                     launch_dir: str = "launch", num_threads: int = 1, visible_gpus: Optional[int] = None,
                     learner_gpus: Optional[int] = None, log_dir: Optional[str] = None) -> ClusterPlan:
    """What `launch_from_config` would start (argv, ports, environment of each engine and the router; `log_dir`:
    where a start would log, which holds the embedded engines' port files); starts nothing, writes nothing, needs no
    GPU when `visible_gpus` is given."""
    kind, precision = _engine_kind(cfg), _precision(precision)
    specs = kind(cfg, precision, planned_launch_path(model_path, precision, launch_dir), tokenizer_path,
                 num_threads=num_threads, visible_gpus=visible_gpus, learner_gpus=learner_gpus)
    return plan_cluster(specs, host=cfg.host, base_port=cfg.base_port, use_router=cfg.use_router,
                        router_policy=cfg.router_policy, api_key=cfg.api_key, log_dir=log_dir)


@contextlib.contextmanager
def engines(model_path: str, num_engines: int = 1, **kwargs) -> Iterator[RolloutCluster]:
    """Context manager form of `launch_engines`."""
    cluster = launch_engines(model_path, num_engines, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()
