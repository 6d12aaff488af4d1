"""Malformed HTTP requests log one line each, rate-limited, no traceback (unhandled, aiohttp's
RequestHandler.handle_error writes an ERROR traceback per request; engine/http.py).

Raw bytes no HTTP/1.1 parser accepts are sent over sockets to an embedded server: each is answered 400 as
before, the server stays healthy, and its log holds at most BAD_REQUEST_LINES lines per window plus one
"suppressed K similar messages" line, never "Traceback". Both in-process (caplog) and in a `megatron-rl serve`
subprocess's own log file.

Run: pytest -q tests/test_bad_request_log.py
"""
from __future__ import annotations

import logging
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
import torch

from megatron_rl.engine import http
from megatron_rl.engine.testing import ThreadedServer, make_tiny_model

torch.set_num_threads(1)

MALFORMED = [
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",  # BadHttpMessage
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",  # LineTooLong
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",  # InvalidHeader
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",  # bad chunk size
    b"GET / HTTP/9.9\r\n\r\n",  # bad version
]


def send_raw(url: str, raw: bytes) -> bytes:
    """Send `raw` on a fresh connection; the answer's status line."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n" not in data and (chunk := sock.recv(4096)):
            data += chunk
    return data.split(b"\r\n", 1)[0]


def flood(url: str, n: int) -> None:
    for i in range(n):
        status = send_raw(url, MALFORMED[i % len(MALFORMED)])
        assert status.split(b" ")[1] == b"400", status


def healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        return resp.status == 200


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("badlog")
    make_tiny_model(str(root / "m"))
    return str(root / "m")


@pytest.fixture
def limiter(monkeypatch):
    """SERVER_LOG's limiter with a fresh window of 1 s (the count of lines per window is the shipped one)."""
    fresh = http.RateLimitedLines(logging.getLogger("aiohttp.server"), http.BAD_REQUEST_LINES, 1.0)
    monkeypatch.setattr(http.SERVER_LOG, "bad_requests", fresh)
    return fresh


def test_rate_limit_counts_what_it_drops():
    records = []

    class Sink(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("test_bad_request_log.unit")
    logger.propagate = False
    logger.addHandler(Sink())
    logger.setLevel(logging.INFO)
    now = [100.0]
    lines = http.RateLimitedLines(logger, 3, 10.0, clock=lambda: now[0])
    for i in range(8):
        lines.log(logging.WARNING, "bad %d", i)
    assert records == ["bad 0", "bad 1", "bad 2"]
    now[0] += 9.9
    lines.flush()
    assert len(records) == 3, "the window has not ended"
    now[0] += 0.2
    lines.flush()
    assert records[3] == "suppressed 5 similar messages in the last 10 s (malformed HTTP requests)"
    lines.log(logging.WARNING, "bad %d", 8)
    lines.flush()
    assert records[4:] == ["bad 8"], "a new window logs again, and nothing was suppressed in it"


def test_malformed_requests_log_one_line_each_rate_limited(model, limiter, caplog):
    with ThreadedServer(model) as srv:
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            flood(srv.url, 40)
            assert healthy(srv.url)
            time.sleep(1.3)  # the window ends: its timer reports what it dropped
        records = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.INFO]
    lines = [r.getMessage() for r in records]
    refused = [m for m in lines if m.startswith("malformed HTTP request refused")]
    assert len(refused) == http.BAD_REQUEST_LINES, lines
    assert lines[-1] == f"suppressed {40 - http.BAD_REQUEST_LINES} similar messages in the last 1 s (malformed HTTP requests)"
    assert len(lines) == len(refused) + 1, lines
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in records)
    assert all("\n" not in m for m in lines)
    assert any("LineTooLong" in m for m in refused) and any("127.0.0.1" in m for m in refused)


def test_other_server_errors_keep_their_traceback(caplog):
    with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
        try:
            raise RuntimeError("a real bug")
        except RuntimeError:
            http.SERVER_LOG.exception("Error handling request from %s", "127.0.0.1")
    assert caplog.records[-1].exc_info is not None and caplog.records[-1].levelno == logging.ERROR


def test_a_served_engine_log_has_no_traceback(model, tmp_path):
    from megatron_rl.rollout.launcher import launch_engines

    with launch_engines(model, 1, log_dir=str(tmp_path)) as cluster:
        url = cluster.worker_urls[0]
        flood(url, 3 * http.BAD_REQUEST_LINES)
        assert healthy(url)
    log = (tmp_path / "engine_0.log").read_text()
    refused = [ln for ln in log.splitlines() if "malformed HTTP request refused" in ln]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert 1 <= len(refused) <= http.BAD_REQUEST_LINES, refused


def reset_mid_body(url: str) -> None:
    """Send half a body, then close the socket with a reset (SO_LINGER 0), as a client killed mid-upload."""
    import struct

    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"input_ids\": [")
    time.sleep(0.05)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_client_gone_mid_body_logs_one_line_rate_limited(model, monkeypatch, caplog):
    now = [0.0]  # the window ends when the test says so
    fresh = http.RateLimitedLines(logging.getLogger("aiohttp.server"), http.BAD_REQUEST_LINES, 10.0,
                                  clock=lambda: now[0], what=http.SERVER_LOG.client_errors.what)
    monkeypatch.setattr(http.SERVER_LOG, "client_errors", fresh)
    n = 3 * http.BAD_REQUEST_LINES
    with ThreadedServer(model) as srv:
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            for _ in range(n):
                reset_mid_body(srv.url)
            time.sleep(0.5)
            assert healthy(srv.url)
            now[0] += 11.0
            fresh.flush()
        records = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.INFO]
    lines = [r.getMessage() for r in records]
    gone = [m for m in lines if m.startswith("client closed the connection mid-request")]
    assert len(gone) == http.BAD_REQUEST_LINES, lines
    assert lines[-1].startswith("suppressed ") and "closed the connection" in lines[-1], lines
    assert len(lines) == len(gone) + 1, lines
    assert all(r.exc_info is None and "\n" not in r.getMessage() and len(r.getMessage()) < 600 for r in records), lines


def test_a_failed_disk_update_logs_one_bounded_line_rate_limited(model, caplog):
    long_path = "/nonexistent/" + "p" * 50_000
    with ThreadedServer(model) as srv:
        with caplog.at_level(logging.INFO, logger="megatron_rl.engine.server"):
            for _ in range(3 * http.BAD_REQUEST_LINES):
                req = urllib.request.Request(srv.url + "/update_weights_from_disk", method="POST",
                                             data=('{"model_path": "%s"}' % long_path).encode())
                try:
                    urllib.request.urlopen(req, timeout=30)
                    raise AssertionError("the update must fail")
                except urllib.error.HTTPError as exc:
                    assert exc.code == 400 and b"success" in exc.read()
        lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.engine.server"
                 and r.levelno >= logging.WARNING]
    failed = [m for m in lines if "update_weights_from_disk failed" in m]
    assert len(failed) == http.BAD_REQUEST_LINES, lines  # the window (10 s) has not ended: the rest are counted
    assert all(len(m) < 700 and m.count("/nonexistent/") == 1 for m in failed), failed[0][:1000]
