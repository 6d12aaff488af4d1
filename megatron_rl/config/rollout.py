"""Rollout engines, the HTTP client that drives them, and weight sync."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import model_validator

from megatron_rl.config.base import StrictConfig


class SamplingConfig(StrictConfig):
    """SGLang sampling_params used for training rollouts."""

    temperature: float = 1.0
    """Sampling temperature (< 1e-6 means greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k cut (-1 = whole vocabulary)."""
    max_new_tokens: int = 16
    """Maximum completion length."""
    stop_token_ids: list[int] = []
    """Extra stop tokens (EOS is always a stop)."""


class RolloutConfig(StrictConfig):
    """Where rollouts come from and how the trainer talks to the engines."""

    engine: Literal["embedded", "external"] = "embedded"
    """embedded: start CPU rollout servers speaking the SGLang protocol; external: use `urls` (real SGLang)."""
    urls: list[str] = []
    """Engine (or router) base URLs when engine=external."""
    num_engines: int = 1
    """Embedded engines to start."""
    engine_tp_size: int = 1
    """Tensor-parallel GPUs per SGLang engine (`--tp-size`); engines use num_engines * engine_tp_size * engine_dp_size GPUs."""
    engine_dp_size: int = 1
    """Data-parallel replicas inside each SGLang engine (`--dp-size`)."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: engines on their own GPUs (nodes); colocated: engines share the learner's GPUs (release/resume memory)."""
    mem_fraction_static: float = 0.8
    """Fraction of each engine GPU's memory SGLang reserves for weights + KV cache (`--mem-fraction-static`)."""
    sglang_python: str = "python"
    """Python executable of the environment that has SGLang (the Docker image sets /opt/sglang/bin/python: its torch pin differs)."""
    use_router: bool = False
    """Put the real sglang-router in front of the engines."""
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "round_robin"
    """sglang-router load-balancing policy."""
    host: str = "127.0.0.1"
    """Bind address of embedded engines (loopback)."""
    base_port: int = 0
    """First port of embedded engines (0 = pick free ports)."""
    n_samples_per_prompt: int = 8
    """GRPO group size n."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    concurrency: int = 8
    """Maximum in-flight HTTP requests per client."""
    request_timeout_s: float = 120.0
    """Timeout of one HTTP request."""
    max_retries: int = 3
    """Retries of a failed request (connection errors, 5xx) before the run stops with an error."""
    retry_backoff_s: float = 0.5
    """First retry delay; doubles each retry."""
    startup_timeout_s: float = 120.0
    """How long to wait for an engine's /health."""
    weight_sync: Literal["disk", "tensor", "distributed"] = "disk"
    """Weight-sync transport from learner to engines."""
    sync_dir: Optional[str] = None
    """Directory for disk weight sync (default: <run_dir>/weights)."""
    seed: int = 0
    """Base random seed of the engines (sampling_seed per request derives from it)."""
    deterministic_inference: bool = True
    """Batch-invariant rollouts: embedded engines generate each prompt's request alone, so samples depend only on (weights, prompt, seed), never on co-batched requests (needed for exact resume and DP/TP-invariant runs); external SGLang servers need --enable-deterministic-inference."""

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.engine == "external" and not self.urls:
            raise ValueError("rollout.urls must list at least one URL when rollout.engine=external")
        if self.n_samples_per_prompt < 1:
            raise ValueError("rollout.n_samples_per_prompt must be >= 1")
        if self.num_engines < 1:
            raise ValueError("rollout.num_engines must be >= 1")
        for name in ("engine_tp_size", "engine_dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rollout.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        return self
