"""What every weight-sync transport does, and the order phases/weights.py calls it in.

One sync of version v, over all learner ranks:

    controller:            transport.begin(v)                 # /pause_generation on every engine; distributed and
                                                              # tensor: /begin_weight_update where engines have it
    stage k sender:        transport.begin_stage(k, P, v)     # distributed: join the stage's group (once)
                           transport.send_bucket(b, final)    # its layers, bucket by bucket; only the
                           ...                                # model's last bucket (final) names v
                           transport.end_stage()
                           (stages take turns, 0..P-1: engines receive one stream at a time)
    controller:            transport.commit(v, config_updates)  # disk: publish the checkpoint and load it
    controller (always):   transport.finish()                    # /end_weight_update (if begun), /continue_generation

So engines learn the new version once, after the last bucket, never generate between two
buckets, and (SGLang >= 0.5.23) receive every distributed or tensor update inside one weight-update
session per sync, closed on every path (rollout/sync/sessions.py). A transport is built on the controller and on every stage sender from the same config
and receiver URLs (never a router's).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_rl.rollout.client import RolloutClient, run_sync
from megatron_rl.rollout.sync import sessions

Bucket = list[tuple[str, torch.Tensor]]
CONTINUE_BODY: dict = {}
"""The /continue_generation body (ContinueGenerationReqInput, defaults)."""


def pause_body(mode: str) -> dict:
    """The /pause_generation body (PauseGenerationReqInput): "abort" or "in_place"."""
    return {"mode": mode}


def memory_body(tags: Optional[list[str]]) -> dict:
    """The /release_memory_occupation and /resume_memory_occupation body ({tags}; None: every kind of memory)."""
    return {"tags": tags}


class WeightTransport:
    """Base of the transports: engine URLs, the HTTP client, bucket size, pause/continue around a sync."""

    name = ""
    needs_session = False
    """Whether this transport's updates must run inside SGLang's weight-update session (distributed, tensor)."""

    def __init__(self, receiver_urls: Sequence[str], bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 pause_mode: str = "abort", client: Optional[RolloutClient] = None, api_key: Optional[str] = None) -> None:
        """`receiver_urls` are the engines themselves (a router does not forward weight updates); `api_key` their bearer key."""
        if not receiver_urls:
            raise ValueError("receiver_urls must list at least one engine URL")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if pause_mode not in ("abort", "in_place"):
            raise ValueError(f"pause_mode must be 'abort' or 'in_place', got {pause_mode!r}")
        self.urls = [u.rstrip("/") for u in receiver_urls]
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.timeout_s = float(timeout_s)
        self.pause_mode = pause_mode
        self.api_key = api_key if api_key is not None else getattr(client, "api_key", None)
        self.client = client or self.engine_client(self.urls)
        self._engine_info: Optional[list[dict]] = None
        self._targets_epoch = 0
        self.open_sessions: list[str] = []
        """Engines where this transport's sync holds a weight-update session (closed by `finish`)."""

    def engine_client(self, urls: Sequence[str] | str) -> RolloutClient:
        """A client of `urls` for weight updates: no retries (they are not idempotent), the update timeout, the key."""
        return RolloutClient(urls, request_timeout_s=self.timeout_s, max_retries=0, api_key=self.api_key)

    def set_worker_urls(self, urls: Sequence[str]) -> None:
        """Send to `urls` from now on (the live engines; topology.EnginePool decides)."""
        self.urls = [u.rstrip("/") for u in urls]
        self.client = self.engine_client(self.urls)
        self._engine_info = None

    def refresh_targets(self, urls: Sequence[str], epoch: int) -> None:
        """Adopt the controller's live engines; `epoch` changes when one was restarted (it lost its groups)."""
        if [u.rstrip("/") for u in urls] != self.urls or epoch != self._targets_epoch:
            self.set_worker_urls(urls)
        self._targets_epoch = epoch

    # ------------------------------------------------------------------ controller
    def begin(self, weight_version: Any) -> None:
        """Pause generation on every engine before the first bucket, then open the sync's weight-update session on
        the engines that have sessions (transports whose updates need one)."""
        run_sync(self.client.call_all("/pause_generation", pause_body(self.pause_mode), self.timeout_s, check_success=False))
        if self.needs_session:
            self.open_sessions = run_sync(sessions.open_sessions(self.client, self.session_urls(), self.timeout_s))

    def commit(self, weight_version: Any, config_updates: Optional[Mapping[str, Any]] = None) -> None:
        """After every stage sent its buckets (disk publishes and loads the checkpoint here)."""

    def finish(self) -> None:
        """Close the sync's weight-update sessions, then resume generation (both also after a failed sync)."""
        opened, self.open_sessions = self.open_sessions, []
        try:
            if opened:
                run_sync(sessions.close_sessions(self.client, opened, self.timeout_s))
        finally:
            run_sync(self.client.call_all("/continue_generation", CONTINUE_BODY, self.timeout_s, check_success=False))

    # ------------------------------------------------------------------ stage senders
    def begin_stage(self, stage: int, num_stages: int, weight_version: Any) -> None:
        """Before pipeline stage `stage` (of `num_stages`) sends the buckets of version `weight_version`."""
        self.stage, self.num_stages, self.weight_version = stage, num_stages, weight_version

    def send_bucket(self, bucket: Bucket, final: bool) -> None:
        """Hand one bucket to the engines; `final` marks the model's last bucket (the one that names the version)."""
        raise NotImplementedError

    def end_stage(self) -> None:
        """After the stage's last bucket."""

    def close(self) -> None:
        """Release groups and handles."""

    def engine_info(self) -> list[dict]:
        """Per receiver, from SGLang's /server_info (fetched once): {"tp_size", "cpu", "version", "sessions",
        "server_info" (the answer itself)}; "cpu"
        engines need CPU tensors; "sessions" (learned for transports that need them) whether distributed/tensor
        updates must run inside a weight-update session. The route itself is probed first: what answers at `url`
        may not be what /server_info declares (a proxy in front of an engine forwards the engine's version while
        enforcing its own rules); the declared version decides only when the probe cannot."""
        if self._engine_info is None:
            infos = [i if isinstance(i, dict) else {} for i in run_sync(self.client.server_info())]
            out = []
            for url, i in zip(self.urls, infos):
                has = self._probe_sessions(url, i.get("version")) if self.needs_session else False
                out.append({"tp_size": int(i.get("tp_size", 1) or 1), "version": str(i.get("version", "")),
                            "cpu": i.get("device") == "cpu" or i.get("engine") == "embedded-cpu", "sessions": has,
                            "server_info": i})
            self._engine_info = out
        return self._engine_info

    def _probe_sessions(self, url: str, version: Any) -> bool:
        """Whether `url` has weight-update sessions: its route answers (405 to a GET: yes; 404: no), else its version."""
        try:
            return run_sync(sessions.probe_sessions(self.client, url))
        except Exception:  # noqa: BLE001 - any failed probe (auth, 5xx, a proxy's own answer): the version decides
            has = sessions.sessions_by_version(version)
            if has is None:
                raise
            return has

    def session_urls(self) -> list[str]:
        """The receivers whose distributed/tensor updates need a weight-update session (SGLang >= 0.5.23)."""
        return [u for u, i in zip(self.urls, self.engine_info()) if i["sessions"]]

    def engine_tp_sizes(self) -> list[int]:
        """TP size of each receiver (SGLang's /server_info tp_size)."""
        return [i["tp_size"] for i in self.engine_info()]

    def any_cpu_engine(self) -> bool:
        """Whether a receiver runs on CPU (then CUDA tensors are copied to host memory before they travel)."""
        return any(i["cpu"] for i in self.engine_info())


def dtype_str(dtype: torch.dtype) -> str:
    """SGLang's dtype string of a torch dtype ('float32', 'bfloat16', 'float8_e4m3fn')."""
    return str(dtype).removeprefix("torch.")
