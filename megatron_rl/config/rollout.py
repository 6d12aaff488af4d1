"""Rollout engines, the HTTP client that drives them, and weight sync."""
from __future__ import annotations

from typing import Literal, Optional

from typing import Annotated

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


class RolloutConfig(StrictConfig):
    """Where rollouts come from and how the trainer talks to the engines."""

    engine: Literal["embedded", "external"] = "embedded"
    """embedded: start CPU rollout servers speaking the SGLang protocol; external: use `urls` (real SGLang)."""
    urls: list[str] = []
    """Engine (or router) base URLs when engine=external."""
    num_engines: PositiveInt = 1
    """Embedded engines to start (>= 1)."""
    use_router: bool = False
    """Put the real sglang-router in front of the engines."""
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "round_robin"
    """sglang-router load-balancing policy."""
    host: str = "127.0.0.1"
    """Bind address of embedded engines (loopback)."""
    base_port: int = Field(0, ge=0, le=65535)
    """First port of embedded engines (0-65535; 0 = pick free ports)."""
    n_samples_per_prompt: PositiveInt = 8
    """GRPO group size n (>= 1)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    concurrency: PositiveInt = 8
    """Maximum in-flight HTTP requests per client (>= 1)."""
    request_timeout_s: PositiveFloat = 120.0
    """Timeout of one HTTP request (seconds, > 0)."""
    max_retries: NonNegativeInt = 3
    """Retries (>= 0) of a failed request (connection errors, 5xx) before the run stops with an error."""
    retry_backoff_s: NonNegativeFloat = 0.5
    """First retry delay (seconds, >= 0); doubles each retry."""
    startup_timeout_s: PositiveFloat = 120.0
    """How long to wait for an engine's /health (seconds, > 0)."""
    weight_sync: Literal["disk", "tensor", "distributed"] = "disk"
    """Weight-sync transport from learner to engines."""
    sync_dir: Optional[str] = None
    """Directory for disk weight sync (default: <run_dir>/weights)."""
    seed: Seed = 0
    """Base random seed of the engines (sampling_seed per request derives from it)."""
    deterministic_inference: bool = True
    """Batch-invariant rollouts: embedded engines generate each prompt's request alone, so samples depend only on (weights, prompt, seed), never on co-batched requests (needed for exact resume and DP/TP-invariant runs); external SGLang servers need --enable-deterministic-inference."""

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.engine == "external" and not self.urls:
            raise ValueError("rollout.urls must list at least one URL when rollout.engine=external")
        return self
