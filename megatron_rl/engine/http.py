"""HTTP plumbing of the embedded rollout server (aiohttp): API key, bounded body reading, off-loop JSON.

- `api_key_middleware`: SGLang's `--api-key` rule (python/sglang/srt/utils/auth.py): with a key set,
  every request needs `Authorization: Bearer <key>` (scheme case-insensitive, constant-time
  compare) except OPTIONS and paths under /health and /metrics; others get 401 {"error": "Unauthorized"}.
- `body_middleware`: reads every request body before its handler runs, bounded in size (a 413 naming
  the limit; a declared Content-Length over the limit is refused before a byte of the body is read)
  and in time (a body that does not arrive within the read timeout gets a 408 and its connection is
  closed), so no handler can stall on a half-sent upload and the event loop never buffers more than the
  limit. aiohttp's own `client_max_size` enforces the size while reading (a per-request clone carries
  the route's limit). A body that does not decode as its Content-Encoding says (or ends before its
  Content-Length) gets a 400 naming the header.
- `read_json`: the body as a JSON object, parsed on a worker thread when large.
- `SERVER_LOG`: aiohttp's connection logger (pass it as the request handler's `logger`), with the
  sglang-router's HTTP/2 probe logged at DEBUG: the router opens an HTTP/2 prior-knowledge (h2c)
  connection to each worker to learn the protocol it speaks; aiohttp's HTTP/1.1 parser refuses the
  preface with a 400 and closes the connection (which is the answer the probe needs: the router then
  talks HTTP/1.1), but logs the refusal with a traceback at ERROR. Nothing is wrong, so nothing is an
  error; SGLang itself (uvicorn) refuses the same preface with a one-line warning. Every other malformed
  request (aiohttp's `HttpProcessingError`: a bad request line, header or chunk, a line too long; its
  `RequestHandler.handle_error` logs it with a traceback at ERROR) is one WARNING line without traceback, as
  uvicorn's "Invalid HTTP request received.", and at most `BAD_REQUEST_LINES` of them per
  `BAD_REQUEST_WINDOW_S`; the rest are counted in one "suppressed K similar messages" line when their window
  ends, so a flood of garbage cannot fill a disk. A client that closes its socket mid-request (ConnectionResetError)
  gets the same treatment under a limiter of its own. Other errors keep their traceback.
- `listening_socket` / `write_port_file`: the server binds the port it serves on itself (port 0: one the OS
  picks) and reports it in a file, so a launcher never hands it a probed port another process could take first.

json.loads holds the interpreter lock for the whole parse (so does every C JSON parser), so a thread
keeps the event loop free only between parses: the body limit is what bounds the longest stall of
/health (about 0.5 s for a 16 MB body of token ids on one core).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Awaitable, Callable, Iterable, Iterator, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

# Paths SGLang leaves open with --api-key: liveness probes and metrics scrapers carry no secret.
UNAUTHENTICATED_PREFIXES = ("/health", "/metrics")
# Bodies at most this large are parsed on the event loop (a thread hop costs more than the parse).
INLINE_PARSE_MAX_BYTES = 64 * 1024
MB = 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


HTTP2_PREFACE_SIGNS = ("PRI", "HTTP/2")
"""What aiohttp's HTTP/1.1 parsers say when a connection opens with the HTTP/2 preface (`PRI * HTTP/2.0`)."""


def is_http2_preface_error(exc: object) -> bool:
    """Whether `exc` is the HTTP/1.1 parser refusing an HTTP/2 connection preface."""
    from aiohttp.http_exceptions import HttpProcessingError

    return isinstance(exc, HttpProcessingError) and any(sign in str(exc) for sign in HTTP2_PREFACE_SIGNS)


BAD_REQUEST_LINES = 10
"""Malformed-request lines logged per BAD_REQUEST_WINDOW_S at most (the rest are counted in one summary line)."""
BAD_REQUEST_WINDOW_S = 10.0
"""Window (seconds) of BAD_REQUEST_LINES."""


