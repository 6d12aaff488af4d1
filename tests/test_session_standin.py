"""The trainer's weight syncs through an independent stand-in of SGLang 0.5.23's session rules.

tests/session_standin.py is a reverse proxy written from SGLang 0.5.23's source (not from the embedded
engine's compat layer): it keeps the weight-update session itself and refuses distributed/tensor updates
outside one. Here it stands in front of `megatron-rl serve` subprocesses (their default 0.5.23 mode, and
0.5.8 mode, where the stand-in alone provides the sessions), answering /server_info in each way a stand-in
plausibly would (forwarded, declaring 0.5.23, its own answer); the transports sync through every
combination, then (slow) a tiny RL run with rollout.engine=external syncs through it with `distributed` and
with `tensor`: both finish, every update arrives inside a session, none is refused, the engine serves each
new version.

Run: pytest -q tests/test_session_standin.py        (-m "not slow" leaves out the two RL runs)
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.engine.testing import ThreadedServer, make_tiny_model
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.launcher import embedded_specs
from megatron_rl.rollout.processes import start_cluster
from megatron_rl.rollout.sync import DistributedWeightSync, TensorWeightSync
from http_calls import call
from rl_runs import read_rows, tiny_overrides, train, warm_start
from session_standin import ALREADY_OPEN, BEGIN, END, GUARDED, NONE_OPEN, SERVER_INFO_MODES, SessionStandin, refusal

COMPATS = ("0.5.23", "0.5.8")
TRANSPORTS = {"distributed": DistributedWeightSync, "tensor": TensorWeightSync}
ENGINE_TIMEOUT_S = 20.0
OK = (200, {"success": True, "message": "Success"})


VOLATILE = ("id", "e2e_latency")
"""meta_info fields that differ between any two requests."""


def stable(answer: tuple[int, object]) -> tuple[int, object]:
    """(status, body) with the per-request meta_info fields dropped, so two answers to one request compare equal."""
    status, body = answer
    if isinstance(body, dict) and isinstance(body.get("meta_info"), dict):
        body = {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if k not in VOLATILE}}
    return status, body


def served(url: str, name: str) -> torch.Tensor:
    status, body = call(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
    assert status == 200, body
    return torch.tensor(body)


def check_sessions(proxy: SessionStandin, transport: str) -> list:
    """Every guarded update went through inside a session and succeeded; every session opened was closed."""
    updates = proxy.updates()
    assert updates, "no weight update reached the stand-in"
    assert proxy.refused() == [], proxy.refused()
    assert {r.path for r in updates} == {f"/update_weights_from_{transport}"}
    assert all(r.forwarded and r.status == 200 for r in updates), updates
    begins = [r for r in proxy.records if r.path == BEGIN and r.method == "POST"]  # GET: the transports' route probe
    ends = [r for r in proxy.records if r.path == END]
    assert [r.status for r in begins] == [200] * len(begins) and [r.status for r in ends] == [200] * len(ends)
    assert len(begins) == len(ends) and not proxy.session_open
    return updates


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """({compat: url} of two `megatron-rl serve` subprocesses serving one tiny model, target weights, root)."""
    root = tmp_path_factory.mktemp("standin")
    make_tiny_model(str(root / "base"), seed=0)
    target = make_tiny_model(str(root / "target"), seed=9)
    tsd = [(n, t) for n, t in target.state_dict().items() if n != "lm_head.weight"]
    specs = [spec for compat in COMPATS for spec in embedded_specs(
        str(root / "base"), engine_args=["--sglang-compat", compat, "--weight-update-timeout-s", str(ENGINE_TIMEOUT_S)])]
    cluster = start_cluster(specs, log_dir=str(root / "logs"))
    try:
        yield dict(zip(COMPATS, cluster.worker_urls)), tsd, root
    finally:
        cluster.stop()


@pytest.mark.parametrize("compat", COMPATS)
def test_the_standin_applies_sglang_0_5_23_session_rules(backends, compat):
    urls, tsd, _ = backends
    engine = urls[compat]
    name, tensor = tsd[0]
    distributed = {"names": [name], "dtypes": ["float32"], "shapes": [list(tensor.shape)], "group_name": "g"}
    with SessionStandin(engine, server_info="forward") as proxy:
        url = proxy.url
        assert call(url, BEGIN, method="GET")[0] == 405  # POST-only route
        assert call(url, END, {}) == (400, {"success": False, "message": NONE_OPEN})
        for path, body in zip(GUARDED, (distributed, {"serialized_named_tensors": ["eA=="]})):
            assert call(url, path, body) == (400, {"success": False, "message": refusal(path)})
        assert [(r.forwarded, r.in_session) for r in proxy.updates()] == [(False, False)] * 2  # never reached the engine
        assert call(url, BEGIN, {"selector": "drafts"})[0] == 400
        assert call(url, BEGIN, {"selector": "target"}) == OK
        # the engine behind opened its own in step (0.5.23), or has none (0.5.8: the stand-in keeps it alone)
        assert call(engine, BEGIN, {})[0] == (400 if compat == "0.5.23" else 404)
        assert call(url, BEGIN, {}) == (400, {"success": False, "message": ALREADY_OPEN})
        assert call(url, END, {}) == OK and call(url, END, {})[0] == 400
        if compat == "0.5.23":
            assert call(engine, END, {})[0] == 400  # closed in step too
        # everything else is the engine's answer, unchanged
        greedy = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        assert stable(call(url, "/generate", greedy)) == stable(call(engine, "/generate", greedy))
        assert call(url, "/generate", {"sampling_params": {}}) == call(engine, "/generate", {"sampling_params": {}})
        assert call(url, "/model_info?x=1", method="GET") == call(engine, "/model_info?x=1", method="GET")
        assert call(url, "/workers", method="GET") == call(engine, "/workers", method="GET")
        assert call(url, "/server_info", method="GET")[1]["version"] == compat
    assert all(r.status for r in proxy.records)


def test_the_standin_forwards_the_key_and_guards_its_own_answers(tmp_path):
    make_tiny_model(str(tmp_path / "m"), seed=0)
    key = {"Authorization": "Bearer k"}
    with ThreadedServer(str(tmp_path / "m"), api_key="k") as engine, \
            SessionStandin(engine.url, server_info="own", api_key="k") as proxy:
        assert call(proxy.url, "/model_info", method="GET")[0] == 401
        assert call(proxy.url, "/model_info", method="GET", headers=key)[0] == 200
        assert call(proxy.url, END, {}) == (401, {"error": "Unauthorized"})
        assert call(proxy.url, END, {}, headers=key) == (400, {"success": False, "message": NONE_OPEN})
        assert call(proxy.url, "/server_info", method="GET", headers=key) == (200, {"version": "0.5.23"})


def _sync(transport, tsd, version) -> None:
    """One whole sync as phases/weights.py drives it (three buckets)."""
    transport.begin(version)
    try:
        transport.begin_stage(0, 1, version)
        step = -(-len(tsd) // 3)
        for k in range(0, len(tsd), step):
            transport.send_bucket(tsd[k:k + step], final=k + step >= len(tsd))
        transport.end_stage()
        transport.commit(version)
    finally:
        transport.finish()


# Every pair, even a stand-in that forwards a 0.5.8 engine's /server_info (it claims 0.5.8 while enforcing 0.5.23's
# rules): the transports probe the session route itself, so what answers at the URL decides, not what it declares.
PLAUSIBLE = [(c, m) for c in COMPATS for m in SERVER_INFO_MODES]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize(("compat", "server_info"), PLAUSIBLE)
def test_transports_sync_through_every_plausible_standin(backends, compat, server_info, transport):
    """Whatever a plausible stand-in says on /server_info and whichever version the engine behind it speaks, every
    update is sent inside a session it opened, none is refused, and the engine serves the new weights and version."""
    urls, tsd, root = backends
    engine = urls[compat]
    version = f"{compat}-{server_info}-{transport}"
    with SessionStandin(engine, server_info=server_info) as proxy:
        sender = TRANSPORTS[transport]([proxy.url], bucket_mb=0.01, timeout_s=ENGINE_TIMEOUT_S)
        try:
            _sync(sender, tsd, version)
            _sync(sender, tsd, version + "-again")  # the second sync reuses what the first learned
        finally:
            sender.close()
        updates = check_sessions(proxy, transport)
        assert proxy.sessions_opened == 2
        assert [r.weight_version for r in updates if r.weight_version] == [version, version + "-again"]
        assert RolloutClient(proxy.url).weight_versions_sync() == [version + "-again"]
    try:
        for name, tensor in tsd:
            assert torch.equal(served(engine, name).reshape(tensor.shape), tensor), name
    finally:
        assert call(engine, "/update_weights_from_disk", {"model_path": str(root / "base")})[0] == 200


def test_a_refused_distributed_update_fails_at_once_and_the_next_sync_forms_a_group(backends):
    """An update outside a session is refused before any tensor moves: the sender reports the engine's message at once
    (not after timeout_s in a broadcast nobody joins), the engine drops its side of the group, and the next sync,
    inside a session, forms the group again under the same name."""
    import time

    from megatron_rl.rollout.client import RolloutServerError

    urls, tsd, root = backends
    engine = urls["0.5.23"]
    sender = DistributedWeightSync([engine], bucket_mb=0.01, timeout_s=ENGINE_TIMEOUT_S)
    try:
        sender.begin_stage(0, 1, "outside")  # no begin(): no session opened
        started = time.monotonic()
        with pytest.raises(RolloutServerError, match="refused.*begin_weight_update"):
            sender.send_bucket(tsd[:2], final=False)
        assert time.monotonic() - started < ENGINE_TIMEOUT_S / 2
        assert sender.group is None
        _sync(sender, tsd, "after-refusal")
    finally:
        sender.close()
    try:
        assert RolloutClient(engine).weight_versions_sync() == ["after-refusal"]
        for name, tensor in tsd:
            assert torch.equal(served(engine, name).reshape(tensor.shape), tensor), name
    finally:
        assert call(engine, "/update_weights_from_disk", {"model_path": str(root / "base")})[0] == 200


# --------------------------------------------------------------------------- tiny RL runs (slow)
FAST = ("train.steps=2", "train.eval_every=0", "precision.recipe=none", "precision.rollout_quantization=none",
        "algo.calibration.enabled=false")


@pytest.fixture(scope="module")
def standin_run(tmp_path_factory):
    """(warm start, engine URL, stand-in) : `megatron-rl serve` of the shared warm start behind one stand-in that
    forwards /server_info, as a user's external engine behind an SGLang 0.5.23 would be."""
    warm = warm_start(tmp_path_factory)
    root = tmp_path_factory.mktemp("standin_run")
    model = str(warm / "sft" / "hf")
    cluster = start_cluster(embedded_specs(model, tokenizer_path=model,
                                           engine_args=["--weight-update-timeout-s", "120"]),
                            log_dir=str(root / "logs"))
    try:
        with SessionStandin(cluster.worker_urls[0], server_info="forward") as proxy:
            yield warm, cluster.worker_urls[0], proxy
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_a_tiny_run_syncs_through_the_standin(standin_run, tmp_path, transport):
    warm, engine, proxy = standin_run
    proxy.clear()
    run = tmp_path / "run"
    rows = train(run, tiny_overrides(warm, *FAST, "rollout.engine=external", f"rollout.urls=[{proxy.url}]",
                                     f"rollout.weight_sync.transport={transport}"))
    updates = check_sessions(proxy, transport)
    versions = [r.weight_version for r in updates if r.weight_version]
    steps = len(rows)
    assert steps == 2 and versions == [str(v) for v in range(steps + 1)]  # the start's weights, then one per step
    # every rollout was generated by the version synced before it, and the engine now serves the last one
    assert [r["rollout/weight_version"] for r in read_rows(run)] == [float(v) for v in range(steps)]
    assert RolloutClient(engine).weight_versions_sync() == [versions[-1]]
