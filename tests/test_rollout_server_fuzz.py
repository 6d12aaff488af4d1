"""Fuzz of the embedded server's HTTP surface with hypothesis.

Generated bodies (field-aware /generate bodies with hostile values: NaN/inf, huge and negative
integers, out-of-vocabulary ids, wrong types, unknown keys; arbitrary JSON; raw bytes) are sent to one
server started once for the module. Every answer must be below 500, the server must stay healthy, and a
good request sent at the same moment (so it shares the fuzzed request's batch) must still succeed.
Bounded for CI: fixed example counts, derandomized, no deadline, no example database.

    .venv/bin/python -m pytest -q tests/test_rollout_server_fuzz.py
"""
import asyncio
import json
import math

import aiohttp
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_rl.engine.generation import NEUTRAL_SAMPLING_KEYS, SUPPORTED_SAMPLING_KEYS
from megatron_rl.engine.testing import TINY_VOCAB, ThreadedServer, make_tiny_model, make_tiny_tokenizer

torch.set_num_threads(1)

CONTEXT = 48  # small context and limits keep the worst generated request cheap
GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}}
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    make_tiny_model(str(root / "m"), max_position_embeddings=CONTEXT)
    make_tiny_tokenizer(str(root / "tok"))
    with ThreadedServer(str(root / "m"), str(root / "tok"), batch_window_s=0.02, max_n=4, max_sequences_per_request=8,
                        max_body_mb=1, read_timeout_s=5.0) as srv:
        yield srv


# ------------------------------------------------------------------------------------------ strategies
hostile_ints = st.one_of(st.integers(-3, TINY_VOCAB + 3), st.integers(), st.sampled_from([2**63, -2**63, 10**30, -1]))
hostile_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-7, 1e308, -0.0]))
scalars = st.one_of(st.none(), st.booleans(), hostile_ints, hostile_floats, st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
token_ids = st.lists(hostile_ints, min_size=0, max_size=12)
prompts = st.one_of(token_ids, st.lists(token_ids, min_size=1, max_size=4), json_values)
texts = st.one_of(st.text(max_size=20), st.lists(st.text(alphabet="w0123456789 ", max_size=12), max_size=3),
                  st.sampled_from(["w5 w6 w7", "\ud800", ""]), json_values)
sampling_values = st.one_of(hostile_ints, hostile_floats, st.booleans(), st.none(), st.text(max_size=6),
                            token_ids, st.lists(st.text(max_size=4), max_size=3), json_values)
sampling_params = st.one_of(
    st.dictionaries(st.sampled_from(SUPPORTED_SAMPLING_KEYS + tuple(NEUTRAL_SAMPLING_KEYS) + ("bogus",)),
                    sampling_values, max_size=6),
    st.lists(st.dictionaries(st.sampled_from(SUPPORTED_SAMPLING_KEYS), sampling_values, max_size=4), max_size=3),
    json_values)
top_level = {
    "rid": json_values, "return_logprob": st.one_of(st.booleans(), json_values),
    "logprob_start_len": st.one_of(st.just(-1), json_values), "top_logprobs_num": st.one_of(st.just(0), json_values),
    "return_text_in_logprobs": st.one_of(st.booleans(), json_values), "stream": st.one_of(st.booleans(), json_values),
    "unknown_field": json_values,
}


valid_ids = st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=10)
valid_sampling_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(0, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.just(-1), st.integers(1, 50)), "min_p": st.floats(0, 1), "n": st.integers(1, 4),
    "stop_token_ids": st.lists(st.integers(0, TINY_VOCAB - 1), max_size=5), "min_new_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(), "sampling_seed": st.integers(), "stop": st.lists(st.sampled_from(["w7", "w9 w3"]), max_size=2),
    "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(), "frequency_penalty": st.just(0.0),
})
# values that broke the server once, or could: non-finite and huge numbers, ids outside the vocabulary, wrong types
EDGE_VALUES = [math.nan, math.inf, -math.inf, 1e308, -1e308, 10**30, -(10**30), 2**63, -1, 0, 10**6, 20000,
               TINY_VOCAB, -TINY_VOCAB, True, None, "", "1", [], {}, [TINY_VOCAB + 5], [-1], [10**30], [math.nan]]
