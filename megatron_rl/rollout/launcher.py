"""Start rollout engines (embedded CPU servers or real SGLang servers) and optionally the real sglang-router.

    with launch_engines(model_path, num_engines=2, use_router=True) as cluster:
        client = RolloutClient(cluster.generate_url)     # the router when there is one
        sync_targets = cluster.worker_urls                # weight updates go to every worker

The router forwards /generate but not weight updates, so weight sync always addresses
`worker_urls`. Embedded engines run `sys.executable -m megatron_rl.engine.server ...`; SGLang
engines run `sglang.launch_server` (rollout/sglang_launcher.py builds those command lines).
A start that dies or stays unhealthy raises `LaunchError` with the tail of that process's log.

No orphans: every engine and the router start in their own process group with PR_SET_PDEATHSIG
(SIGKILL when the launching process dies, even by SIGKILL; SGLang's own subprocesses do the same
towards their parent), and `stop()` signals the whole group (SIGTERM, then SIGKILL). Embedded
engines also watch their parent pid.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

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
    """A started subprocess (leader of its own process group) with its log file and how to start it again."""

    name: str
    """Human-readable role, e.g. 'engine 0' or 'router'."""
    proc: subprocess.Popen
    """The process handle."""
    url: str
    """Base URL it serves."""
    log_path: str
    """File receiving its stdout and stderr."""
    cmd: list[str] = field(default_factory=list)
    """argv it was started with (restarts reuse it)."""
    env: Optional[dict] = None
    """Environment it was started with (None = inherited)."""
    restarts: int = 0
    """How many times it was restarted."""

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

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the process's whole group (its subprocesses included); no-op once it is gone."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the process group, then SIGKILL after `timeout_s`; always reaps the leader."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # children the leader left behind (e.g. SGLang schedulers) go with the group
        self.signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=timeout_s)

    def restart(self) -> None:
        """Stop (if still running) and start again with the same command, environment and log file."""
        self.stop()
        self.proc = _popen(self.cmd, self.log_path, self.env)
        self.restarts += 1


@dataclass
class RolloutCluster:
    """Running engines (and router); use as a context manager or call `stop()`."""

    engines: list[ManagedProcess] = field(default_factory=list)
    """Engine processes."""
    router: Optional[ManagedProcess] = None
    """sglang-router process, if started."""
    startup_timeout_s: float = 120.0
    """Health wait of a (re)start."""

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

    def owns(self, url: str) -> bool:
        """Whether `url` is one of the engines started here."""
        return any(e.url == url.rstrip("/") for e in self.engines)

    def restart_engine(self, url: str) -> None:
        """Restart the engine serving `url` on the same port and wait for its /health (LaunchError on failure)."""
        engine = next(e for e in self.engines if e.url == url.rstrip("/"))
        engine.restart()
        wait_healthy(engine, "/health", self.startup_timeout_s)

    def stop(self) -> None:
        """Stop the router, then every engine (each with its process group)."""
        procs = ([self.router] if self.router else []) + list(self.engines)
        for p in procs:
            if p.proc.poll() is None:
                p.signal_group(signal.SIGTERM)
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


_LIBC = None


def _die_with_parent_preexec(parent_pid: int):
    """preexec_fn: PR_SET_PDEATHSIG(SIGKILL) in the child, so it dies with the process that started it.

    The kernel sends the signal when the *thread* that forked exits, so start engines from a
    thread that lives as long as the run (the main thread). libc is loaded before the fork.
    """
    global _LIBC
    if not sys.platform.startswith("linux"):
        return None
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    libc = _LIBC

    def preexec() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _popen(cmd: list[str], log_path: str, env: Optional[dict]) -> subprocess.Popen:
    """Start `cmd` as the leader of a new process group, output appended to `log_path`, dying with this process."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent_preexec(os.getpid()))
    except OSError as exc:
        raise LaunchError(f"cannot start {cmd[0]!r}: {exc}") from None
    finally:
        log.close()  # the child holds its own descriptor


def _spawn(name: str, cmd: list[str], url: str, log_dir: str, env: Optional[dict] = None) -> ManagedProcess:
    log_path = os.path.join(log_dir, name.replace(" ", "_") + ".log")
    return ManagedProcess(name, _popen(cmd, log_path, env), url, log_path, list(cmd), env)


