"""SGLang's weight-update sessions, from the trainer's side: which engines need them, and opening/closing them.

SGLang 0.5.23 refuses `/update_weights_from_distributed` and `/update_weights_from_tensor` unless a
session is open (`POST /begin_weight_update {"selector": "all"}` ... `POST /end_weight_update {}`, one
at a time; managers/scheduler_components/weight_updater.py). A refused distributed update never
joins the broadcast, so without the session the trainer's broadcast would wait out its timeout.
0.5.8 has no such endpoints. Disk updates need no session in either.

Whether an engine has sessions is learned once per engine: from the SGLang version its /server_info
declares ("version"; versions this project read from the wheels are in KNOWN_SESSIONS, newer ones
keep them), else by a side-effect-free probe: `GET /begin_weight_update` answers 405 (the route
exists, POST only) where sessions exist and 404 where they do not.

The transports open one session per sync on every engine that has them, after pausing generation
(`WeightTransport.begin`), and close it in `finish()`, which runs on every path, failed syncs included
(rollout/sync/base.py). A session left open by a trainer that died mid-sync is closed and reopened,
with a warning: the engines take weights from one trainer.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Optional, Sequence

BEGIN_PATH = "/begin_weight_update"
END_PATH = "/end_weight_update"
BEGIN_BODY = {"selector": "all"}
"""The /begin_weight_update body (BeginWeightUpdateReqInput: every runner, target and draft)."""
END_BODY: dict = {}
"""The /end_weight_update body (EndWeightUpdateReqInput has no fields)."""
KNOWN_SESSIONS = {(0, 5, 8): False, (0, 5, 23): True}
"""SGLang versions read from their wheels -> whether they have weight-update sessions."""
ALREADY_OPEN = "already open"
"""What SGLang's refusal of a second /begin_weight_update says."""


def parse_version(text: Any) -> Optional[tuple[int, ...]]:
    """(major, minor, patch) of an SGLang version string ('0.5.23', '0.5.23.post1', 'v0.5.8rc0'), None otherwise."""
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", str(text or ""))
    return tuple(int(g) for g in m.groups()) if m else None


def sessions_by_version(version: Any) -> Optional[bool]:
    """Whether SGLang `version` has weight-update sessions; None when the version alone does not tell (probe)."""
    v = parse_version(version)
    if v is None:
        return None
    if v in KNOWN_SESSIONS:
        return KNOWN_SESSIONS[v]
    if v > max(k for k, has in KNOWN_SESSIONS.items() if has):
        return True
    if v < min(k for k, has in KNOWN_SESSIONS.items() if not has):
        return False
    return None  # between two known versions: the release that introduced sessions was not read


async def probe_sessions(client, url: str) -> bool:
    """Whether the engine at `url` has /begin_weight_update (405 to a GET: the POST route exists; 404: it does not)."""
    (answer,) = await client.call_each(BEGIN_PATH, method="GET", urls=[url])
    if isinstance(answer, BaseException):
        if "HTTP 405" in str(answer):
            return True
        if "HTTP 404" in str(answer):
            return False
        raise answer
    return True  # answered a GET: the endpoint exists


def _error(url: str, path: str, answer: Any) -> Optional[str]:
    """Why one session call failed (None when it succeeded)."""
    if isinstance(answer, BaseException):
        return str(answer)
    if not isinstance(answer, dict) or not answer.get("success"):
        return f"POST {url}{path} did not succeed: {answer!r}"
    return None


async def _post_each(client, urls: Sequence[str], path: str, body: dict, timeout_s: float) -> list[Optional[str]]:
    """POST to each URL concurrently; per URL the error message (None on success)."""
    if not urls:
        return []
    answers = await client.call_each(path, body, timeout_s=timeout_s, urls=urls)
    return [_error(u, path, a) for u, a in zip(urls, answers)]


async def open_sessions(client, urls: Sequence[str], timeout_s: float) -> list[str]:
    """Open a session on every engine in `urls`; returns them. On any failure closes them all again and raises."""
    from megatron_rl.rollout.client import RolloutServerError

    errors = await _post_each(client, urls, BEGIN_PATH, BEGIN_BODY, timeout_s)
    stale = [u for u, e in zip(urls, errors) if e is not None and ALREADY_OPEN in e]
    if stale:
        warnings.warn(f"rollout engine(s) {stale} had a weight-update session open (left by an earlier trainer?); "
                      "closing it and opening this sync's", RuntimeWarning, stacklevel=2)
        await _post_each(client, stale, END_PATH, END_BODY, timeout_s)
        again = dict(zip(stale, await _post_each(client, stale, BEGIN_PATH, BEGIN_BODY, timeout_s)))
        errors = [again.get(u, e) for u, e in zip(urls, errors)]
    failed = [(u, e) for u, e in zip(urls, errors) if e is not None]
    if failed:
        # every engine, the failed ones too: a begin that timed out or failed in transit may still have opened one
        await _post_each(client, urls, END_PATH, END_BODY, timeout_s)
        raise RolloutServerError("weight sync: could not open a weight-update session on "
                                 + "; ".join(f"{u}: {e}" for u, e in failed))
    return list(urls)


async def close_sessions(client, urls: Sequence[str], timeout_s: float) -> None:
    """Close the session on every engine in `urls` (all are tried); raises naming those that failed."""
    from megatron_rl.rollout.client import RolloutServerError

    failed = [(u, e) for u, e in zip(urls, await _post_each(client, urls, END_PATH, END_BODY, timeout_s)) if e]
    if failed:
        raise RolloutServerError("weight sync: could not close the weight-update session on "
                                 + "; ".join(f"{u}: {e}" for u, e in failed))
