"""Validation of SGLang /generate bodies: parsed JSON in, per-prompt engine requests (or a 400 naming the field) out.

Pure and synchronous (no HTTP, no event loop): the server runs `validate_generate` on a worker thread
before anything joins a batch, so a request that passes here can fail at run time only through
the model itself. Everything a request controls is checked: types, NaN/inf (and integers too large
for a float) in float fields, every token-id field against the vocabulary, `n` and the number of
sequences per request against the server's limits, prompt and `max_new_tokens` against the
model's context length (as SGLang's tokenizer manager does; text is first bounded by its length in
characters, before tokenizing: TEXT_CHARS_PER_TOKEN). Unknown `sampling_params` keys are
rejected and unknown top-level keys ignored, as in SGLang.

    batch = validate_generate(body, ModelFacts.of(engine), RequestLimits(max_n=256))
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_rl.engine.generation import GenerationRequest, InvalidRequest, SamplingParams

DEFAULT_MAX_N = 256
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024
TEXT_CHARS_PER_TOKEN = 32
"""Characters of `text` allowed per token of context before tokenizing (at least the longest vocabulary entry):
text longer than that cannot fit the context, and tokenizing megabytes of it only to refuse it costs
gigabytes of memory (tokens, offsets and ids are all held at once)."""


class RequestError(ValueError):
    """A /generate body the server refuses; `status` is the HTTP status (400) and the message names the field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestLimits:
    """Server-side bounds on what one request may ask for (--max-n, --max-sequences-per-request)."""

    max_n: int = DEFAULT_MAX_N
    """Largest sampling_params.n."""
    max_sequences: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    """Largest number of sequences (prompts x n) in one request; never below max_n."""

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n={self.max_n} must be >= 1")
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences={self.max_sequences} must be >= 1")


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know about the served model."""

    check_request: Callable[[GenerationRequest], None]
    """The engine's own check (token ids in the vocabulary, context length, stop tokens); raises InvalidRequest."""
    max_context_len: int
    """Context length of the model (prompt + completion)."""
    encode: Optional[Callable[[str], list[int]]] = None
    """Tokenizer for `text` input (None: text is refused)."""
    max_token_chars: int = 0
    """Characters of the tokenizer's longest token (the text bound is never below it per token of context)."""

    @property
    def max_text_chars(self) -> int:
        """Longest `text` (in characters) tokenized at all; a longer one is refused before tokenizing."""
        return self.max_context_len * max(TEXT_CHARS_PER_TOKEN, self.max_token_chars)

    @classmethod
    def of(cls, engine) -> "ModelFacts":
        """The facts of a loaded `Engine` (read at call time: a weight reload may change them)."""
        return cls(check_request=engine.check_request, max_context_len=engine.max_context_len,
                   encode=engine.encode if engine.tokenizer is not None else None,
                   max_token_chars=getattr(engine, "max_token_chars", 0))


@dataclass
class GenerateItem:
    """One prompt of a /generate body, ready for a batch."""

    request: GenerationRequest
    """Prompt ids and sampling parameters."""
    rid: str
    """Request id (the sample index is appended when n > 1)."""
    return_logprob: bool
    """Whether meta_info carries output_token_logprobs."""
    text_in_logprobs: bool
    """Whether each logprob entry carries the token's text."""


@dataclass
class GenerateBatch:
    """A validated /generate body."""

    items: list[GenerateItem]
    """One entry per prompt, in request order."""
    batched: bool
    """Whether the input was a list of prompts (the response is then always a list)."""
    stream: bool
    """Whether the response is server-sent events."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _per_item(value: Any, n: int, name: str, batched: bool) -> list:
    """Broadcast a request field over the prompts, or take a list holding one entry per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise RequestError(f"{name} has {len(value)} entries for {n} prompt{'s' if n != 1 else ''}")
    return value


def _check_length(prompt: list, k: int, batched: bool, max_context_len: int) -> None:
    """SGLang's prompt-length rule, checked before the (linear) per-token checks so an oversized prompt is refused cheaply."""
    if len(prompt) >= max_context_len:
        raise RequestError(_where(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                                  f"({max_context_len} tokens).", k, batched))