edge_values = st.one_of(st.sampled_from(EDGE_VALUES), st.sampled_from(EDGE_VALUES), st.sampled_from(EDGE_VALUES),
                        hostile_ints, hostile_floats, token_ids, json_values)
# keys whose bad values reach the sampler are drawn more often
SAMPLING_KEYS = (("temperature", "top_p", "min_p", "stop_token_ids", "n", "max_new_tokens", "min_new_tokens", "top_k") * 3
                 + SUPPORTED_SAMPLING_KEYS + tuple(NEUTRAL_SAMPLING_KEYS) + ("bogus",))


@st.composite
def valid_bodies(draw):
    """A /generate body the server must accept (single or batched ids, or text)."""
    kind = draw(st.sampled_from(["single", "batched", "text"]))
    body = {"single": lambda: {"input_ids": draw(valid_ids)},
            "batched": lambda: {"input_ids": draw(st.lists(valid_ids, min_size=1, max_size=2))},
            "text": lambda: {"text": draw(st.sampled_from(["w5 w6 w7", "w3", "w10 w11 w12 w13"]))}}[kind]()
    sp = draw(valid_sampling_params)
    if kind == "batched" and sp.get("n", 1) * len(body["input_ids"]) > 8:
        sp["n"] = 1
    body["sampling_params"] = sp
    body["return_logprob"] = draw(st.booleans())
    if kind != "batched" and draw(st.booleans()):
        body["stream"] = True
    if draw(st.booleans()):
        body["rid"] = draw(st.text(max_size=8)) if kind != "batched" else [f"r{i}" for i in range(len(body["input_ids"]))]
    return body


EDGE_IDS = [TINY_VOCAB, TINY_VOCAB + 1000, -1, -TINY_VOCAB, 10**30, 2**63, -(2**63)]


@st.composite
def mutated_bodies(draw):
    """A valid body with one or two mutations: a field (top-level or in sampling_params) set to an edge value,
    or an id outside the vocabulary slipped into an id-valued field."""
    body = draw(valid_bodies())
    sp = body["sampling_params"]
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["sampling", "sampling", "top", "id"]))
        if kind == "sampling":
            sp[draw(st.sampled_from(SAMPLING_KEYS))] = draw(edge_values)
        elif kind == "top":
            body[draw(st.sampled_from(["input_ids", "text", "sampling_params", *sorted(top_level)]))] = draw(edge_values)
        else:
            bad_id = draw(st.sampled_from(EDGE_IDS))
            ids = body.get("input_ids")
            if isinstance(ids, list) and ids and draw(st.booleans()):
                row = ids[0] if isinstance(ids[0], list) else ids
                row.insert(draw(st.integers(0, len(row))), bad_id)
            elif isinstance(sp, dict):
                stop = sp.get("stop_token_ids")
                sp["stop_token_ids"] = (stop if isinstance(stop, list) else []) + [bad_id]
                if draw(st.booleans()):
                    sp["min_new_tokens"] = draw(st.integers(1, 4))  # masks stop ids: an out-of-range one would index past V
    return body


@st.composite
def random_bodies(draw):
    """A body assembled from arbitrary values: prompt by ids or text (or both, or neither), params, extras."""
    body = {}
    source = draw(st.sampled_from(["ids", "ids", "text", "both", "none"]))
    if source in ("ids", "both"):
        body["input_ids"] = draw(prompts)
    if source in ("text", "both"):
        body["text"] = draw(texts)
    if draw(st.booleans()):
        body["sampling_params"] = draw(sampling_params)
    for key in draw(st.lists(st.sampled_from(sorted(top_level)), unique=True, max_size=4)):
        body[key] = draw(top_level[key])
    return body


generate_bodies = st.one_of(valid_bodies(), mutated_bodies(), mutated_bodies(), random_bodies())


