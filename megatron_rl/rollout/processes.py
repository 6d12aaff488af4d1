"""Rollout subprocesses (engines, sglang-router): their command lines and environments, start, health, stop.

Shared by both launchers (rollout/launcher.py: embedded CPU engines and the engine registry;
rollout/sglang_launcher.py: real SGLang servers), which import this module and never each other's
internals. A cluster is first *planned* (`plan_cluster`: every process's exact argv, port and
environment changes) and then started from that plan (`start_cluster`), so `megatron-rl engines
--dry-run` prints exactly what a real start runs.

Environment of every child: the launcher's own, minus the variables a distributed launcher
(torchrun) sets for *its* workers (`LAUNCHER_ENV_NAMES`, `LAUNCHER_ENV_PREFIXES`: RANK, WORLD_SIZE,
MASTER_ADDR, TORCHELASTIC_USE_AGENT_STORE, ...). A child that inherited them would take part in
the trainer's rendezvous: torch makes every SGLang TP rank a client of a TCP store that does not
exist and its own rendezvous waits forever. Plus the process's own settings (an engine's
CUDA_VISIBLE_DEVICES). `env_changes` gives that difference as {name: value, removed name: None}.

No orphans: every engine and the router start in their own process group with PR_SET_PDEATHSIG
(SIGKILL when the launching process dies, even by SIGKILL; SGLang's own subprocesses do the same
towards their parent), and `stop()` signals the whole group (SIGTERM, then SIGKILL).
A start that dies or stays unhealthy raises `LaunchError` with the tail of that process's log.

Ports (with `base_port` 0): a port probed free and bound later by the child can be taken in between by
another process on the node. So a process binds the port it serves on: an engine that can report its
port (`EngineSpec.port_file_flag`; the embedded engine's `--port-file`) starts with `--port 0`, binds a
port the OS picks and writes it to a file in the log directory, which the launcher reads before the
health check (its URL, a restart's command and the router's worker list use that port). SGLang engines
and sglang-router cannot report a port, so they get a probed one, and a start that exits because the
port was taken (`PORT_TAKEN_SIGNS` in the output of that start) is retried on a fresh port, at most
`PORT_ATTEMPTS` times. Fixed ports (`base_port` > 0) are the user's layout and never changed: a start that
finds one taken is tried again on the same port `FIXED_PORT_RETRY_S` later (a previous job's process may still be
exiting), `PORT_ATTEMPTS` starts in all, then fails naming the port and the fields that fix it. The router's
metrics exporter always gets a probed port (its default, 29000, is one port for every router on a node): a
start that panics because that port was taken (`METRICS_PORT_TAKEN`) is started again on the same serving
port with a fresh metrics port, fixed serving port or not.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

ROUTER_POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")
PORT_ATTEMPTS = 3
"""Starts of a process on a probed port before a port taken each time is reported (see the module docstring)."""
PORT_TAKEN_SIGNS = (re.compile(r"address already in use", re.IGNORECASE),
                    re.compile(r" at \d+ is not available in \d+ seconds"))
"""What a start's output says when its port was taken: the OS's EADDRINUSE text, as uvicorn (SGLang's HTTP server),
Python and Rust (sglang-router) print it, and SGLang's own port wait (python/sglang/srt/utils/network.py:
wait_port_available, "<name> at <port> is not available in <n> seconds")."""
FIXED_PORT_RETRY_S = 5.0
"""Wait before a start on a fixed port that was in use is tried again on the same port."""
METRICS_PORT_TAKEN = re.compile(r"failed to install Prometheus metrics exporter.*address already in use",
                                re.IGNORECASE)
"""sglang-router's panic when its --prometheus-port was taken (src/server/startup, metrics::start_prometheus):
only the metrics port collided, so the serving port stays."""

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A rollout subprocess failed to start or become healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` (it may be taken again before use: `start_cluster` retries a start
    on a port taken in between)."""
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
    """Full environment it was started with."""
    restarts: int = 0
    """How many times it was restarted."""
    log_start: int = 0
    """Offset in `log_path` where the current start's output begins (earlier starts' output precedes it)."""

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

    def start_output(self, max_chars: int = 20000) -> str:
        """The last `max_chars` of what the current start wrote to its log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self.log_start, os.path.getsize(self.log_path) - max_chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def relaunch(self, cmd: list[str], url: str) -> None:
        """Start again (after its start failed) with `cmd`, serving `url`; restarts keep this command."""
        self.stop()
        self.cmd, self.url = list(cmd), url
        self.log_start = _log_size(self.log_path)
        self.proc = _popen(self.cmd, self.log_path, self.env)

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
        self.log_start = _log_size(self.log_path)
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


def _flag(cmd: Sequence[str], name: str) -> Optional[str]:
    """The value after `name` in a command line (None when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd and cmd.index(name) + 1 < len(cmd) else None


def launch_identity(cmd: Sequence[str], url: str) -> dict:
    """What an engine started with `cmd` on `url` reports as its own in /server_info (SGLang's ServerArgs fields,
    which the embedded engine reports too): model_path, port, random_seed; empty for a command that is no engine's."""
    model = _flag(cmd, "--model-path")
    if model is None:
        return {}
    want: dict = {"model_path": model, "port": int(url.rsplit(":", 1)[-1])}
    if (seed := _flag(cmd, "--random-seed")) is not None:
        want["random_seed"] = int(seed)
    return want


def _answers_as_itself(proc: ManagedProcess) -> tuple[bool, str]:
    """(whether /server_info at proc.url is the engine `proc` started, description): a process that took the port
    first answers /health as well, with another model, port or seed (or no /server_info at all)."""
    want = launch_identity(proc.cmd, proc.url)
    if not want:
        return True, ""
    key = _flag(proc.cmd, "--api-key")
    req = urllib.request.Request(proc.url + "/server_info", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"/health answered but /server_info did not ({type(exc).__name__}: {exc})"
    got = {k: info.get(k) for k in want} if isinstance(info, dict) else {}
    if got != want:
        return False, (f"another process answers on {proc.url}: its /server_info reports {got}, this engine was "
                       f"started with {want}")
    return True, ""


def wait_healthy(proc: ManagedProcess, path: str, timeout_s: float, poll_s: float = 0.25) -> None:
    """Poll `proc.url + path` until 2xx from `proc` itself (an engine's /server_info names its launch: model path,
    port, seed); LaunchError (with the log tail) if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if proc.proc.poll() is not None:
            raise LaunchError(f"{proc.name} ({proc.url}) exited with code {proc.proc.returncode} while starting; "
                              f"log tail ({proc.log_path}):\n{proc.log_tail()}")
        ok, last = _http_ok(proc.url + path)
        if ok:
            ok, why = _answers_as_itself(proc)
            if ok:
                return
            last = why
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


def _log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _spawn(name: str, cmd: list[str], url: str, log_dir: str, env: Optional[dict] = None) -> ManagedProcess:
    """Start one managed process; `env` None = this process's environment without the launcher variables."""
    env = apply_env(env_changes()) if env is None else env
    log_path = os.path.join(log_dir, name.replace(" ", "_") + ".log")
    start = _log_size(log_path)
    return ManagedProcess(name, _popen(cmd, log_path, env), url, log_path, list(cmd), env, log_start=start)


def port_taken(output: str) -> bool:
    """Whether a start's output says its port was taken (`PORT_TAKEN_SIGNS`)."""
    return any(sign.search(output) for sign in PORT_TAKEN_SIGNS)


def wait_port_file(proc: ManagedProcess, path: str, timeout_s: float, poll_s: float = 0.05) -> int:
    """The port `proc` wrote to `path` once it bound its socket; LaunchError (with the log tail) if it exits first
    or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass  # not written yet (the writer renames a complete file into place)
        if proc.proc.poll() is not None:
            raise LaunchError(f"{proc.name} exited with code {proc.proc.returncode} before it reported its port; "
                              f"log tail ({proc.log_path}):\n{proc.log_tail()}")
        if time.monotonic() >= deadline:
            raise LaunchError(f"{proc.name} did not report its port in {path} within {timeout_s:g} s; "
                              f"log tail ({proc.log_path}):\n{proc.log_tail()}")
        time.sleep(poll_s)


def public_host(bind_host: str) -> str:
    """Host name other processes use to reach a server bound to `bind_host` (the node's name for a wildcard bind)."""
    return socket.gethostname() if bind_host in ("", "0.0.0.0", "::") else bind_host


LAUNCHER_ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
"""Variables torchrun sets for its workers that no engine or router may inherit (see the module docstring)."""
LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_", "ROLE_")
"""Prefixes of the other torchrun worker variables (TORCHELASTIC_USE_AGENT_STORE, ROLE_RANK, ...)."""


def launcher_variables(base: Mapping[str, str]) -> list[str]:
    """Names to remove from a child's environment: every LAUNCHER_ENV_NAMES entry (present or not, so the
    change list says what a child never sees) and each variable of `base` with a LAUNCHER_ENV_PREFIXES prefix."""
    return list(LAUNCHER_ENV_NAMES) + sorted(n for n in base if n.startswith(LAUNCHER_ENV_PREFIXES))


def env_changes(settings: Optional[Mapping[str, str]] = None, base: Optional[Mapping[str, str]] = None) -> dict[str, Optional[str]]:
    """A child's environment as changes to `base` (default os.environ): launcher variables removed (None), then `settings` set."""
    base = os.environ if base is None else base
    changes: dict[str, Optional[str]] = {name: None for name in launcher_variables(base)}
    changes.update(settings or {})
    return changes


def apply_env(changes: Mapping[str, Optional[str]], base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The full environment `changes` (from `env_changes`) make of `base` (default os.environ)."""
    env = dict(os.environ if base is None else base)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


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
    """How to start one engine: its argv for a given port, and what it sets in its environment."""

    command: Callable[[int], list[str]]
    """argv of the engine listening on the given port."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for this engine (e.g. its CUDA_VISIBLE_DEVICES); launcher variables are removed in any case."""
    port_file_flag: Optional[str] = None
    """Flag naming the file an engine started on port 0 writes its bound port to (embedded: --port-file); None: the engine gets a probed port (retried on a fresh one when it was taken)."""


@dataclass
class PlannedProcess:
    """One process a cluster start runs: name, exact argv, the URL it will serve, its environment changes."""

    name: str
    """'engine i' or 'router'."""
    argv: list[str]
    """Command line."""
    url: str
    """Base URL it serves."""
    env: dict[str, Optional[str]]
    """Changes to the launcher's environment: value = set, None = removed (`env_changes`)."""
    port_file: Optional[str] = None
    """File the process writes the port it bound to (it starts on port 0; its planned URL says port 0)."""
    command: Optional[Callable[[int], list[str]]] = field(default=None, repr=False, compare=False)
    """argv on a given port: a restart on the reported port, or a retry on a fresh one."""
    probed: bool = False
    """Its port was probed free, so a start that finds it taken is retried on another (`PORT_ATTEMPTS`)."""

    def to_json(self) -> dict:
        """{"argv": [...], "env": {name: value or null}}: one line of `megatron-rl engines --dry-run`."""
        return {"argv": list(self.argv), "env": dict(self.env)}


@dataclass
class ClusterPlan:
    """Every process of a cluster start, in start order (engines, then the router)."""

    engines: list[PlannedProcess]
    """Engine processes."""
    router: Optional[PlannedProcess] = None
    """The sglang-router, when one starts."""

    @property
    def processes(self) -> list[PlannedProcess]:
        """Engines then the router."""
        return self.engines + ([self.router] if self.router else [])


PLANNED_LOG_DIR = "<log_dir>"
"""Stands for the log directory in a plan made without one (port files live there)."""


def plan_cluster(specs: Sequence[EngineSpec], *, host: str = "127.0.0.1", base_port: int = 0, use_router: bool = False,
                 router_policy: str = "round_robin", router_args: Sequence[str] = (),
                 api_key: Optional[str] = None, log_dir: Optional[str] = None) -> ClusterPlan:
    """Ports, argv and environment of every process `start_cluster` would run (nothing starts).

    With `base_port` > 0: engine i on base_port + i, the router on base_port + len(specs). Otherwise an
    engine that reports its port starts on port 0 with its port file in `log_dir` (its URL, and the router's
    worker list here, say port 0: the real ones are known once it bound), and the others get probed ports.
    """
    if not specs:
        raise ValueError("at least one engine is needed")
    url_host = public_host(host)
    engines = []
    for i, spec in enumerate(specs):
        name = f"engine {i}"
        if base_port == 0 and spec.port_file_flag:
            port_file = os.path.join(log_dir or PLANNED_LOG_DIR, name.replace(" ", "_") + ".port")
            engines.append(PlannedProcess(name, [*spec.command(0), spec.port_file_flag, port_file], f"http://{url_host}:0",
                                          env_changes(spec.env), port_file=port_file, command=spec.command))
            continue
        port = base_port + i if base_port > 0 else free_port(host)
        engines.append(PlannedProcess(name, spec.command(port), f"http://{url_host}:{port}", env_changes(spec.env),
                                      command=spec.command, probed=base_port == 0))
    router = plan_router([e.url for e in engines], host=host, port=base_port + len(specs) if base_port > 0 else 0,
                         policy=router_policy, router_args=router_args, api_key=api_key) if use_router else None
    return ClusterPlan(engines, router)


def plan_router(worker_urls: Sequence[str], *, host: str = "127.0.0.1", port: int = 0, policy: str = "round_robin",
                router_args: Sequence[str] = (), api_key: Optional[str] = None) -> PlannedProcess:
    """The sglang-router in front of `worker_urls` on `port` (0: a probed port, retried when taken)."""
    # with a key the router requires it from clients and authorizes itself to the workers with it
    extra = [*(["--api-key", api_key] if api_key else []), *router_args]

    def command(p: int) -> list[str]:
        return router_command(worker_urls, p, host, policy, extra)

    chosen = port or free_port(host)
    return PlannedProcess("router", command(chosen), f"http://{public_host(host)}:{chosen}", env_changes(),
                          command=command, probed=port == 0)


def start_cluster(specs: Sequence[EngineSpec], *, host: str = "127.0.0.1", base_port: int = 0,
                  use_router: bool = False, router_policy: str = "round_robin", startup_timeout_s: float = 120.0,
                  log_dir: Optional[str] = None, router_args: Sequence[str] = (),
                  api_key: Optional[str] = None) -> RolloutCluster:
    """Start every engine of `specs` (as `plan_cluster` plans them), wait for each /health, then optionally the
    router; all stopped on any failure."""
    if use_router:
        import importlib.util

        if importlib.util.find_spec("sglang_router") is None:
            raise LaunchError("rollout.use_router needs the sglang-router package (pip install sglang-router)")
    log_dir = log_dir or tempfile.mkdtemp(prefix="megatron_rl_rollout_")
    os.makedirs(log_dir, exist_ok=True)
    plan = plan_cluster(specs, host=host, base_port=base_port, log_dir=log_dir)
    cluster = RolloutCluster(startup_timeout_s=startup_timeout_s)
    try:
        for p in plan.engines:
            if p.port_file:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p.port_file)  # a previous run's file in the same log directory names a stale port
            cluster.engines.append(_spawn(p.name, p.argv, p.url, log_dir, apply_env(p.env)))
        for e, p in zip(cluster.engines, plan.engines):
            _until_serving(e, p, host, lambda proc: wait_healthy(proc, "/health", startup_timeout_s), startup_timeout_s)
        if use_router:
            cluster.router = start_router(cluster.worker_urls, host=host,
                                          port=base_port + len(specs) if base_port > 0 else 0, policy=router_policy,
                                          router_args=router_args, api_key=api_key, log_dir=log_dir,
                                          startup_timeout_s=startup_timeout_s)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def start_router(worker_urls: Sequence[str], *, log_dir: str, host: str = "127.0.0.1", port: int = 0,
                 policy: str = "round_robin", router_args: Sequence[str] = (), api_key: Optional[str] = None,
                 startup_timeout_s: float = 120.0, name: str = "router") -> ManagedProcess:
    """Start the sglang-router in front of `worker_urls` on `port` (0: a probed one) and wait until it lists them all
    healthy; a start whose port or metrics port was taken is retried (module docstring); stopped on any failure."""
    planned = plan_router(worker_urls, host=host, port=port, policy=policy, router_args=router_args, api_key=api_key)
    router = _spawn(name, planned.argv, planned.url, log_dir, apply_env(planned.env))
    try:
        _until_serving(router, planned, host, lambda proc: wait_router(proc, len(worker_urls), startup_timeout_s,
                                                                      api_key=api_key), startup_timeout_s)
    except BaseException:
        router.stop()
        raise
    return router


def _until_serving(proc: ManagedProcess, planned: PlannedProcess, host: str, wait: Callable[[ManagedProcess], None],
                   timeout_s: float) -> None:
    """Wait (`wait`) until `proc` serves: first read the port it reported, if it reports one; a start on a probed
    port that exits because the port was taken is started again on a fresh one (`PORT_ATTEMPTS` starts in all)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            if planned.port_file:
                port = wait_port_file(proc, planned.port_file, timeout_s)
                proc.url = f"http://{public_host(host)}:{port}"
                if planned.command is not None:
                    proc.cmd = planned.command(port)  # a restart binds the port this start reported
            wait(proc)
            return
        except LaunchError as exc:
            exited = proc.proc.poll() is not None
            output = proc.start_output() if exited else ""
            metrics_taken = bool(METRICS_PORT_TAKEN.search(output))
            fixed_taken = not metrics_taken and not planned.probed and port_taken(output)
            taken = metrics_taken or fixed_taken or (planned.probed and port_taken(output))
            if not taken or planned.command is None:
                raise
            if attempt == PORT_ATTEMPTS:
                if fixed_taken:
                    raise LaunchError(
                        f"{proc.name}: port {proc.url.rsplit(':', 1)[-1]} on {host} stayed in use by another process "
                        f"through {attempt} starts {FIXED_PORT_RETRY_S:g} s apart; it is a fixed port (rollout.base_port, "
                        "ENGINE_BASE_PORT / ROUTER_PORT in the Slurm scripts): stop what holds it, choose other ports, or "
                        "set rollout.base_port=0 for free ones") from None
                raise LaunchError(f"{proc.name}: a probed port was taken before it could bind it in {attempt} "
                                  f"starts; {exc}") from None
        serving_port = int(proc.url.rsplit(":", 1)[-1])
        if fixed_taken:
            # the user's layout: the same port again, a little later (a previous job's engine may still be exiting)
            log.warning("%s: its fixed port %d is in use; starting it again on the same port in %g s (%d/%d)",
                        proc.name, serving_port, FIXED_PORT_RETRY_S, attempt, PORT_ATTEMPTS)
            time.sleep(FIXED_PORT_RETRY_S)
            proc.relaunch(planned.command(serving_port), proc.url)
            continue
        if metrics_taken:
            # the command probes a fresh metrics port each time it is built
            log.warning("%s: its metrics port was taken before it bound it; starting it again", proc.name)
            proc.relaunch(planned.command(serving_port), proc.url)
            continue
        port = free_port(host)
        log.warning("%s: its port %s was taken before it bound it; starting it again on port %d", proc.name,
                    serving_port, port)
        proc.relaunch(planned.command(port), f"http://{public_host(host)}:{port}")


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