def public_host(bind_host: str) -> str:
    """Host name other processes use to reach a server bound to `bind_host` (the node's name for a wildcard bind)."""
    return socket.gethostname() if bind_host in ("", "0.0.0.0", "::") else bind_host


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


def router_command(worker_urls: Sequence[str], port: int, host: str = "127.0.0.1", policy: str = "round_robin",
                   extra_args: Sequence[str] = ()) -> list[str]:
    """argv of the real sglang-router in front of `worker_urls` (it probes each worker's /health)."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r} must be one of {ROUTER_POLICIES}")
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", policy, "--host", host, "--port", str(port),
            # the default 30 s between startup checks would dominate a CPU run's start time
            "--worker-startup-check-interval", "1",
            # a dead worker leaves the rotation after 2 failed checks 5 s apart (default: 3 x 60 s);
            # a restarted one is back after 1 good check. Requests that hit it meanwhile are retried
            # on another worker by the router itself (--retry-max-retries, default 5).
            "--health-check-interval-secs", "5", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--log-level", "warn",
            # its metrics exporter defaults to port 29000: two routers on one machine would collide
            "--prometheus-host", host, "--prometheus-port", str(free_port(host)), *extra_args]


@dataclass
class EngineSpec:
    """How to start one engine: its argv for a given port, and its environment."""

    command: Callable[[int], list[str]]
    """argv of the engine listening on the given port."""
    env: Optional[dict] = None
    """Environment (None = inherited), e.g. with the engine's CUDA_VISIBLE_DEVICES."""


def start_cluster(specs: Sequence[EngineSpec], *, host: str = "127.0.0.1", base_port: int = 0,
                  use_router: bool = False, router_policy: str = "round_robin", startup_timeout_s: float = 120.0,
                  log_dir: Optional[str] = None, router_args: Sequence[str] = (),
                  api_key: Optional[str] = None) -> RolloutCluster:
    """Start every engine of `specs`, wait for each /health, then optionally the router; all stopped on any failure.

    Ports are free ports unless `base_port` > 0 (engine i: base_port + i, router: base_port + len(specs)).
    """
    if not specs:
        raise ValueError("at least one engine is needed")
    if use_router:
        import importlib.util

        if importlib.util.find_spec("sglang_router") is None:
            raise LaunchError("rollout.use_router needs the sglang-router package (pip install sglang-router)")
    log_dir = log_dir or tempfile.mkdtemp(prefix="megatron_rl_rollout_")
    os.makedirs(log_dir, exist_ok=True)
    cluster = RolloutCluster(startup_timeout_s=startup_timeout_s)
    url_host = public_host(host)
    try:
        for i, spec in enumerate(specs):
            port = base_port + i if base_port > 0 else free_port(host)
            cluster.engines.append(_spawn(f"engine {i}", spec.command(port), f"http://{url_host}:{port}", log_dir, spec.env))
        for e in cluster.engines:
            wait_healthy(e, "/health", startup_timeout_s)
        if use_router:
            port = base_port + len(specs) if base_port > 0 else free_port(host)
            # with a key the router requires it from clients and authorizes itself to the workers with it
            key_args = ["--api-key", api_key] if api_key else []
            cluster.router = _spawn("router", router_command(cluster.worker_urls, port, host, router_policy,
                                                             [*key_args, *router_args]),
                                    f"http://{url_host}:{port}", log_dir)
            wait_router(cluster.router, len(cluster.engines), startup_timeout_s, api_key=api_key)
        return cluster
    except BaseException:
        cluster.stop()
        raise


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
    if num_engines < 1:
        raise ValueError("num_engines must be >= 1")
    parent = os.getpid()

    def spec(i: int) -> EngineSpec:
        return EngineSpec(lambda port: engine_command(model_path, port, host, tokenizer_path, random_seed + i, model_loader,
                                                      num_threads, engine_args, deterministic=deterministic,
                                                      parent_pid=parent, kv_cache_dtype=kv_cache_dtype,
                                                      api_key=api_key, max_n=max_n))

    return start_cluster([spec(i) for i in range(num_engines)], host=host, base_port=base_port, use_router=use_router,
                         router_policy=router_policy, startup_timeout_s=startup_timeout_s, log_dir=log_dir,
                         router_args=router_args, api_key=api_key)