class RateLimitedLines:
    """At most `max_lines` lines per `window_s` to a logger; lines past that are counted and reported as one
    "suppressed K similar messages" line when their window ends (from a timer on the running event loop, or
    with the next line when no loop runs the timer)."""

    def __init__(self, logger: logging.Logger, max_lines: int, window_s: float, clock=time.monotonic,
                 what: str = "malformed HTTP requests") -> None:
        """Limit lines to `logger`; `what` names the lines in the summary; `clock` gives seconds (injected by tests)."""
        self.logger, self.max_lines, self.window_s, self.clock = logger, max_lines, window_s, clock
        self.what = what
        self.window_start = float("-inf")
        self.lines = 0
        self.suppressed = 0
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args) -> None:
        """Log one line unless this window's `max_lines` are spent (then count it)."""
        with self._lock:
            self._roll()
            if self.lines < self.max_lines:
                self.lines += 1
                self.logger.log(level, msg, *args)
                return
            self.suppressed += 1
            first = self.suppressed == 1
            delay = self.window_start + self.window_s - self.clock()
        if first:
            try:
                asyncio.get_running_loop().call_later(max(delay, 0.0) + 0.01, self.flush)
            except RuntimeError:
                pass  # no loop here: the next line reports the count

    def flush(self) -> None:
        """Report the lines suppressed in a window that has ended."""
        with self._lock:
            self._roll()

    def _roll(self) -> None:
        if self.clock() - self.window_start < self.window_s:
            return
        if self.suppressed:
            self.logger.warning("suppressed %d similar messages in the last %g s (%s)",
                                self.suppressed, self.window_s, self.what)
        self.window_start, self.lines, self.suppressed = self.clock(), 0, 0


def one_line(exc: BaseException, max_chars: int = 300) -> str:
    """`Type: message` of an exception on one line (aiohttp's parser errors span several), at most `max_chars`."""
    return clip(f"{type(exc).__name__}: {exc}", max_chars)


