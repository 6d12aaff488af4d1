"""One HTTP request to an engine or a proxy, for tests: (status, JSON body or text), HTTP errors included."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def call(url: str, path: str, body=None, method: str = "POST", headers=None) -> tuple[int, object]:
    """(status, JSON or text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode()
