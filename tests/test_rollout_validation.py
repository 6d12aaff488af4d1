"""/generate body validation (engine/validation.py) against a real tiny engine: every field checked before batching."""
import math

import pytest
import torch

from megatron_rl.engine.generation import Engine, GenerationRequest, SamplingParams
from megatron_rl.engine.testing import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from megatron_rl.engine.validation import ModelFacts, RequestError, RequestLimits, validate_generate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    make_tiny_model(str(root / "m"), max_position_embeddings=64)
    make_tiny_tokenizer(str(root / "tok"))
    return Engine(str(root / "m"), str(root / "tok"))


def check(engine, body, limits=RequestLimits()):
    return validate_generate(body, ModelFacts.of(engine), limits)


def rejects(engine, body, *needles, limits=RequestLimits()):
    with pytest.raises(RequestError) as exc:
        check(engine, body, limits)
    assert exc.value.status == 400
    for needle in needles:
        assert needle in str(exc.value), (needle, str(exc.value))
    return str(exc.value)


@pytest.mark.parametrize("key", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400])
def test_non_finite_floats_are_rejected_by_name(engine, key, value):
    rejects(engine, {"input_ids": [3, 4], "sampling_params": {key: value}}, f"sampling_params.{key}")


@pytest.mark.parametrize("sp,needle", [
    ({"stop_token_ids": [TINY_VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**30], "min_new_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": list(range(TINY_VOCAB)), "min_new_tokens": 1}, "min_new_tokens"),
])
def test_token_id_fields_are_range_checked(engine, sp, needle):
    rejects(engine, {"input_ids": [3, 4], "sampling_params": sp}, needle)
    rejects(engine, {"input_ids": [3, -1]}, "input_ids")
    rejects(engine, {"input_ids": [[3], [TINY_VOCAB]]}, "prompt 1", "input_ids")


def test_n_and_sequences_are_bounded(engine):
    limits = RequestLimits(max_n=8, max_sequences=20)
    rejects(engine, {"input_ids": [3], "sampling_params": {"n": 10**6}}, "sampling_params.n", "--max-n", limits=limits)
    rejects(engine, {"input_ids": [[3]] * 3, "sampling_params": {"n": 8}}, "--max-sequences-per-request", limits=limits)
    rejects(engine, {"input_ids": [[3]] * 21}, "--max-sequences-per-request", limits=limits)
    assert len(check(engine, {"input_ids": [[3]] * 2, "sampling_params": {"n": 8}}, limits).items) == 2


def test_context_length_bounds_prompt_and_explicit_max_new_tokens(engine):
    rejects(engine, {"input_ids": [3] * 64}, "longer than the model's context length (64 tokens)")
    msg = rejects(engine, {"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": 54}}, "max_new_tokens")
    assert "maximum context length of 64" in msg
    # without an explicit max_new_tokens the engine stops at the context length (SGLang checks only explicit ones)
    assert check(engine, {"input_ids": [3] * 10}).items[0].request.params.max_new_tokens == 128
    check(engine, {"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": 53}})


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": [3], "sampling_params": {"unknown_key": 1}}, "unknown_key"),
    ({"input_ids": [3], "sampling_params": {"n": 1.5}}, "sampling_params.n"),
    ({"input_ids": [3], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"input_ids": [3], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [3], "stream": 1}, "stream"),
    ({"input_ids": [3], "rid": {"a": 1}}, "rid"),
    ({"input_ids": [[3], [4]], "rid": ["a"]}, "rid"),
    ({"input_ids": [3], "logprob_start_len": 0.0}, "logprob_start_len"),
    ({"input_ids": [3], "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"text": "w3 \ud800"}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": [3], "text": "w3"}, "exactly one"),
    ([1, 2], "JSON object"),
])
def test_malformed_fields_get_400_naming_them(engine, body, needle):
    rejects(engine, body, needle)


def test_unknown_top_level_keys_are_ignored_and_valid_bodies_pass(engine):
    batch = check(engine, {"input_ids": [[3, 4], [5]], "rid": ["a", "b"], "return_logprob": [True, False],
                           "some_future_field": {"x": 1}, "sampling_params": {"temperature": 0, "top_k": 10**30, "n": 2}})
    assert batch.batched and [it.rid for it in batch.items] == ["a", "b"]
    assert [it.return_logprob for it in batch.items] == [True, False]
    text = check(engine, {"text": "w5 w6", "stream": True})
    assert text.stream and text.items[0].request.input_ids == [5, 6]


def test_engine_check_is_the_runtime_guard(engine):
    """The engine refuses the same requests itself (a request built without the server still cannot poison a batch)."""
    bad = GenerationRequest([3], SamplingParams(stop_token_ids=[TINY_VOCAB + 5], min_new_tokens=2))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=2)), bad])
    # an oversized top_k keeps the whole vocabulary instead of overflowing
    out = engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=3, top_k=10**30, sampling_seed=1))])
    ref = engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=3, top_k=-1, sampling_seed=1))])
    assert out[0][0].output_ids == ref[0][0].output_ids
