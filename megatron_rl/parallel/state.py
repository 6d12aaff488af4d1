"""Process groups of the learner: torch.distributed + megatron parallel_state from a ParallelConfig.

`init_distributed(parallel_cfg, seed)` works under torchrun/srun-style env vars (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and, without them, creates a world of one
process whose store listens on a port the OS picks as it binds. The accessors below are the only
way the rest of the code reaches process groups (algo/ receives a group object, never calls these).
"""
from __future__ import annotations

import os
from datetime import timedelta
import torch
import torch.distributed as dist

from megatron_rl.config.model import ParallelConfig
from megatron_rl.parallel.compat import enable_cpu_compat

_INIT: dict[str, object] = {"cfg": None, "owns_pg": False}


def resolve_backend(parallel_cfg: ParallelConfig) -> str:
    """The torch.distributed backend: nccl with CUDA, gloo without (unless configured)."""
    if parallel_cfg.backend != "auto":
        return parallel_cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_world_size(parallel_cfg: ParallelConfig, world_size: int) -> int:
    """Data-parallel size for `world_size`; ValueError naming the fields when TP*PP*CP does not divide it."""
    mp = parallel_cfg.tensor_model_parallel_size * parallel_cfg.pipeline_model_parallel_size * parallel_cfg.context_parallel_size
    if world_size % mp != 0:
        from megatron_rl.config import ConfigError  # a ValueError: one `error:` line from the CLI

        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * context_parallel_size = {mp} (start a multiple of {mp} processes with torchrun)"
        )
    return world_size // mp


def init_distributed(parallel_cfg: ParallelConfig, seed: int = 1234, timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed (torchrun env or a world of 1), megatron parallel_state and the RNG seeds."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    enable_cpu_compat()
    backend = resolve_backend(parallel_cfg)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
        else:
            # the store binds port 0 itself (the OS picks a free port as it binds): a port probed first and bound
            # later by tcp:// rendezvous could be taken in between by another process on a shared node
            timeout = timedelta(minutes=timeout_minutes)
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
        _INIT["owns_pg"] = True
    check_world_size(parallel_cfg, dist.get_world_size())
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel_cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel_cfg.context_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        # megatron's optimizer setup asks for the gloo DP groups even when the backend is gloo.
        create_gloo_process_groups=True,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    _INIT["cfg"] = parallel_cfg


def is_initialized() -> bool:
    """True between `init_distributed` and `destroy_distributed`."""
    return _INIT["cfg"] is not None


def parallel_config() -> ParallelConfig:
    """The ParallelConfig the groups were built from."""
    if _INIT["cfg"] is None:
        raise RuntimeError("megatron_rl.parallel.state.init_distributed() has not been called")
    return _INIT["cfg"]  # type: ignore[return-value]


def destroy_distributed() -> None:
    """Tear down megatron's groups and (if this module created it) the default process group."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if _INIT["owns_pg"] and dist.is_initialized():
        dist.destroy_process_group()
    _INIT.update(cfg=None, owns_pg=False)


def world_size() -> int:
    """Number of learner processes."""
    return dist.get_world_size()


def global_rank() -> int:
    """This process's global rank."""
    return dist.get_rank()


def is_controller() -> bool:
    """True on global rank 0 (talks to the rollout router, scores rewards, writes logs)."""
    return dist.get_rank() == 0


def dp_cp_group() -> dist.ProcessGroup:
    """Data x context parallel group: the group of global loss statistics (TP replicas counted once)."""
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group(with_context_parallel=True)


def dp_group() -> dist.ProcessGroup:
    """Data-parallel group (ranks holding different batch rows)."""
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group()


def dp_rank() -> int:
    """Rank within the data-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_rank()


def dp_size() -> int:
    """Data-parallel world size."""
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_world_size()


def tp_group() -> dist.ProcessGroup:
    """Tensor-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group()


def tp_rank() -> int:
    """Rank within the tensor-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank()


def tp_size() -> int:
    """Tensor-parallel world size."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_world_size()


def cp_group() -> dist.ProcessGroup:
    """Context-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_group()


def cp_rank() -> int:
    """Rank within the context-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_rank()


def cp_size() -> int:
    """Context-parallel world size."""
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_world_size()


def pp_group() -> dist.ProcessGroup:
    """Pipeline-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_group()


def pp_rank() -> int:
    """Pipeline stage of this rank."""
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    """Number of pipeline stages."""
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_world_size()


def is_first_stage() -> bool:
    """True on the first pipeline stage."""
    return pp_rank() == 0


def is_last_stage() -> bool:
    """True on the last pipeline stage (the one that holds logits and computes the loss)."""
    return pp_rank() == pp_size() - 1


def last_stage_global_rank() -> int:
    """Global rank of the last pipeline stage in this rank's pipeline group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_last_rank()
