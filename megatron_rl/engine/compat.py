"""Which SGLang version the embedded engine stands in for (`megatron-rl serve --sglang-compat 0.5.23|0.5.8`).

The rules below were read from the released wheels (python/sglang/srt/...) and are what a client
of that version meets:

- Weight-update sessions (0.5.23, managers/scheduler_components/weight_updater.py): an update from
  `/update_weights_from_distributed` or `/update_weights_from_tensor` outside
  `POST /begin_weight_update {selector}` ... `POST /end_weight_update {}` answers HTTP 400
  `{"success": false, "message": "<op> must run between begin_weight_update() and end_weight_update()"}`
  before anything is received (a refused distributed update never joins the broadcast); one session
  at a time (a second begin, or an end without a begin, is a 400 with the messages below); disk
  updates need no session. 0.5.8 has neither endpoint (404).
- Weight version: both report the live version on `/model_info`. 0.5.8 also updates `/server_info`
  (its server_args are edited in place); 0.5.23's `/server_info` keeps the startup value (updates go to
  a config-override bag only `/model_info` reads). `/get_weight_version` is a 404 in both (0.5.8 with
  a deprecation detail; 0.5.23 has no such route).
- `/server_info` and `/get_server_info` report the version as `"version"`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SELECTORS = ("target", "draft", "all")
"""`selector` values of /begin_weight_update (BeginWeightUpdateReqInput; default "all")."""
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
"""0.5.23's answer to /begin_weight_update while a session is open."""
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
"""0.5.23's answer to /end_weight_update without a session."""
SESSION_SUCCESS = "Success"
"""0.5.23's message of a successful begin or end."""
SESSION_OPS = ("update_weights_from_distributed", "update_weights_from_tensor")
"""The updates 0.5.23 refuses outside a session."""


def outside_session_message(op: str) -> str:
    """0.5.23's message refusing `op` (an entry of SESSION_OPS) outside a session."""
    return f"{op} must run between begin_weight_update() and end_weight_update()"


@dataclass(frozen=True)
class SGLangCompat:
    """What differs between the SGLang versions the embedded engine can declare."""

    version: str
    """The SGLang version reported as /server_info "version"."""
    weight_update_sessions: bool
    """/begin_weight_update and /end_weight_update exist and distributed/tensor updates need a session."""
    server_info_tracks_weight_version: bool
    """/server_info "weight_version" follows updates (else it keeps the startup value; /model_info always follows)."""
    weight_version_route_detail: Optional[str]
    """The 404 detail of /get_weight_version and /weight_version (None: no such route, a plain 404)."""


COMPAT_MODES: dict[str, SGLangCompat] = {
    "0.5.23": SGLangCompat("0.5.23", weight_update_sessions=True, server_info_tracks_weight_version=False,
                           weight_version_route_detail=None),
    "0.5.8": SGLangCompat("0.5.8", weight_update_sessions=False, server_info_tracks_weight_version=True,
                          weight_version_route_detail="Endpoint '/get_weight_version' or '/weight_version' is "
                                                      "deprecated. Please use '/model_info' instead."),
}
"""--sglang-compat value -> its rules."""
DEFAULT_COMPAT = "0.5.23"
"""The newest version, and the one the project pins (Dockerfile, conformance tier)."""


def compat_mode(version: str) -> SGLangCompat:
    """The rules of `version`; ValueError naming the known versions otherwise."""
    try:
        return COMPAT_MODES[version]
    except KeyError:
        raise ValueError(f"--sglang-compat {version!r} is not a version this engine can stand in for; "
                         f"known: {sorted(COMPAT_MODES)}") from None