def clip(text: str, max_chars: int = 300) -> str:
    """`text` on one line, at most `max_chars` (the end replaced by "..."): what a client sent stays bounded in a log."""
    text = " ".join(text.split())
    return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger: refused HTTP/2 prefaces (sglang-router's protocol probe) at DEBUG, other malformed
    requests one rate-limited WARNING line each, no traceback (see the module docstring)."""

    def __init__(self, logger: logging.Logger) -> None:
        """Wrap aiohttp's server logger."""
        super().__init__(logger, {})
        self.bad_requests = RateLimitedLines(logger, BAD_REQUEST_LINES, BAD_REQUEST_WINDOW_S)
        self.client_errors = RateLimitedLines(logger, BAD_REQUEST_LINES, BAD_REQUEST_WINDOW_S,
                                              what="requests whose client closed the connection or sent an unreadable body")

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:  # noqa: D102 - logging.Logger.exception
        from aiohttp.http_exceptions import HttpProcessingError

        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if is_http2_preface_error(exc):
            self.logger.debug("refused an HTTP/2 connection (this server speaks HTTP/1.1; sglang-router's protocol "
                              "probe then uses HTTP/1.1): " + str(msg), *args)
            return
        if isinstance(exc, HttpProcessingError):
            where = str(msg) % args if args else str(msg)
            self.bad_requests.log(logging.WARNING, "malformed HTTP request refused (%s): %s", where, one_line(exc))
            return
        if isinstance(exc, ConnectionResetError):
            # the client closed its socket mid-request (while sending its body, or before its answer was written):
            # nothing on this side is wrong and nobody is left to answer, as uvicorn, which logs nothing for it
            where = str(msg) % args if args else str(msg)
            self.client_errors.log(logging.WARNING, "client closed the connection mid-request (%s): %s", where,
                                   one_line(exc))
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


SERVER_LOG = _ServerLog(logging.getLogger("aiohttp.server"))
"""The `logger` of the engine's aiohttp request handlers (see the module docstring)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), ready for aiohttp (`web.run_app(sock=...)`); port 0: the OS picks it.

    SO_REUSEADDR as asyncio's `create_server` sets it on POSIX (a restart may bind a port in TIME_WAIT);
    OSError (EADDRINUSE: "Address already in use") when the port is taken.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def write_port_file(path: str, port: int) -> None:
    """Write `port` to `path` atomically (a complete file appears at once; a launcher polls for it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


class BadRequest(ValueError):
    """A client error answered with HTTP 400 and the message."""


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's JSON error body."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def bearer_matches(authorization: Optional[str], api_key: str) -> bool:
    """Whether an Authorization header is `Bearer <api_key>` (constant-time, as SGLang compares)."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return secrets.compare_digest(token.encode(), api_key.encode())


def api_key_middleware(api_key: str):
    """Require `Authorization: Bearer <api_key>` on every path except OPTIONS, /health* and /metrics*."""
    if not api_key:
        raise ValueError("api_key must be a non-empty string")

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(UNAUTHENTICATED_PREFIXES):
            return await handler(request)
        if not bearer_matches(request.headers.get("Authorization"), api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check_api_key


def _close_after(response: web.StreamResponse) -> web.StreamResponse:
    """Close the connection once the response is sent (aiohttp first drains what the client is still
    sending for a few seconds, so a client that sends its whole body before reading still sees the answer)."""
    response.force_close()
    return response


async def _send_and_drop(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Send the response and close the connection at once: a stalled sender gets no lingering drain."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


def body_middleware(max_body_bytes: int, read_timeout_s: float,
                    large_body_paths: Iterable[str] = (), max_large_body_bytes: Optional[int] = None):
    """Read each request body up front within `max_body_bytes` and `read_timeout_s` (paths in
    `large_body_paths`, e.g. tensor weight updates, get `max_large_body_bytes`)."""
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    if read_timeout_s <= 0:
        raise ValueError("read_timeout_s must be > 0")
    large = frozenset(large_body_paths)
    large_limit = max(max_large_body_bytes or max_body_bytes, max_body_bytes)

    @web.middleware
    async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists:
            return await handler(request)
        limit = large_limit if request.path in large else max_body_bytes
        flag = "--max-weight-body-mb" if request.path in large else "--max-body-mb"
        too_large = (f"request body exceeds the server's limit of {_fmt_bytes(limit)} ({flag}); "
                     "send a smaller request or restart the server with a larger limit")
        declared = request.content_length
        if declared is not None and declared > limit:
            return _close_after(error_response(f"{too_large} (Content-Length: {declared})", 413))
        if request.client_max_size != limit:
            request = request.clone(client_max_size=limit)
        try:
            await asyncio.wait_for(request.read(), read_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            return _close_after(error_response(too_large, 413))
        except RequestPayloadError as exc:
            # aiohttp decodes Content-Encoding itself; a body that is not what its header says (or that ends
            # before its Content-Length) is the client's error, as a JSON body that does not parse
            cause = exc.__cause__ or exc
            SERVER_LOG.client_errors.log(logging.WARNING, "request body of %s %s refused: %s", request.method,
                                         clip(request.path, 100), one_line(cause))
            encoding = request.headers.get("Content-Encoding")
            hint = (f" (Content-Encoding: {clip(encoding, 40)}; send the body encoded so, or without the header)"
                    if encoding else "")
            # dropped at once: aiohttp's lingering drain of the rest would re-raise the same error with a traceback
            return await _send_and_drop(request, error_response(f"request body could not be read: {one_line(cause)}{hint}"))
        except asyncio.TimeoutError:
            return await _send_and_drop(request, error_response(
                f"request body not received within {read_timeout_s:g} s (--read-timeout-s); closing the connection", 408))
        return await handler(request)

    return read_body


def _fmt_bytes(n: int) -> str:
    return f"{n / MB:g} MB" if n >= MB else f"{n} bytes"


class _GcPause:
    """Counts the threads decoding JSON; the collector is off while any is (and back on after, if it was on)."""

    lock = threading.Lock()
    pausers = 0
    reenable = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while JSON is decoded (nestable across threads).

    Decoding creates no reference cycles, but each container it allocates counts toward the next
    collection; in a server holding a model (many tracked objects) a body of a million small lists
    triggered full collections that held the interpreter lock for ~10 s, stalling /health.
    """
    with _GcPause.lock:
        if _GcPause.pausers == 0:
            _GcPause.reenable = gc.isenabled()
            gc.disable()
        _GcPause.pausers += 1
    try:
        yield
    finally:
        with _GcPause.lock:
            _GcPause.pausers -= 1
            if _GcPause.pausers == 0 and _GcPause.reenable:
                gc.enable()


def parse_json_object(raw: bytes, allow_empty: bool = False) -> dict:
    """The body as a JSON object, with every way it can fail to decode turned into BadRequest."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body must be a JSON object")
    try:
        with gc_paused():
            body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise BadRequest("invalid JSON body: nested too deeply") from None
    except ValueError as exc:  # bad UTF-8, integers past Python's digit limit
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def read_json(request: web.Request, allow_empty: bool = False) -> dict:
    """The request's JSON object (BadRequest on malformed JSON); large bodies are parsed off the event loop."""
    raw = await request.read()
    if len(raw) <= INLINE_PARSE_MAX_BYTES:
        return parse_json_object(raw, allow_empty)
    return await asyncio.get_running_loop().run_in_executor(None, parse_json_object, raw, allow_empty)