def _prompts(body: dict, model: ModelFacts, limits: RequestLimits) -> tuple[list[list[int]], bool]:
    """(prompt token ids, batched) from input_ids or text."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise RequestError("exactly one of input_ids or text must be given")
    if has_ids:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids or a list of such lists")
        batched = isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        if len(prompts) > limits.max_sequences:
            raise RequestError(f"input_ids has {len(prompts)} prompts; the server's limit is {limits.max_sequences} "
                               "sequences per request (--max-sequences-per-request)")
        for k, p in enumerate(prompts):
            if isinstance(p, list):
                _check_length(p, k, batched, model.max_context_len)
            if not isinstance(p, list) or not all(_is_int(t) for t in p):
                raise RequestError(f"input_ids[{k}] must be a list of integers" if batched
                                   else "input_ids must be a list of integers")
        return prompts, batched
    text = body["text"]
    batched = isinstance(text, list)
    texts = text if batched else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError("text must be a string or a non-empty list of strings")
    if len(texts) > limits.max_sequences:
        raise RequestError(f"text has {len(texts)} prompts; the server's limit is {limits.max_sequences} "
                           "sequences per request (--max-sequences-per-request)")
    if model.encode is None:
        raise RequestError("text input needs a tokenizer (start the server with --tokenizer-path), or send input_ids")
    for k, t in enumerate(texts):  # every text before any is tokenized: len() is O(1), tokenizing is not
        if len(t) > model.max_text_chars:
            raise RequestError(_where(
                f"The input ({len(t)} characters) is longer than the model's context length ({model.max_context_len} "
                f"tokens) can hold: text over {model.max_text_chars} characters is refused before tokenizing "
                f"({model.max_text_chars // model.max_context_len} characters per token); send a shorter text",
                k, batched))
    prompts = []
    for k, t in enumerate(texts):
        try:
            prompts.append(list(model.encode(t)))
        except Exception as exc:  # the tokenizer's own errors (e.g. lone surrogates) are the request's fault
            where = f"text[{k}]" if batched else "text"
            raise RequestError(f"{where} could not be tokenized: {type(exc).__name__}: {exc}") from None
        _check_length(prompts[-1], k, batched, model.max_context_len)
    return prompts, batched


def _check_flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}")
    return value


def validate_generate(body: Any, model: ModelFacts, limits: RequestLimits = RequestLimits()) -> GenerateBatch:
    """Validate a parsed /generate body into per-prompt requests; raises RequestError (400) naming the field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    prompts, batched = _prompts(body, model, limits)
    n_prompts = len(prompts)
    for name in ("logprob_start_len", "top_logprobs_num"):
        for v in _per_item(body.get(name), n_prompts, name, batched):
            if name == "logprob_start_len" and v is not None and (not _is_int(v) or v != -1):
                raise RequestError("logprob_start_len >= 0 (input-token logprobs) is not supported by the embedded "
                                   "engine; use -1")
            if name == "top_logprobs_num" and v is not None and (not _is_int(v) or v != 0):
                raise RequestError("top_logprobs_num > 0 is not supported by the embedded engine")
    raw_params = _per_item(body.get("sampling_params"), n_prompts, "sampling_params", batched)
    rids = _per_item(body.get("rid"), n_prompts, "rid", batched)
    want_lp = [_check_flag(v, "return_logprob") for v in _per_item(body.get("return_logprob"), n_prompts, "return_logprob", batched)]
    text_lp = _check_flag(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    stream = _check_flag(body.get("stream"), "stream")
    if stream and batched:
        raise RequestError("stream=true is only supported for a single (non-batched) prompt")

    params: list[SamplingParams] = []
    total = 0
    for k, raw in enumerate(raw_params):
        try:
            sp = SamplingParams.from_dict(raw)
        except InvalidRequest as exc:
            raise RequestError(_where(str(exc), k, batched)) from None
        if sp.n > limits.max_n:
            raise RequestError(_where(f"sampling_params.n={sp.n} exceeds the server's limit of {limits.max_n} (--max-n)",
                                      k, batched))
        total += sp.n
        if total > limits.max_sequences:
            raise RequestError(f"the request asks for more than {limits.max_sequences} sequences (prompts x n); "
                               "that is the server's limit (--max-sequences-per-request)")
        explicit_max = raw.get("max_new_tokens") if isinstance(raw, dict) else None
        if explicit_max is not None and explicit_max + len(prompts[k]) >= model.max_context_len:
            # SGLang's wording: clients (and routers) recognise it as a context overflow
            raise RequestError(_where(
                f"Requested token count exceeds the model's maximum context length of {model.max_context_len} tokens. "
                f"You requested a total of {explicit_max + len(prompts[k])} tokens: {len(prompts[k])} tokens from the "
                f"input messages and {explicit_max} tokens for the completion (sampling_params.max_new_tokens). "
                "Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                k, batched))
        params.append(sp)

    items = []
    for k in range(n_prompts):
        req = GenerationRequest(list(prompts[k]), params[k])
        try:
            model.check_request(req)
        except InvalidRequest as exc:
            raise RequestError(_where(str(exc), k, batched)) from None
        rid = rids[k]
        if rid is not None and not (isinstance(rid, str) or _is_int(rid)):
            raise RequestError(_where(f"rid must be a string, got {type(rid).__name__}", k, batched))
        items.append(GenerateItem(req, str(rid) if rid is not None else uuid.uuid4().hex, want_lp[k], text_lp))
    return GenerateBatch(items, batched, stream)


def _where(message: str, k: int, batched: bool) -> str:
    """Prefix the prompt index of a batched request."""
    return f"prompt {k}: {message}" if batched else message