def wait_router(router: ManagedProcess, num_workers: int, timeout_s: float, api_key: Optional[str] = None) -> None:
    """Wait until the router lists `num_workers` healthy workers and answers /health (a router given
    --api-key guards its worker list with the key)."""
    from megatron_rl.rollout.topology import router_workers

    deadline = time.monotonic() + timeout_s
    wait_healthy(router, "/health", timeout_s)
    last = "no answer"
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            break
        try:
            workers = router_workers(router.url, healthy_only=True, api_key=api_key)
            if workers is not None and len(workers) >= num_workers:
                return
            last = f"{len(workers or [])}/{num_workers} workers registered"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise LaunchError(f"router ({router.url}) did not register {num_workers} workers in {timeout_s:g} s "
                      f"(last: {last}); log tail:\n{router.log_tail()}")


def _launch_embedded(cfg, precision, model_path: str, tokenizer_path: Optional[str], log_dir: Optional[str],
                     model_loader: Optional[str] = None, num_threads: int = 1,
                     launch_dir: Optional[str] = None) -> RolloutCluster:
    """rollout.engine=embedded: CPU engines speaking the SGLang protocol, started in the rollout format (an engine
    keeps the format it starts in: weight updates are checked against it)."""
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint

    model_path = write_launch_checkpoint(model_path, precision, launch_dir or os.path.join(log_dir or ".", "launch"))
    return launch_engines(model_path, cfg.num_engines, tokenizer_path=tokenizer_path, host=cfg.host,
                          base_port=cfg.base_port, random_seed=cfg.seed, model_loader=model_loader,
                          num_threads=num_threads, use_router=cfg.use_router, router_policy=cfg.router_policy,
                          startup_timeout_s=cfg.startup_timeout_s, log_dir=log_dir,
                          deterministic=cfg.deterministic_inference, kv_cache_dtype=precision.kv_cache_dtype,
                          api_key=cfg.api_key, max_n=engine_max_n(cfg.n_samples_per_prompt),
                          engine_args=["--weight-update-timeout-s", str(cfg.weight_sync.timeout_s)]
                          # colocated: released weights come back on resume, as SGLang's flag of the same name does
                          + (["--enable-weights-cpu-backup"] if cfg.placement == "colocated" else []))


def _launch_sglang(cfg, precision, model_path: str, tokenizer_path: Optional[str], log_dir: Optional[str],
                   model_loader: Optional[str] = None, num_threads: int = 1,
                   launch_dir: Optional[str] = None) -> RolloutCluster:
    """rollout.engine=sglang: real SGLang servers on this node's free GPUs (rollout/sglang_launcher.py)."""
    if model_loader is not None:
        raise ValueError("model_loader applies to embedded engines only")
    from megatron_rl.rollout.sglang_launcher import launch_sglang_engines

    return launch_sglang_engines(cfg, precision, model_path, log_dir=log_dir, launch_dir=launch_dir)


ENGINE_LAUNCHERS: dict[str, Callable[..., RolloutCluster]] = {"embedded": _launch_embedded, "sglang": _launch_sglang}
"""rollout.engine value -> function starting that kind of engine (external engines are not started here)."""


def launch_from_config(cfg, model_path: str, tokenizer_path: Optional[str] = None, model_loader: Optional[str] = None,
                       log_dir: Optional[str] = None, num_threads: int = 1, precision=None,
                       launch_dir: Optional[str] = None) -> RolloutCluster:
    """Start the engines a `RolloutConfig` asks for (engine=embedded or sglang) under the `PrecisionConfig`.

    `launch_dir` receives the checkpoint SGLang engines start from when the weights must first be
    converted to the rollout format.
    """
    if cfg.engine not in ENGINE_LAUNCHERS:
        raise ValueError(f"rollout.engine={cfg.engine!r}: engines of this kind are not started here; "
                         "external servers are reached through rollout.urls")
    if precision is None:
        from megatron_rl.config.precision import PrecisionConfig

        precision = PrecisionConfig()
    return ENGINE_LAUNCHERS[cfg.engine](cfg, precision, model_path, tokenizer_path, log_dir, model_loader, num_threads,
                                        launch_dir)


@contextlib.contextmanager
def engines(model_path: str, num_engines: int = 1, **kwargs) -> Iterator[RolloutCluster]:
    """Context manager form of `launch_engines`."""
    cluster = launch_engines(model_path, num_engines, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()
