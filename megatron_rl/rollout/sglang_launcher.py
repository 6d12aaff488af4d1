"""Real SGLang engines (GPU): `python -m sglang.launch_server` command lines from the config, GPU assignment, start.

Every engine's environment is the launcher's without torchrun's worker variables (rollout/processes.py)
plus its CUDA_VISIBLE_DEVICES. Command line of engine i (flags checked against SGLang's server arguments by
tests/test_sglang_launcher.py, from a fixture extracted from sglang's server_args.py):

    <rollout.sglang_python> -m sglang.launch_server --model-path P --host H --port PORT
        --tp-size T --dp-size D --random-seed rollout.seed+i --skip-tokenizer-init
        [--quantization fp8|w8a8_fp8]        (precision.rollout_quantization fp8-blockwise|fp8-channel)
        [--kv-cache-dtype fp8_e4m3]          (precision.kv_cache_dtype)
        [--mem-fraction-static F] [--enable-deterministic-inference] [--api-key K]
        [--enable-memory-saver --enable-weights-cpu-backup]   (rollout.placement=colocated)
        [rollout.sglang_args...]

Colocated engines (rollout.placement=colocated) share the learner's GPUs: `--enable-memory-saver`
lets /release_memory_occupation free their weights and KV cache while the learner trains, and
`--enable-weights-cpu-backup` keeps a host copy of the weights, so /resume_memory_occupation
brings back the last synced version (an unhealthy step is never synced: the engines must still
serve the previous one); `--mem-fraction-static` (required there) bounds their share.

SGLang fixes each layer's quantization when it starts and later weight updates load into those
layers, so FP8 engines start from a checkpoint already in the rollout format
(precision/rollout_formats.py writes it next to the synced weights when the source is BF16).

GPU assignment on one node: the engines use K = num_engines * engine_tp_size * engine_dp_size GPUs;
engine i gets the consecutive devices gpus[i*k : (i+1)*k] (k = engine_tp_size * engine_dp_size)
through CUDA_VISIBLE_DEVICES, so inside SGLang they are devices 0..k-1. `gpus` is
rollout.engine_gpus when set, otherwise the node's devices after the learner's: the learner's
torchrun ranks on this node hold devices 0..L-1 (L = LOCAL_WORLD_SIZE; unset means 0: a rollout-only
node started by `megatron-rl engines`; a trainer starting its own engines outside torchrun counts its
one device) and the engines take L..L+K-1; colocated engines take 0..K-1,
the learner's own devices. Device indices are as this process
sees them: under an outer CUDA_VISIBLE_DEVICES they are positions in that list.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Optional, Sequence

from megatron_rl.rollout.processes import EngineSpec, LaunchError, RolloutCluster, start_cluster


def sglang_command(cfg, precision, model_path: str, port: int, seed: int) -> list[str]:
    """argv of one SGLang server for a RolloutConfig and PrecisionConfig."""
    from megatron_rl.precision.rollout_formats import rollout_format

    cmd = [cfg.sglang_python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", cfg.host,
           "--port", str(port), "--tp-size", str(cfg.engine_tp_size), "--dp-size", str(cfg.engine_dp_size),
           "--random-seed", str(seed),
           # the trainer sends token ids and decodes itself
           "--skip-tokenizer-init"]
    quantization = rollout_format(precision).sglang_quantization
    if quantization:
        cmd += ["--quantization", quantization]
    if precision.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", precision.kv_cache_dtype]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", f"{cfg.mem_fraction_static:g}"]
    if cfg.deterministic_inference:
        cmd += ["--enable-deterministic-inference"]
    if cfg.placement == "colocated":
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    api_key = getattr(cfg, "api_key", None)
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(cfg.sglang_args)


def learner_local_gpus() -> int:
    """GPUs torchrun's learner ranks hold on this node: LOCAL_WORLD_SIZE, 0 when unset (a rollout-only node:
    `megatron-rl engines` is not started by torchrun and no learner shares its GPUs)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0"))


