"""A stand-in of SGLang 0.5.23's weight-update session rules: an HTTP reverse proxy in front of a rollout engine.

    with SessionStandin(engine_url, server_info="forward") as proxy:   # background thread, 127.0.0.1
        ... point a run at proxy.url ...
        proxy.records                                                  # every request it saw

    python tests/session_standin.py --backend http://127.0.0.1:30000 --port 31000   # standalone, until Ctrl-C

It is written from SGLang 0.5.23's own source (the released wheel: srt/entrypoints/http_server.py,
srt/managers/scheduler_components/weight_updater.py, srt/managers/io_struct.py, srt/utils/auth.py), not
from the embedded engine's compat layer, so it checks the trainer's session handling independently of it:

- `POST /begin_weight_update {selector}` opens the session; selector is "target", "draft" or "all" (the
  default); a second begin while one is open is a 400 `{"success": false, "message": "a weight-update
  session is already open; call end_weight_update() first"}`. `POST /end_weight_update {}` closes it; without
  one it is a 400 `{"success": false, "message": "no weight-update session is open; call
  begin_weight_update() first"}`. Both routes are POST-only (FastAPI answers 405 to other methods).
- `POST /update_weights_from_distributed` and `/update_weights_from_tensor` outside a session are a 400
  `{"success": false, "message": "<op> must run between begin_weight_update() and end_weight_update()"}`
  and never reach the engine (a refused distributed update joins no broadcast).
- Everything else (any method, path, query, headers including Authorization, body) is forwarded and the
  engine's status and body come back unchanged.

The stand-in keeps the session itself and also forwards begin/end to the engine behind it: an engine
with sessions (`megatron-rl serve`, 0.5.23 mode) then opens and closes its own in step; one without them
(0.5.8 mode answers 404) leaves the stand-in to answer them alone. What it says about itself on
/server_info and /get_server_info is `server_info`: "forward" (the engine's answer unchanged, so a 0.5.8
engine behind it still says 0.5.8), "declare" (the engine's answer with "version": "0.5.23": what a
0.5.23 server reports, the faithful choice), or "own" (it answers `{"version": "0.5.23"}` itself, without
the engine's tp_size or device). A client must cope with all three.

With `api_key`, the answers it gives itself are guarded as SGLang guards these ADMIN_OPTIONAL routes
(401 `{"error": "Unauthorized"}` without `Authorization: Bearer <api_key>`); forwarded requests are the
engine's to check.

SGLang's source is only read to write these rules; nothing of it is imported or copied.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import ClientSession, ClientTimeout, web

VERSION = "0.5.23"
"""The SGLang version whose rules this stand-in enforces (and declares, in the "declare" and "own" modes)."""
BEGIN, END = "/begin_weight_update", "/end_weight_update"
GUARDED = ("/update_weights_from_distributed", "/update_weights_from_tensor")
"""The updates 0.5.23 refuses outside a session."""
SELECTORS = ("target", "draft", "all")
"""BeginWeightUpdateReqInput.selector values."""
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NONE_OPEN = "no weight-update session is open; call begin_weight_update() first"
SERVER_INFO_MODES = ("forward", "declare", "own")
"""How the stand-in answers /server_info (module docstring)."""
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
              "proxy-authenticate", "host", "content-length", "content-encoding"}
"""Headers that describe one connection (or an encoding the proxy's client already undid): never copied across."""


def refusal(path: str) -> str:
    """SGLang 0.5.23's message refusing the update at `path` outside a session."""
    return f"{path.lstrip('/')} must run between begin_weight_update() and end_weight_update()"


@dataclass
class Record:
    """One request the stand-in saw."""

    method: str
    path: str
    in_session: bool
    """Whether a session was open when the request arrived."""
    status: int
    """The HTTP status the client got."""
    forwarded: bool
    """Whether the request reached the engine."""
    weight_version: Optional[str] = None
    """The body's weight_version, on weight updates that carry one."""


class SessionStandin:
    """The proxy (module docstring), served from a background thread on 127.0.0.1; a context manager."""

    def __init__(self, backend_url: str, server_info: str = "declare", api_key: Optional[str] = None,
                 port: int = 0, host: str = "127.0.0.1") -> None:
        """Forward to `backend_url`; `server_info` one of SERVER_INFO_MODES; `port` 0 lets the OS choose."""
        if server_info not in SERVER_INFO_MODES:
            raise ValueError(f"server_info must be one of {SERVER_INFO_MODES}, got {server_info!r}")
        self.backend = backend_url.rstrip("/")
        self.server_info_mode = server_info
        self.api_key = api_key
        self.host, self.port = host, port
        self.url = ""
        self.records: list[Record] = []
        self.session_open = False
        self.sessions_opened = 0
        self._lock: Optional[asyncio.Lock] = None
        self._http: Optional[ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    # ------------------------------------------------------------------ what the tests read
    def updates(self) -> list[Record]:
        """The records of the session-guarded updates (distributed and tensor), in arrival order."""
        return [r for r in self.records if r.path in GUARDED]

    def refused(self) -> list[Record]:
        """Guarded updates the stand-in refused (outside a session)."""
        return [r for r in self.updates() if not r.in_session]

    def clear(self) -> None:
        """Forget the records (the session state stays)."""
        self.records.clear()

    # ------------------------------------------------------------------ request handling
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Apply the session rules to one request; forward what they allow."""
        path, body = request.path, await request.read()
        in_session = self.session_open
        if path in (BEGIN, END):
            response, forwarded = await self._session_call(request, body)
        elif path in GUARDED and request.method == "POST" and not in_session:
            response, forwarded = self._own(request, 400, {"success": False, "message": refusal(path)}), False
        elif path in ("/server_info", "/get_server_info") and self.server_info_mode == "own":
            response, forwarded = self._own(request, 200, {"version": VERSION}), False
        else:
            response, forwarded = await self._forward(request, body), True
            if path in ("/server_info", "/get_server_info") and self.server_info_mode == "declare" \
                    and response.status == 200:
                info = json.loads(response.body)
                info["version"] = VERSION
                response = web.json_response(info)
        self.records.append(Record(request.method, path, in_session, response.status, forwarded,
                                   _weight_version(body) if path in GUARDED else None))
        return response

    async def _session_call(self, request: web.Request, body: bytes) -> tuple[web.Response, bool]:
        """/begin_weight_update or /end_weight_update: the stand-in's rule first, then the engine's (404: it has none)."""
        if request.method != "POST":
            return web.json_response({"detail": "Method Not Allowed"}, status=405), False
        async with self._lock:
            if request.path == BEGIN:
                try:
                    selector = (json.loads(body) if body.strip() else {}).get("selector", "all")
                except (ValueError, AttributeError):
                    selector = None
                if selector not in SELECTORS:
                    return self._own(request, 400, {"object": "error", "type": "Bad Request", "code": 400,
                                                    "message": f"selector={selector!r} is not one of {SELECTORS}"}), False
                if self.session_open:
                    return self._own(request, 400, {"success": False, "message": ALREADY_OPEN}), False
            elif not self.session_open:
                return self._own(request, 400, {"success": False, "message": NONE_OPEN}), False
            response = await self._forward(request, body)
            if response.status == 404:  # the engine has no sessions: the stand-in alone keeps them
                response = self._own(request, 200, {"success": True, "message": "Success"})
            if response.status == 401:
                return response, True
            if request.path == BEGIN and response.status == 200:
                self.session_open = True
                self.sessions_opened += 1
            elif request.path == END:
                self.session_open = False  # SGLang closes whatever the runners said
            return response, True

    def _own(self, request: web.Request, status: int, body: dict) -> web.Response:
        """An answer the stand-in gives itself, behind SGLang's key check (with only api_key set, ADMIN_OPTIONAL and
        NORMAL routes both want it)."""
        if self.api_key is not None and request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response(body, status=status)

    async def _forward(self, request: web.Request, body: bytes) -> web.Response:
        """The engine's answer to the same request (502 when it cannot be reached)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            async with self._http.request(request.method, self.backend + request.rel_url.path_qs, data=body,
                                          headers=headers) as resp:
                data = await resp.read()
                out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
                return web.Response(status=resp.status, body=data, headers=out)
        except Exception as exc:  # noqa: BLE001 - the client sees it as a bad gateway
            return web.json_response({"error": f"stand-in: engine unreachable: {type(exc).__name__}: {exc}"},
                                     status=502)

    # ------------------------------------------------------------------ serving
    def _run(self, ready: threading.Event) -> None:
        async def serve() -> None:
            self._lock = asyncio.Lock()
            # weight updates may wait long on the engine (a broadcast); no total timeout, like a plain proxy
            self._http = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10))
            app = web.Application(client_max_size=1 << 31)
            app.router.add_route("*", "/{tail:.*}", self.handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://{self.host}:{self.port}"
            self._stop = asyncio.Event()
            ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()
                await self._http.close()

        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            ready.set()
        finally:
            self._loop.close()

    def start(self, timeout_s: float = 30.0) -> "SessionStandin":
        """Serve from a background thread; return once it answers."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name="session-standin")
        self._thread.start()
        ready.wait(timeout_s)
        if self._error is not None or not self.url:
            raise RuntimeError(f"session stand-in did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> "SessionStandin":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _weight_version(body: bytes) -> Optional[str]:
    """weight_version of a JSON body, if it has one."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    v = data.get("weight_version") if isinstance(data, dict) else None
    return None if v is None else str(v)


def main() -> None:
    """Serve a stand-in in front of --backend until interrupted; print each request as it completes."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, help="URL of the engine behind the stand-in")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    p.add_argument("--server-info", default="declare", choices=SERVER_INFO_MODES, help="how /server_info is answered")
    p.add_argument("--api-key", default=None, help="key guarding the answers the stand-in gives itself")
    args = p.parse_args()
    with urllib.request.urlopen(args.backend.rstrip("/") + "/health", timeout=10):
        pass
    with SessionStandin(args.backend, args.server_info, args.api_key, args.port) as proxy:
        print(f"session stand-in at {proxy.url} -> {proxy.backend}", flush=True)
        seen = 0
        try:
            while True:
                time.sleep(0.2)
                for r in proxy.records[seen:]:
                    print(f"{r.status} {r.method} {r.path} in_session={r.in_session} forwarded={r.forwarded}", flush=True)
                seen = len(proxy.records)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
