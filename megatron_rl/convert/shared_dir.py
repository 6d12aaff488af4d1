"""A directory built once from a source and then only read, safe when many processes on many nodes start at once.

Several `megatron-rl engines` commands (one per engine node, all started together by the Slurm scripts)
need the same derived checkpoint (`<run_dir>/weights/launch_<format>`). `publish_once` makes sure it
is built by one of them and never rewritten while another reads it, using only operations that stay
atomic on NFS-like shared filesystems (no fcntl locks, whose NFS support varies):

- the output appears only by `os.rename` of a finished temporary sibling directory, whose last file
  is a completion marker (`MARKER`) recording what it was built from: an identity (e.g. the rollout
  format), the source files' (name, size, mtime) and a sha256 of their contents;
- a process reuses an existing output whose marker has its identity and either the same source stat
  (fast path) or the same content digest (a re-exported but identical source); a matching output is
  never touched again;
- the builder is whoever creates the lock directory `<out>.lock` (`os.mkdir` is atomic); the others
  poll for the marker. The builder refreshes a heartbeat file in the lock while it works; a lock whose
  heartbeat has not changed for `stale_after_s` of the waiter's own clock (no cross-node clock
  comparison) and whose owner is not a live process of this host, or whose owner is a dead process on this
  host, is broken by renaming it away (atomic, one breaker wins) and the waiters compete again; the next
  holder removes only leftover build directories whose builder is gone (dead here, or its heartbeat has
  stopped touching the directory, by the filesystem's own clock).
- an output with a different or missing marker (another source, or written by older code) is replaced
  by the lock holder only: the new one is built beside it and swapped in by two renames.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

MARKER = ".launch_complete.json"
"""Completion marker inside a published directory (written last, before the directory is renamed into place)."""
_CHUNK = 16 * 1024 * 1024


def source_stat(files: Sequence[Path]) -> list[list]:
    """[name, size, mtime_ns] of each source file, sorted by name: the fast, probably-unchanged check."""
    out = []
    for f in sorted(files, key=lambda p: p.name):
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def source_digest(files: Sequence[Path]) -> str:
    """sha256 over each source file's name, size and bytes (sorted by name): equal exactly when the contents are."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _read_marker(out: str) -> Optional[dict]:
    try:
        with open(os.path.join(out, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # absent, being swapped, or a torn write of an older layout: not a match


class _Source:
    """The facts a marker is compared with; the content digest is computed at most once, on demand."""

    def __init__(self, identity: dict, files: Sequence[Path]):
        self.identity = json.loads(json.dumps(identity))  # as it reads back from the marker
        self.files = list(files)
        self.stat = source_stat(self.files)
        self._digest: Optional[str] = None

    def digest(self) -> str:
        if self._digest is None:
            self._digest = source_digest(self.files)
        return self._digest

    def matches(self, marker: Optional[dict]) -> bool:
        if not marker or marker.get("identity") != self.identity:
            return False
        return marker.get("stat") == self.stat or marker.get("digest") == self.digest()


class _Lock:
    """Ownership of `<out>.lock` while building, with a heartbeat thread that shows the owner is alive."""

    def __init__(self, path: str, token: str, heartbeat_s: float):
        self.path, self.token, self.heartbeat_s = path, token, heartbeat_s
        self.owner = os.path.join(path, "owner.json")
        self.building: Optional[str] = None
        """The build directory, whose mtime the heartbeat refreshes too (what another host's waiter sees of us)."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> bool:
        try:
            os.mkdir(self.path)
        except FileExistsError:
            return False
        with open(self.owner, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": self.token}, f)
        self._thread = threading.Thread(target=self._beat, name="shared-dir-heartbeat", daemon=True)
        self._thread.start()
        return True

    def _beat(self) -> None:
        n = 0
        while not self._stop.wait(self.heartbeat_s):
            n += 1
            if self.building is not None:
                with contextlib.suppress(OSError):
                    os.utime(self.building)
            try:  # content changes too, so a filesystem with coarse mtimes still shows progress
                with open(os.path.join(self.path, "heartbeat"), "w") as f:
                    f.write(str(n))
            except OSError:
                return  # the lock was broken under us; the swap's own checks still keep readers safe

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        shutil.rmtree(self.path, ignore_errors=True)


def _lock_state(lock: str) -> tuple:
    """What a waiter watches for progress: the owner record and the heartbeat file's stat/content."""
    facts = []
    for name in ("owner.json", "heartbeat"):
        p = os.path.join(lock, name)
        try:
            st = os.stat(p)
            with open(p) as f:
                facts.append((st.st_mtime_ns, f.read()))
        except OSError:
            facts.append(None)
    return tuple(facts)


def _alive_here(host: object, pid: object) -> Optional[bool]:
    """Whether process `pid` of `host` is alive, when `host` is this host (None: another host's, or unknowable)."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True if isinstance(pid, int) else None  # EPERM: it exists, as another user's
    return True


def _owner_alive_here(lock: str) -> Optional[bool]:
    """Whether the lock's owner (a process of this host) is alive; None when it is another host's or unrecorded."""
    try:
        with open(os.path.join(lock, "owner.json")) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return _alive_here(owner.get("host"), owner.get("pid")) if isinstance(owner, dict) else None


def _owner_dead_here(lock: str) -> bool:
    """True when the lock's owner is a process of this host that no longer exists."""
    return _owner_alive_here(lock) is False


def _leftover_dead(path: str, token: str, stale_after_s: float) -> bool:
    """Whether a leftover `<out>.tmp-<token>` / `.stale-<token>` belongs to a builder that is gone: a dead process of this
    host, or (another host's) one whose directory its heartbeat has not touched for `stale_after_s`, both times read
    from the filesystem itself (a file written now), so no two nodes' clocks are compared."""
    host, _, rest = token.rpartition("-")[0].rpartition("-")  # token: <host>-<pid>-<hex>
    alive = _alive_here(host, int(rest) if rest.isdigit() else None)
    if alive is not None:
        return not alive
    probe = f"{path}.probe-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "w"):
            pass
        now = os.stat(probe).st_mtime
        return now - os.stat(path).st_mtime > stale_after_s
    except OSError:
        return False  # gone already, or unreadable: leave it
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def _break(lock: str, token: str) -> None:
    broken = f"{lock}.broken-{token}"
    try:
        os.rename(lock, broken)
    except OSError:
        return  # another waiter broke it first, or its owner finished
    shutil.rmtree(broken, ignore_errors=True)


def publish_once(out: str, identity: dict, source_files: Sequence[Path], build: Callable[[str], None], *,
                 poll_s: float = 0.2, heartbeat_s: float = 5.0, stale_after_s: float = 120.0,
                 timeout_s: Optional[float] = None) -> str:
    """`out`, built by `build(tmp_dir)` from `source_files` unless a complete one for the same identity and source
    exists; concurrent callers (any host sharing the filesystem) wait for one builder. Returns `out`."""
    out = os.path.abspath(out)
    src = _Source(identity, source_files)
    token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lock = _Lock(out + ".lock", token, heartbeat_s)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    seen, seen_at = None, time.monotonic()
    while True:
        if src.matches(_read_marker(out)):
            return out
        if lock.acquire():
            try:
                return _build_locked(out, src, build, token, lock, stale_after_s)
            finally:
                lock.release()
        state = _lock_state(lock.path)
        now = time.monotonic()
        if state != seen:
            seen, seen_at = state, now
        elif (now - seen_at > stale_after_s and not _owner_alive_here(lock.path)) or _owner_dead_here(lock.path):
            # a live owner on this host is never broken, however long its heartbeat stalls (a build holding the
            # interpreter, a stopped process): breaking it would let the next holder remove its build directory
            _break(lock.path, token)
            seen, seen_at = None, now
        if deadline is not None and now > deadline:
            raise TimeoutError(f"{out}: waited {timeout_s:.0f}s for the process holding {lock.path} to finish it")
        time.sleep(poll_s)


def _build_locked(out: str, src: _Source, build: Callable[[str], None], token: str, lock: _Lock,
                  stale_after_s: float) -> str:
    """The lock holder's part: recheck, build beside `out`, mark complete, swap in (never over a matching one)."""
    if src.matches(_read_marker(out)):
        return out  # finished by the previous holder between our check and our lock
    parent, base = os.path.split(out)
    for name in os.listdir(parent):  # leftovers of builders that died; a live one's (its lock was broken) stays
        for prefix in (base + ".tmp-", base + ".stale-"):
            if name.startswith(prefix) and ".probe-" not in name and _leftover_dead(
                    os.path.join(parent, name), name[len(prefix):], stale_after_s):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    tmp = f"{out}.tmp-{token}"
    os.makedirs(tmp)
    lock.building = tmp
    try:
        digest = src.digest()
        build(tmp)
        marker = {"identity": src.identity, "stat": src.stat, "digest": digest, "built_by": token,
                  "built_at": time.time()}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        stale = None
        if os.path.lexists(out):  # a different source's (or an unmarked older) output: nobody of this source reads it
            stale = f"{out}.stale-{token}"
            os.rename(out, stale)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    return out