def trainer_local_gpus() -> int:
    """GPUs the learner of *this* process's run holds on this node (the trainer starting its own engines):
    LOCAL_WORLD_SIZE under torchrun, else 1 on a CUDA machine (a single-process learner on device 0), else 0."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return learner_local_gpus()
    return 1 if visible_gpu_count() else 0


def engine_gpu_groups(cfg, visible_gpus: int, learner_gpus: int) -> list[list[int]]:
    """Device indices of each engine (see the module docstring); LaunchError naming the fields when they do not fit."""
    k = cfg.engine_tp_size * cfg.engine_dp_size
    need = cfg.num_engines * k
    if cfg.engine_gpus:
        gpus = list(cfg.engine_gpus)
        # without a CUDA view here (visible_gpus == 0) explicit indices are trusted; SGLang reports bad ones
        if visible_gpus and max(gpus) >= visible_gpus:
            raise LaunchError(f"rollout.engine_gpus={gpus} names device {max(gpus)} but this node has "
                              f"{visible_gpus} visible GPU(s)")
    else:
        if visible_gpus == 0:
            raise LaunchError("rollout.engine=sglang needs CUDA GPUs and this node has none "
                              "(use rollout.engine=embedded on CPU, or set rollout.engine_gpus)")
        if cfg.placement == "colocated" and need > visible_gpus:
            raise LaunchError(
                f"rollout.placement=colocated: the engines need {need} GPU(s) (rollout.num_engines={cfg.num_engines} x "
                f"engine_tp_size={cfg.engine_tp_size} x engine_dp_size={cfg.engine_dp_size}) and this node has {visible_gpus}")
        if cfg.placement != "colocated" and learner_gpus + need > visible_gpus:
            raise LaunchError(
                f"rollout.engine=sglang needs {need} GPU(s) (rollout.num_engines={cfg.num_engines} x engine_tp_size="
                f"{cfg.engine_tp_size} x engine_dp_size={cfg.engine_dp_size}) after the learner's {learner_gpus} on this "
                f"node, which has {visible_gpus}; lower them, run the engines on their own node (`megatron-rl engines`) "
                "or set rollout.engine_gpus")
        first = 0 if cfg.placement == "colocated" else learner_gpus  # colocated: the learner's own devices
        gpus = list(range(first, first + need))
    return [gpus[i * k:(i + 1) * k] for i in range(cfg.num_engines)]


def cuda_visible_devices(indices: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES value for device indices as this process sees them (mapped through an outer list)."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer:
        names = [d.strip() for d in outer.split(",") if d.strip()]
        return ",".join(names[i] for i in indices)
    return ",".join(str(i) for i in indices)


def check_sglang_python(python: str) -> str:
    """The resolved rollout.sglang_python executable, after checking it can import sglang (LaunchError naming the field)."""
    exe = shutil.which(python)
    if exe is None:
        raise LaunchError(f"rollout.sglang_python={python!r} is not an executable on this node "
                          "(set it to the python of the environment SGLang is installed in)")
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
    try:
        rc = subprocess.run([exe, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"rollout.sglang_python={python!r} cannot run: {exc}") from None
    if rc != 0:
        raise LaunchError(f"rollout.engine=sglang: {exe} cannot import sglang (set rollout.sglang_python to the python "
                          "of the environment SGLang is installed in, or use rollout.engine=embedded on CPU)")
    return exe


def visible_gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_gpu_groups(cfg, visible_gpus: Optional[int] = None, learner_gpus: Optional[int] = None) -> list[list[int]]:
    """`engine_gpu_groups` with this node's facts for the counts not given (CUDA devices, LOCAL_WORLD_SIZE or 0)."""
    return engine_gpu_groups(cfg, visible_gpu_count() if visible_gpus is None else visible_gpus,
                             learner_local_gpus() if learner_gpus is None else learner_gpus)


def sglang_specs(cfg, precision, launch_path: str, groups: Sequence[Sequence[int]]) -> list[EngineSpec]:
    """How to start each engine: its command line and CUDA_VISIBLE_DEVICES (engine i: seed rollout.seed + i, groups[i])."""
    def spec(i: int) -> EngineSpec:
        return EngineSpec(lambda port: sglang_command(cfg, precision, launch_path, port, cfg.seed + i),
                          {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(groups[i])})

    return [spec(i) for i in range(cfg.num_engines)]


def launch_sglang_engines(cfg, precision, model_path: str, log_dir: Optional[str] = None,
                          launch_dir: Optional[str] = None, learner_gpus: Optional[int] = None,
                          visible_gpus: Optional[int] = None, engine_capability=None) -> RolloutCluster:
    """Start cfg.num_engines SGLang servers on this node's free GPUs, wait for /health, then the router if asked.

    `launch_dir` receives the rollout-format launch checkpoint when `model_path` must be quantized
    first (default: beside the logs); `learner_gpus` / `visible_gpus` default to this node's facts
    (`node_gpu_groups`); `engine_capability` (default: this node's GPU) decides whether these engines would
    requantize the weights' block scales, in which case anything but UE8M0 scales is refused before any start.
    """
    from megatron_rl.precision.device import detect_device_facts, engine_device_errors
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint

    if engine_capability is None:
        engine_capability = detect_device_facts().capability
    errors = engine_device_errors(precision, engine_capability)
    if cfg.engine_gpu is not None and engine_capability is not None:
        from megatron_rl.plan.hardware import get_device

        stated = get_device(cfg.engine_gpu).compute_capability
        if stated != tuple(engine_capability):
            # the learner chose the rollout scale format for the stated GPU (config/run.py resolve_for_engines)
            errors.append(f"rollout.engine_gpu={cfg.engine_gpu} (compute capability {stated[0]}.{stated[1]}) but this "
                          f"node's GPUs have compute capability {engine_capability[0]}.{engine_capability[1]}: set "
                          "rollout.engine_gpu to these engines' GPU model, or leave it unset where it is the learner's")
    if errors:
        raise LaunchError("; ".join(errors))
    groups = node_gpu_groups(cfg, visible_gpus, learner_gpus)
    check_sglang_python(cfg.sglang_python or sys.executable)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise LaunchError(f"SGLang engines need an HF model directory; {model_path!r} has no config.json")
    launch_path = write_launch_checkpoint(model_path, precision, launch_dir or os.path.join(log_dir or ".", "launch"))
    return start_cluster(sglang_specs(cfg, precision, launch_path, groups), host=cfg.host, base_port=cfg.base_port,
                         use_router=cfg.use_router, router_policy=cfg.router_policy,
                         startup_timeout_s=cfg.startup_timeout_s, log_dir=log_dir, api_key=cfg.api_key)
