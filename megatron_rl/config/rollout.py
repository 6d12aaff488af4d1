"""Rollout engines, the HTTP client that drives them, and weight sync."""
from __future__ import annotations

import sys
from typing import Annotated, Literal, Optional
from urllib.parse import urlparse

from pydantic import Field, model_validator

from megatron_rl.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Seed, StrictConfig


class SamplingConfig(StrictConfig):
    """SGLang sampling_params used for training rollouts."""

    temperature: NonNegativeFloat = 1.0
    """Sampling temperature (>= 0, finite; < 1e-6 means greedy)."""
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = Field(-1, ge=-1)
    """Top-k cut: -1 (whole vocabulary) or >= 1."""
    max_new_tokens: PositiveInt = 16
    """Maximum completion length (>= 1)."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    """Extra stop tokens (ids >= 0; EOS is always a stop)."""

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        if self.top_k == 0:
            raise ValueError("rollout.sampling.top_k must be -1 (whole vocabulary) or >= 1, got 0")
        return self


EMBEDDED_SEQUENCES_PER_REQUEST = 256
"""Default samples per /generate call to embedded engines (their --max-batch-size default; the server caps a call at 1024)."""

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
"""Hosts that name this machine (an engine there can map the trainer's shared memory / CUDA IPC handles)."""


def _other_host_ip(host: str) -> bool:
    """Whether `host` is an IP address literal of another host (not loopback, no interface of this one; a name may
    still resolve to this host, so names are left to the sender's own check, rollout/sync/distributed.py)."""
    import ipaddress
    import socket

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return False
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return False
    except OSError:
        return True


class WeightSyncConfig(StrictConfig):
    """How new weights travel from the learner to the engines (rollout/sync/, one module per transport)."""

    transport: Literal["disk", "distributed", "tensor"] = "disk"
    """disk: HF checkpoints in sync_dir + /update_weights_from_disk; distributed: SGLang's weight-update group broadcast (NCCL/gloo); tensor: /update_weights_from_tensor handles (engines on this host)."""
    bucket_mb: PositiveFloat = 512.0
    """Largest bucket of HF tensors exported and sent at once (MB, > 0; a single larger tensor travels alone)."""
    sync_dir: Optional[str] = None
    """Directory of the disk transport's versioned checkpoints (default: <run_dir>/weights)."""
    keep_last: PositiveInt = 2
    """Versions (>= 1) the disk transport keeps in sync_dir."""
    timeout_s: PositiveFloat = 300.0
    """Bound (seconds, > 0) of one weight-update request, the group rendezvous and each broadcast (engines get it too)."""
    master_address: Optional[str] = None
    """Address at which engines reach the weight sender on this host (a sender on another host advertises its own). None = 127.0.0.1 when every engine is local, else this host's interface that routes to the engines (loopback with a remote engine is an error)."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port (0-65535) of stage 0's weight-update group (stage k uses master_port + k); 0 = each sender's own listening socket on a port the OS picks."""
    group_name: str = "weight_update_group"
    """Name of the weight-update group (with PP > 1, stage k uses <group_name>_pp<k>)."""
    pause_mode: Literal["abort", "in_place"] = "abort"
    """/pause_generation mode around an update: abort (SGLang's default, in-flight requests end as 'abort') or in_place."""

    @model_validator(mode="after")
    def _check(self) -> "WeightSyncConfig":
        if not self.group_name or not all(c.isalnum() or c in "._-" for c in self.group_name):
            raise ValueError(f"rollout.weight_sync.group_name={self.group_name!r} must be non-empty letters, digits, '.', '_' or '-'")
        return self

    @property
    def bucket_bytes(self) -> int:
        """bucket_mb in bytes."""
        return max(1, int(self.bucket_mb * 1024 * 1024))


class RolloutConfig(StrictConfig):
    """Where rollouts come from and how the trainer talks to the engines."""

    engine: Literal["embedded", "sglang", "external"] = "embedded"
    """embedded: start CPU rollout servers speaking the SGLang protocol; sglang: launch real SGLang servers on this node's free GPUs; external: use already running servers at `urls`."""
    urls: list[str] = []
    """Generation endpoint(s) when engine=external: one sglang-router, or the engines themselves (requests are spread over them)."""
    weight_update_urls: list[str] = []
    """Engines that receive weight updates when engine=external (never a router); empty = the router's worker list, or `urls` when those are engines."""
    num_engines: PositiveInt = 1
    """Engines (SGLang servers, >= 1) to start on this node when engine=embedded or sglang."""
    engine_tp_size: PositiveInt = 1
    """Tensor-parallel GPUs per SGLang engine (--tp-size, >= 1)."""
    engine_dp_size: PositiveInt = 1
    """Data-parallel replicas (>= 1) inside one SGLang engine (--dp-size); GPUs used = num_engines * engine_tp_size * engine_dp_size."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: engines on GPUs (nodes) of their own; colocated: engines share the learner's devices, release their memory while it trains and resume it before the weight sync (weights via weight_sync.transport=tensor, the default there)."""
    colocate_offload: bool = False
    """placement=colocated: every learner rank moves its optimizer states and gradient buffers to host memory while the engines run, and back before it trains (trainer/offload.py; the step's numbers are unchanged)."""
    overlap: Literal["none", "one_step_off"] = "none"
    """none: each step generates, then trains; one_step_off: step t+1's samples are generated (with the weights of step t) while step t trains."""
    engine_gpus: list[Annotated[int, Field(ge=0)]] = []
    """CUDA device indices of this node for the SGLang engines, in order (empty = the GPUs after the learner's local ranks)."""
    engine_gpu: Optional[str] = None
    """GPU model of the engines where it differs from the learner's (a `megatron-rl plan --gpu` name, e.g. b200 beside h100 learners): it picks precision.rollout_scale_fmt=auto; None: the learner's GPU model."""
    sglang_python: Optional[str] = None
    """Python executable SGLang runs in (engine=sglang); None = the learner's own interpreter, as in the GPU image, where learner and engines share one torch and one NCCL (resolved at launch, so a recorded config names no machine path)."""
    sglang_args: list[str] = []
    """Extra `sglang.launch_server` flags appended verbatim to every engine's command line."""
    mem_fraction_static: Optional[float] = Field(None, gt=0, lt=1, allow_inf_nan=False)
    """Fraction of GPU memory, in (0, 1), SGLang reserves for weights and KV cache (--mem-fraction-static; None = SGLang's default)."""
    use_router: bool = False
    """Put the real sglang-router in front of the engines we start."""
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "round_robin"
    """sglang-router load-balancing policy."""
    host: str = "127.0.0.1"
    """Bind address of the engines and router we start (loopback; 0.0.0.0 to serve other nodes)."""
    base_port: int = Field(0, ge=0, le=65535)
    """First port of the engines we start (0-65535; engine i: base_port + i, router: base_port + num_engines; 0 = free ports)."""
    restart_dead_engines: bool = True
    """Restart an engine this run started that died, before the next weight sync (it then gets the new weights); external engines are dropped from the weight-sync targets."""
    n_samples_per_prompt: PositiveInt = 8
    """GRPO group size n (>= 1)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    concurrency: PositiveInt = 8
    """Maximum in-flight HTTP requests per client (>= 1)."""
    sequences_per_request: Optional[Annotated[int, Field(ge=1, le=1024)]] = None
    """Samples (prompts x n, 1-1024) one batched /generate call may carry, whole prompts packed in order; None = 256 for embedded engines without a router, else 1 (one prompt per call). Above 1 needs engines addressed directly: the router takes one sampling_params per call."""
    request_timeout_s: PositiveFloat = 120.0
    """Timeout of one HTTP request (seconds, > 0)."""
    max_retries: NonNegativeInt = 3
    """Retries (>= 0) of a failed request (connection errors, 5xx) before the run stops with an error."""
    retry_backoff_s: NonNegativeFloat = 0.5
    """First retry delay (seconds, >= 0); doubles each retry."""
    startup_timeout_s: PositiveFloat = 120.0
    """How long to wait for an engine's /health (seconds, > 0)."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Weight-sync transport from learner to engines."""
    seed: Seed = 0
    """Base random seed of the engines (sampling_seed per request derives from it)."""
    api_key: Optional[str] = None
    """Bearer key of the engines (SGLang's --api-key): embedded engines are started with it and every request sends it."""
    deterministic_inference: bool = True
    """Reproducible rollouts (exact resume, DP/TP-invariant runs): embedded engines generate each /generate call as its own batch and the client packs calls the same way every time. SGLang engines we launch get --enable-deterministic-inference (start external ones with it)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data):
        """Name the new location of keys that moved into rollout.weight_sync."""
        if isinstance(data, dict):
            if "sync_dir" in data:
                raise ValueError("rollout.sync_dir moved: use rollout.weight_sync.sync_dir")
            if isinstance(data.get("weight_sync"), str):
                raise ValueError(f"rollout.weight_sync is a section now: use rollout.weight_sync.transport={data['weight_sync']}")
            ws = data.get("weight_sync")
            if data.get("placement") == "colocated" and (ws is None or (isinstance(ws, dict) and "transport" not in ws)):
                # colocated engines take the learner's tensors by handle; any other transport is refused below
                data = {**data, "weight_sync": {**(ws or {}), "transport": "tensor"}}
        return data

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.engine == "external" and not self.urls:
            raise ValueError("rollout.urls must list at least one URL when rollout.engine=external")
        if self.engine != "external" and (self.urls or self.weight_update_urls):
            raise ValueError(f"rollout.urls / rollout.weight_update_urls are for engine=external; engine={self.engine} "
                             "starts its own engines")
        for name in ("urls", "weight_update_urls"):
            for u in getattr(self, name):
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"rollout.{name}: {u!r} is not an http(s) URL")
        if self.engine == "embedded" and (self.engine_tp_size, self.engine_dp_size) != (1, 1):
            raise ValueError("rollout.engine_tp_size / engine_dp_size apply to engine=sglang (embedded engines are single CPU processes)")
        if self.engine_dp_size > 1 and self.weight_sync.transport in ("distributed", "tensor"):
            # SGLang asserts dp_size == 1 in both update paths (0.5.8 and 0.5.23): the engine would refuse every sync
            raise ValueError(f"rollout.engine_dp_size={self.engine_dp_size} is not supported with "
                             f"rollout.weight_sync.transport={self.weight_sync.transport}: SGLang updates weights from a "
                             "broadcast or tensor handles only with --dp-size 1; use more engines "
                             "(rollout.num_engines) or transport=disk")
        if self.engine == "embedded" and (self.mem_fraction_static is not None or self.sglang_args):
            raise ValueError("rollout.mem_fraction_static / sglang_args apply to SGLang engines, not engine=embedded")
        if self.engine_gpus:
            if self.engine != "sglang":
                raise ValueError("rollout.engine_gpus applies to engine=sglang")
            need = self.num_engines * self.engine_tp_size * self.engine_dp_size
            if len(self.engine_gpus) != need or len(set(self.engine_gpus)) != need or min(self.engine_gpus) < 0:
                raise ValueError(f"rollout.engine_gpus must list {need} distinct GPU indices "
                                 "(num_engines * engine_tp_size * engine_dp_size)")
        if self.engine_gpu is not None:
            self._check_engine_gpu()
        if self.use_router and self.router_policy == "power_of_two" and self.engine != "external" and self.num_engines < 2:
            raise ValueError("rollout.router_policy=power_of_two needs rollout.num_engines >= 2 (sglang-router refuses "
                             "to start it with one worker)")
        if self.base_port + self.num_engines > 65535:
            raise ValueError("rollout.base_port must be 0 (free ports) or leave room for num_engines + 1 ports below 65536")
        ws = self.weight_sync
        if ws.transport == "distributed" and self.engine == "external" and ws.master_address is not None and (
                ws.master_address in LOOPBACK_HOSTS or ws.master_address.startswith("127.")):
            remote = [u for u in (self.weight_update_urls or self.urls) if _other_host_ip(urlparse(u).hostname or "")]
            if remote:
                raise ValueError(f"rollout.weight_sync.master_address={ws.master_address} is a loopback address, which "
                                 f"engine {remote[0]} on another host cannot reach; set it to this host's address on the "
                                 "engines' network or leave it unset")
        if self.weight_sync.transport == "tensor" and self.engine == "sglang" and self.placement != "colocated":
            # each engine sees only its own GPUs (CUDA_VISIBLE_DEVICES), none of them the learner's, and SGLang exits on
            # a CUDA-IPC handle of another GPU (srt/utils/patch_torch.py: Invalid device_uuid)
            raise ValueError("rollout.weight_sync.transport=tensor with rollout.engine=sglang needs "
                             f"rollout.placement=colocated (got {self.placement}): engines on GPUs of their own cannot "
                             "open the learner's CUDA-IPC handles; use transport=distributed or disk")
        if self.weight_sync.transport == "tensor" and self.engine == "external":
            # a necessary condition only: which devices a local engine holds is asked of the engine itself before the
            # first bucket (rollout/engine_devices.py, TensorWeightSync.check_sender_device / check_colocated_devices)
            remote = [u for u in (self.weight_update_urls or self.urls) if (urlparse(u).hostname or "") not in LOOPBACK_HOSTS]
            if remote:
                raise ValueError(f"rollout.weight_sync.transport=tensor hands engines shared-memory / CUDA-IPC handles, "
                                 f"which only an engine on this host can open; {remote[0]} is elsewhere "
                                 "(use transport=distributed or disk)")
        if (self.sequences_per_request is not None and self.sequences_per_request > 1
                and (self.use_router or self.engine == "external")):
            raise ValueError(f"rollout.sequences_per_request={self.sequences_per_request} packs several prompts into one "
                             "/generate call, which needs engines addressed directly: sglang-router 0.3.2 refuses a list "
                             "of sampling_params (HTTP 422) and every prompt carries its own sampling_seed; leave it unset "
                             f"(one prompt per call) with use_router=true or engine=external")
        if self.placement == "colocated":
            self._check_colocated()
        elif self.colocate_offload:
            raise ValueError(f"rollout.colocate_offload=true applies to rollout.placement=colocated (got {self.placement}): "
                             "disaggregated engines never share the learner's devices")
        if self.api_key is not None and (not self.api_key or any(c.isspace() or not c.isprintable() for c in self.api_key)):
            raise ValueError("rollout.api_key must be a non-empty string without whitespace (it is sent in an HTTP header)")
        return self

    @property
    def sglang_executable(self) -> str:
        """sglang_python with None resolved to this process's interpreter."""
        return self.sglang_python or sys.executable

    @property
    def resolved_sequences_per_request(self) -> int:
        """sequences_per_request with None resolved (256 embedded engines addressed directly; 1, one prompt per call, otherwise)."""
        if self.sequences_per_request is not None:
            return self.sequences_per_request
        direct = self.engine == "embedded" and not self.use_router
        # 1: every prompt in a call of its own, whatever its n (greedy evaluations ask for n = 1)
        return EMBEDDED_SEQUENCES_PER_REQUEST if direct else 1

    def _check_engine_gpu(self) -> None:
        """rollout.engine_gpu names a GPU of plan/hardware.py and engines that run on GPUs of their own."""
        from megatron_rl.plan.hardware import DEVICES

        gpus = sorted(name for name, spec in DEVICES.items() if spec.compute_capability)
        if self.engine_gpu not in gpus:
            raise ValueError(f"rollout.engine_gpu={self.engine_gpu!r} is no known GPU model; use one of {', '.join(gpus)} "
                             "or leave it unset (the learner's GPU)")
        if self.engine == "embedded":
            raise ValueError("rollout.engine_gpu applies to GPU engines (rollout.engine=sglang or external); embedded "
                             "engines run on CPU: leave it unset")
        if self.placement == "colocated":
            raise ValueError("rollout.engine_gpu: colocated engines share the learner's GPUs, so they are the learner's "
                             "model: leave it unset with rollout.placement=colocated")

    def _check_colocated(self) -> None:
        """What rollout.placement=colocated needs (engines on the learner's devices, memory released while it trains)."""
        if self.weight_sync.transport != "tensor":
            raise ValueError(f"rollout.weight_sync.transport={self.weight_sync.transport} is not supported with "
                             "rollout.placement=colocated: colocated engines take the learner's tensors by handle on the "
                             "same devices (NCCL refuses two ranks on one GPU); use transport=tensor (the default there)")
        if self.overlap != "none":
            raise ValueError(f"rollout.overlap={self.overlap} needs engines that keep generating while the learner trains; "
                             "rollout.placement=colocated engines release their memory then (use placement=disaggregated)")
        if self.engine == "sglang" and self.mem_fraction_static is None:
            raise ValueError("rollout.mem_fraction_static must be set when rollout.placement=colocated and engine=sglang: "
                             "the engines share each GPU with the learner's weights and optimizer (e.g. 0.3; "
                             "`megatron-rl plan` checks the fit)")
