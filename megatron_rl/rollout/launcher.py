"""Start embedded rollout servers (and optionally the real sglang-router) as subprocesses on loopback.

    with launch_engines(model_path, num_engines=2, use_router=True) as cluster:
        client = RolloutClient(cluster.generate_url)     # the router when there is one
        sync_targets = cluster.worker_urls                # weight updates go to every worker

The router forwards /generate but not weight updates, so weight sync always addresses
`worker_urls`. Each engine is started as
`sys.executable -m megatron_rl.rollout.server ...`; a start that dies or stays unhealthy raises
`LaunchError` with the tail of that process's log.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

ROUTER_POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")


class LaunchError(RuntimeError):
    """A rollout subprocess failed to start or become healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` (may be taken again before use; callers retry on bind errors)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ManagedProcess:
    """A started subprocess with its log file."""

    name: str
    """Human-readable role, e.g. 'engine 0' or 'router'."""
    proc: subprocess.Popen
    """The process handle."""
    url: str
    """Base URL it serves."""
    log_path: str
    """File receiving its stdout and stderr."""

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of the process's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_chars))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"<log unavailable: {exc}>"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)


@dataclass
class RolloutCluster:
    """Running engines (and router); use as a context manager or call `stop()`."""

    engines: list[ManagedProcess] = field(default_factory=list)
    """Engine processes."""
    router: Optional[ManagedProcess] = None
    """sglang-router process, if started."""

    @property
    def worker_urls(self) -> list[str]:
        """Engine base URLs (targets of weight sync)."""
        return [e.url for e in self.engines]

    @property
    def generate_url(self) -> str:
        """Where /generate should go: the router if any, else the first engine."""
        return self.router.url if self.router else self.engines[0].url

    @property
    def generate_urls(self) -> list[str]:
        """URLs a client should spread /generate over: [router] or all engines."""
        return [self.router.url] if self.router else self.worker_urls

    def stop(self) -> None:
        """Stop the router, then every engine."""
        procs = ([self.router] if self.router else []) + list(self.engines)
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()

    def __enter__(self) -> "RolloutCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _http_ok(url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(status is 2xx, description) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def wait_healthy(proc: ManagedProcess, path: str, timeout_s: float, poll_s: float = 0.25) -> None:
    """Poll `proc.url + path` until 2xx; LaunchError (with the log tail) if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if proc.proc.poll() is not None:
            raise LaunchError(f"{proc.name} ({proc.url}) exited with code {proc.proc.returncode} while starting; "
                              f"log tail ({proc.log_path}):\n{proc.log_tail()}")
        ok, last = _http_ok(proc.url + path)
        if ok:
            return
        if time.monotonic() >= deadline:
            raise LaunchError(f"{proc.name} ({proc.url}) not healthy after {timeout_s:g} s (last: {last}); "
                              f"log tail ({proc.log_path}):\n{proc.log_tail()}")
        time.sleep(poll_s)


def _spawn(name: str, cmd: list[str], url: str, log_dir: str, env: Optional[dict] = None) -> ManagedProcess:
    log_path = os.path.join(log_dir, name.replace(" ", "_") + ".log")
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    finally:
        log.close()  # the child holds its own descriptor
    return ManagedProcess(name, proc, url, log_path)


def engine_command(model_path: str, port: int, host: str = "127.0.0.1", tokenizer_path: Optional[str] = None,
                   random_seed: int = 0, model_loader: Optional[str] = None, num_threads: int = 1,
                   extra_args: Sequence[str] = (), deterministic: bool = False,
                   parent_pid: Optional[int] = None, api_key: Optional[str] = None,
                   max_n: Optional[int] = None) -> list[str]:
    """argv of one embedded engine (with `parent_pid` it exits when that process dies; with `api_key`
    it requires that bearer key; `max_n` raises its limit on samples per prompt)."""
    cmd = [sys.executable, "-m", "megatron_rl.rollout.server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--random-seed", str(random_seed), "--num-threads", str(num_threads)]
    if tokenizer_path:
        cmd += ["--tokenizer-path", tokenizer_path]
    if model_loader:
        cmd += ["--model-loader", model_loader]
    if deterministic:
        cmd += ["--enable-deterministic-inference"]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    if api_key:
        cmd += ["--api-key", api_key]
    if max_n:
        cmd += ["--max-n", str(max_n)]
    return cmd + list(extra_args)


def engine_max_n(n_samples_per_prompt: int) -> Optional[int]:
    """The --max-n an engine needs for GRPO groups of this size (None: the server's default suffices)."""
    from megatron_rl.rollout.validation import DEFAULT_MAX_N

    return n_samples_per_prompt if n_samples_per_prompt > DEFAULT_MAX_N else None


def router_command(worker_urls: Sequence[str], port: int, host: str = "127.0.0.1", policy: str = "round_robin",
                   extra_args: Sequence[str] = ()) -> list[str]:
    """argv of the real sglang-router in front of `worker_urls` (it probes each worker's /health)."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r} must be one of {ROUTER_POLICIES}")
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", policy, "--host", host, "--port", str(port),
            # the default 30 s between startup checks would dominate a CPU run's start time
            "--worker-startup-check-interval", "1", "--log-level", "warn", *extra_args]


def launch_engines(model_path: str, num_engines: int = 1, *, tokenizer_path: Optional[str] = None,
                   host: str = "127.0.0.1", base_port: int = 0, random_seed: int = 0,
                   model_loader: Optional[str] = None, num_threads: int = 1, use_router: bool = False,
                   router_policy: str = "round_robin", startup_timeout_s: float = 120.0,
                   log_dir: Optional[str] = None, engine_args: Sequence[str] = (),
                   router_args: Sequence[str] = (), deterministic: bool = False, api_key: Optional[str] = None,
                   max_n: Optional[int] = None) -> RolloutCluster:
    """Start `num_engines` embedded engines (engine i seeded random_seed + i), wait for /health, optionally start the router.

    `model_loader` is a 'package.module:function' path handed to each server; ports are free
    loopback ports unless `base_port` > 0 (then base_port + i, router at base_port + num_engines).
    Engines exit on their own when this process dies (even by SIGKILL), so none is left orphaned.
    `deterministic` makes each engine generate requests one at a time (batch-invariant samples).
    `api_key` is required by every engine (their /health stays open) and handed to the router, which
    authorizes itself to the workers with it; `max_n` raises the engines' limit on sampling_params.n
    when the trainer asks for more samples per prompt.
    """
    if num_engines < 1:
        raise ValueError("num_engines must be >= 1")
    if use_router:
        import importlib.util

        if importlib.util.find_spec("sglang_router") is None:
            raise LaunchError("use_router needs the sglang-router package (pip install sglang-router)")
    log_dir = log_dir or tempfile.mkdtemp(prefix="megatron_rl_rollout_")
    os.makedirs(log_dir, exist_ok=True)
    cluster = RolloutCluster()
    try:
        for i in range(num_engines):
            port = base_port + i if base_port > 0 else free_port(host)
            cmd = engine_command(model_path, port, host, tokenizer_path, random_seed + i, model_loader,
                                 num_threads, engine_args, deterministic=deterministic, parent_pid=os.getpid(),
                                 api_key=api_key, max_n=max_n)
            cluster.engines.append(_spawn(f"engine {i}", cmd, f"http://{host}:{port}", log_dir))
        for e in cluster.engines:
            wait_healthy(e, "/health", startup_timeout_s)
        if use_router:
            port = base_port + num_engines if base_port > 0 else free_port(host)
            # the router authorizes itself to the workers with the same key
            key_args = ["--api-key", api_key] if api_key else []
            cluster.router = _spawn("router", router_command(cluster.worker_urls, port, host, router_policy,
                                                             [*key_args, *router_args]),
                                    f"http://{host}:{port}", log_dir)
            wait_router(cluster.router, len(cluster.engines), startup_timeout_s, api_key=api_key)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def wait_router(router: ManagedProcess, num_workers: int, timeout_s: float, api_key: Optional[str] = None) -> None:
    """Wait until the router lists `num_workers` workers and answers /health (a router given --api-key
    guards its own /workers with the key too)."""
    import json

    deadline = time.monotonic() + timeout_s
    wait_healthy(router, "/health", timeout_s)
    last = "no answer"
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            break
        try:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            with urllib.request.urlopen(urllib.request.Request(router.url + "/workers", headers=headers), timeout=2.0) as resp:
                data = json.loads(resp.read() or b"{}")
            workers = data.get("workers", data) if isinstance(data, dict) else data
            healthy = [w for w in workers if not isinstance(w, dict) or w.get("is_healthy", w.get("healthy", True))]
            if len(healthy) >= num_workers:
                return
            last = f"{len(healthy)}/{num_workers} workers registered"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise LaunchError(f"router ({router.url}) did not register {num_workers} workers in {timeout_s:g} s "
                      f"(last: {last}); log tail:\n{router.log_tail()}")


def launch_from_config(cfg, model_path: str, tokenizer_path: Optional[str] = None, model_loader: Optional[str] = None,
                       log_dir: Optional[str] = None, num_threads: int = 1) -> RolloutCluster:
    """`launch_engines` with the settings of a `RolloutConfig` (engine='embedded')."""
    if cfg.engine != "embedded":
        raise ValueError(f"rollout.engine={cfg.engine!r}: only 'embedded' engines are launched here; "
                         "external servers are reached through rollout.urls")
    return launch_engines(model_path, cfg.num_engines, tokenizer_path=tokenizer_path, host=cfg.host,
                          base_port=cfg.base_port, random_seed=cfg.seed, model_loader=model_loader,
                          num_threads=num_threads, use_router=cfg.use_router, router_policy=cfg.router_policy,
                          startup_timeout_s=cfg.startup_timeout_s, log_dir=log_dir,
                          deterministic=cfg.deterministic_inference, api_key=cfg.api_key,
                          max_n=engine_max_n(cfg.n_samples_per_prompt))


@contextlib.contextmanager
def engines(model_path: str, num_engines: int = 1, **kwargs) -> Iterator[RolloutCluster]:
    """Context manager form of `launch_engines`."""
    cluster = launch_engines(model_path, num_engines, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()
