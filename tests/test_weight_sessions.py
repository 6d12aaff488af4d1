"""SGLang's weight-update sessions and version reporting, both sides: the embedded engine under
`--sglang-compat 0.5.23` (the default) and `0.5.8`, and the transports that learn which engines need a
session and close it on every failure path.

The engine's rules were read from the SGLang wheels (engine/compat.py has the exact messages); the
conformance tier checks them against the pinned source. Distributed updates inside and outside a
session are in tests/test_weight_receiver.py (they need an engine in another process).

Run: pytest -q tests/test_weight_sessions.py
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.engine.testing import ThreadedServer, make_tiny_model
from megatron_rl.rollout.client import RolloutClient, RolloutServerError
from megatron_rl.rollout.sync import TensorWeightSync, sessions
from http_calls import call
from test_weight_receiver import greedy, post, weights_of

OUTSIDE = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
OK = (200, {"success": True, "message": "Success"})


def get(url: str, path: str, body=None) -> tuple[int, object]:
    """(status, JSON or text) of a GET, or of a POST when `body` is given."""
    return call(url, path, body, method="GET" if body is None else "POST")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """{compat: url} of two engines serving the same tiny model, plus (target state, root)."""
    root = tmp_path_factory.mktemp("sessions")
    make_tiny_model(str(root / "base"), seed=0)
    target = make_tiny_model(str(root / "target"), seed=9)
    tsd = [(n, t) for n, t in target.state_dict().items() if n != "lm_head.weight"]
    with ThreadedServer(str(root / "base"), weight_version="w0") as new, \
            ThreadedServer(str(root / "base"), weight_version="w0", sglang_compat="0.5.8") as old:
        yield {"0.5.23": new, "0.5.8": old}, tsd, root


def _sync(transport, tsd, version, buckets: int = 3) -> None:
    transport.begin(version)
    transport.begin_stage(0, 1, version)
    step = -(-len(tsd) // buckets)
    for k in range(0, len(tsd), step):
        transport.send_bucket(tsd[k:k + step], final=k + step >= len(tsd))
    transport.end_stage()
    transport.commit(version)
    transport.finish()


def _restore(servers, root) -> None:
    for srv in servers.values():
        assert post(srv.url, "/update_weights_from_disk", {"model_path": str(root / "base"), "weight_version": "w0"})[0] == 200


def test_each_compat_version_answers_as_that_sglang(engines):
    servers, _, _ = engines
    new, old = servers["0.5.23"].url, servers["0.5.8"].url
    assert [i["version"] for i in RolloutClient([new, old]).server_info_sync()] == ["0.5.23", "0.5.8"]
    # 0.5.23: sessions, one at a time, a validated selector
    assert get(new, "/begin_weight_update")[0] == 405  # POST only: what the transports probe
    assert post(new, "/begin_weight_update", {"selector": "drafts"})[0] == 400
    assert post(new, "/end_weight_update", {}) == (400, {"success": False, "message": (
        "no weight-update session is open; call begin_weight_update() first")})
    assert post(new, "/begin_weight_update", {"selector": "target"}) == OK
    assert post(new, "/begin_weight_update", {"selector": "all"}) == (400, {"success": False, "message": (
        "a weight-update session is already open; call end_weight_update() first")})
    assert post(new, "/end_weight_update", {}) == OK
    assert post(new, "/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]}) == (
        400, {"success": False, "message": OUTSIDE})
    # 0.5.8: no session endpoints
    assert get(old, "/begin_weight_update", {"selector": "all"})[0] == 404
    assert get(old, "/begin_weight_update")[0] == 404
    # where each reports the weight version: /model_info in both, /server_info only in 0.5.8
    for url in (new, old):
        assert post(url, "/update_weight_version", {"new_version": "w1"})[0] == 200
    assert RolloutClient([new, old]).weight_versions_sync() == ["w1", "w1"]
    assert [i["weight_version"] for i in RolloutClient([new, old]).server_info_sync()] == ["w0", "w1"]
    assert get(new, "/get_weight_version")[0] == 404
    status, body = get(old, "/get_weight_version")
    assert status == 404 and "/model_info" in body["detail"]
    for url in (new, old):
        post(url, "/update_weight_version", {"new_version": "w0"})


def test_transports_open_a_session_only_where_the_engine_has_them(engines):
    servers, tsd, root = engines
    urls = [servers["0.5.23"].url, servers["0.5.8"].url]
    transport = TensorWeightSync(urls, bucket_mb=0.01, timeout_s=30)
    try:
        assert [(i["version"], i["sessions"]) for i in transport.engine_info()] == [("0.5.23", True), ("0.5.8", False)]
        # an update outside a session fails on the 0.5.23 engine: the CPU suite catches a transport that forgets it
        transport.begin_stage(0, 1, "x")
        with pytest.raises(RolloutServerError, match="must run between begin_weight_update"):
            transport.send_bucket(tsd[:2], final=False)
        _sync(transport, tsd, "s1")
        for url in urls:
            assert all(torch.equal(weights_of(url, n), t) for n, t in tsd)
            assert greedy(url)["meta_info"]["weight_version"] == "s1"
        events = [e["event"] for e in RolloutClient(urls[0]).server_info_sync()[0]["events"]]
        assert events[-4:] == ["session_begin", "update", "session_end", "generate"]
        assert "session_begin" not in [e["event"] for e in RolloutClient(urls[1]).server_info_sync()[0]["events"]]
    finally:
        transport.close()
        _restore(servers, root)


@pytest.mark.parametrize("declared,has", [("0.5.23.post2", True), ("0.5.7", False), ("0.5.15", None), ("", None)])
def test_the_route_decides_whatever_the_version_declares(engines, declared, has):
    """A proxy may forward an engine's /server_info while answering the session routes itself: what the probe of
    the route finds wins over the declared version (which only decides when the probe cannot answer)."""
    servers, _, _ = engines
    assert sessions.sessions_by_version(declared) is has
    for compat, srv in servers.items():
        real = srv.server.compat
        srv.server.compat = dataclasses.replace(real, version=declared)
        try:
            info = TensorWeightSync([srv.url], timeout_s=30).engine_info()[0]
        finally:
            srv.server.compat = real
        assert info["sessions"] is real.weight_update_sessions, (compat, declared)


def _paused(url: str) -> bool:
    return RolloutClient(url).server_info_sync()[0]["internal_states"][0]["paused"]


def test_the_session_is_closed_on_every_failure_path(engines):
    servers, tsd, root = engines
    url = servers["0.5.23"].url
    transport = TensorWeightSync([url], bucket_mb=0.01, timeout_s=30)
    try:
        # a bucket the engine refuses: finish() (which phases/weights.py always calls) closes the session and resumes
        transport.begin("bad")
        transport.begin_stage(0, 1, "bad")
        with pytest.raises(RolloutServerError, match="do not match the served model"):
            transport.send_bucket([(tsd[0][0], torch.zeros(3))], final=True)
        assert _paused(url)
        transport.finish()
        assert not _paused(url) and post(url, "/begin_weight_update", {}) == OK  # no session was left open
        # a session left open (a trainer killed mid-sync) is closed and this sync's opened, with a warning
        with pytest.warns(RuntimeWarning, match="had a weight-update session open"):
            _sync(transport, tsd[:4], "after-stale", buckets=1)
        assert post(url, "/end_weight_update", {})[0] == 400 and greedy(url)["meta_info"]["weight_version"] == "after-stale"
        # closing fails (someone closed it under us): finish still resumes generation, then reports it
        transport.begin("closed-under-us")
        assert post(url, "/end_weight_update", {}) == OK
        with pytest.raises(RolloutServerError, match="could not close the weight-update session.*no weight-update session"):
            transport.finish()
        assert not _paused(url) and transport.open_sessions == []
    finally:
        transport.close()
        _restore(servers, root)


def test_a_failed_open_closes_the_sessions_already_opened(engines, tmp_path, monkeypatch):
    servers, _, _ = engines
    make_tiny_model(str(tmp_path / "m"), seed=0)
    with ThreadedServer(str(tmp_path / "m")) as second:
        urls = [servers["0.5.23"].url, second.url]
        transport = TensorWeightSync(urls, timeout_s=30)
        real = RolloutClient.call_each

        async def refuse_second_begin(self, path, body=None, method="POST", timeout_s=None, urls=None):
            answers = await real(self, path, body, method, timeout_s, urls)
            if path == sessions.BEGIN_PATH and method == "POST":
                answers = [RolloutServerError(f"POST {u}{path} failed: HTTP 503: injected") if u == second.url else a
                           for u, a in zip(urls, answers)]
            return answers

        monkeypatch.setattr(RolloutClient, "call_each", refuse_second_begin)
        with pytest.raises(RolloutServerError, match=f"could not open a weight-update session on {second.url}.*injected"):
            transport.begin("v")
        monkeypatch.undo()
        assert transport.open_sessions == []
        for url in urls:  # both were closed again, the one whose begin "failed" in transit too
            assert post(url, "/begin_weight_update", {}) == OK and post(url, "/end_weight_update", {}) == OK
        transport.finish()
        assert not any(_paused(u) for u in urls)