def encode(body) -> bytes:
    """JSON with NaN/Infinity literals allowed (Python's json parses them, so clients can send them)."""
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda b, cut: encode(b)[:cut], generate_bodies, st.integers(0, 200)),  # truncated JSON
    st.builds(lambda d: b"[" * d + b"]" * d, st.integers(1, 5000)),
    st.builds(encode, json_values),
)


# ---------------------------------------------------------------------------------------------- helpers
async def _send(session, url, path, data, method="POST"):
    async with session.request(method, url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


def send_with_good(url, path, data):
    """The fuzzed request and a good /generate at the same moment: ((status, body), (good_status, good_body))."""
    async def run():
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            return await asyncio.gather(_send(s, url, path, data), _send(s, url, "/generate", encode(GOOD)))
    return asyncio.run(run())


def send(url, path, data=None, method="POST"):
    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await _send(s, url, path, data, method)
    return asyncio.run(run())


def check_generate_answer(status: int, raw: bytes) -> None:
    event(f"/generate answered {status}")  # shown by --hypothesis-show-statistics
    assert status < 500, raw[:500]
    if status == 200 and not raw.startswith(b"data:"):
        out = json.loads(raw)
        for sample in out if isinstance(out, list) else [out]:
            assert sample["meta_info"]["finish_reason"]["type"] in ("stop", "length", "abort")
            assert all(0 <= t < TINY_VOCAB for t in sample["output_ids"])
            assert all(math.isfinite(e[0]) for e in sample["meta_info"].get("output_token_logprobs", []))
    elif status != 200:
        assert json.loads(raw)["error"]["message"], raw[:500]  # a JSON error naming the problem


def check_good(status: int, raw: bytes) -> None:
    assert status == 200, raw[:500]
    assert json.loads(raw)["meta_info"]["prompt_tokens"] == 3


# ------------------------------------------------------------------------------------------------ tests
@FUZZ
@given(body=generate_bodies)
def test_fuzzed_generate_bodies_never_5xx_and_batch_mates_succeed(server, body):
    (status, raw), (good_status, good_raw) = send_with_good(server.url, "/generate", encode(body))
    check_generate_answer(status, raw)
    check_good(good_status, good_raw)


@settings(FUZZ, max_examples=60)
@given(data=raw_bodies)
def test_fuzzed_raw_bytes_never_5xx(server, data):
    (status, raw), (good_status, good_raw) = send_with_good(server.url, "/generate", data)
    assert status < 500, raw[:500]
    check_good(good_status, good_raw)


CONTROL_PATHS = ["/abort_request", "/update_weight_version", "/update_weights_from_disk", "/flush_cache",
                 "/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
                 "/model_info", "/server_info", "/health", "/health_generate"]


@settings(FUZZ, max_examples=80)
@given(path=st.sampled_from(CONTROL_PATHS), body=st.one_of(st.builds(encode, json_values), raw_bodies,
                                                          st.builds(encode, st.fixed_dictionaries({}, optional={
                                                              "rid": json_values, "abort_all": json_values,
                                                              "mode": st.one_of(st.sampled_from(["abort", "in_place", "retract"]), json_values),
                                                              "new_version": json_values, "model_path": json_values,
                                                              "load_format": json_values, "weight_version": json_values,
                                                              "selector": json_values}))),
       method=st.sampled_from(["POST", "GET"]))
def test_fuzzed_control_endpoints_never_5xx_and_server_stays_healthy(server, path, body, method):
    try:
        status, raw = send(server.url, path, body, method)
        assert status < 500, (path, raw[:500])
    finally:
        # a fuzzed pause must not hold the next example's requests
        send(server.url, "/continue_generation", b"{}")
        send(server.url, "/end_weight_update", b"{}")
        send(server.url, "/update_weight_version", encode({"new_version": "default"}))
    assert send(server.url, "/health", method="GET")[0] == 200
    status, raw = send(server.url, "/generate", encode(GOOD))
    check_good(status, raw)
