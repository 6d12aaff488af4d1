"""CPU generation core of the embedded rollout server: an HF causal LM, a batched KV-cache decode loop.

It reproduces what an SGLang engine returns for the RL trainer: n samples per prompt
(prompt-major), SGLang's sampling pipeline (temperature, top-k, top-p, min-p), stop tokens and
strings, per-request reproducible seeds, per-token log-probs of the chosen tokens taken from the
model's RAW logits, and SGLang-shaped finish reasons. Prompts of different lengths are left-padded
and run together with an attention mask and explicit position ids, so a batched row computes the
same numbers as the row alone up to float rounding (~1e-6 in log-probs: padded shapes change the
kernels' summation order); the server's --enable-deterministic-inference makes it bitwise.

The model is built by a replaceable `model_loader(path) -> torch.nn.Module` (default
`load_hf_model`), so the FP8 emulation can plug in a W8A8 model without touching this file.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

GREEDY_TEMPERATURE = 1e-6
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)

# SGLang sampling_params keys this engine implements (any value).
SUPPORTED_SAMPLING_KEYS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "no_stop_trim", "n", "sampling_seed", "min_new_tokens",
    "spaces_between_special_tokens",
)
# SGLang sampling_params keys accepted only at their neutral value (anything else would silently
# change the distribution, so it is rejected instead).
NEUTRAL_SAMPLING_KEYS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None,
    "logit_bias": None, "custom_params": None, "stream_interval": None,
}

ModelLoader = Callable[[str], torch.nn.Module]

_LOAD_LOCK = threading.Lock()
# transformers builds models under process-global init contexts: two engines loading at once in one
# process (threaded test servers) can come out with untied embeddings, so loads take turns.


class InvalidRequest(ValueError):
    """A request the engine cannot run as given (answered 400, never retried); the message names the field."""


class SamplingParamsError(InvalidRequest):
    """A sampling_params entry is unknown, unsupported or out of range; `key` names it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass
class SamplingParams:
    """SGLang sampling_params of one request (validated by `from_dict`)."""

    max_new_tokens: int = 128
    """Maximum completion length."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-6 decoding is greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens (-1 = all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (need a tokenizer)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop token ids (EOS is a stop unless ignore_eos)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS tokens."""
    skip_special_tokens: bool = True
    """Drop special tokens from the returned text."""
    spaces_between_special_tokens: bool = True
    """Detokenizer option, passed through to the tokenizer."""
    no_stop_trim: bool = False
    """Keep the matched stop string / token in the returned text."""
    n: int = 1
    """Samples per prompt."""
    sampling_seed: Optional[int] = None
    """Seed making the request's samples reproducible (None: drawn from the engine's generator)."""
    min_new_tokens: int = 0
    """Stop tokens are masked out of sampling until this many tokens were generated."""

    @classmethod
    def from_dict(cls, raw: Optional[dict]) -> "SamplingParams":
        """Validate an SGLang sampling_params dict; raises SamplingParamsError naming the bad key."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SamplingParamsError("sampling_params", "sampling_params must be a JSON object")
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            if key in NEUTRAL_SAMPLING_KEYS:
                if value is not None and value != NEUTRAL_SAMPLING_KEYS[key]:
                    raise SamplingParamsError(
                        key, f"sampling_params.{key}={value!r} is not supported by the embedded engine "
                        f"(only {NEUTRAL_SAMPLING_KEYS[key]!r})")
                continue
            if key not in SUPPORTED_SAMPLING_KEYS:
                raise SamplingParamsError(key, f"Unknown sampling parameter: {key!r}")
            if value is None:
                continue  # SGLang treats an explicit null as "use the default"
            kwargs[key] = value
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        if isinstance(kwargs.get("stop_token_ids"), int):
            kwargs["stop_token_ids"] = [kwargs["stop_token_ids"]]
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        """Range and type checks; raises SamplingParamsError naming the field."""
        def bad(key: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(key, f"sampling_params.{key}={getattr(self, key)!r}: {why}")

        for key in ("max_new_tokens", "top_k", "n", "min_new_tokens"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int):
                raise bad(key, "must be an integer")
        for key in ("temperature", "top_p", "min_p"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), (int, float)):
                raise bad(key, "must be a number")
            if not _is_finite(getattr(self, key)):
                raise bad(key, "must be a finite number")
            if isinstance(getattr(self, key), int):
                # JSON integers stay Python ints; the sampler builds float tensors from them, and torch reads a
                # list led by an int past the signed 64-bit range as int64 ("Overflow when unpacking long long").
                # SGLang 0.5.23 carries sampling params from tokenizer to scheduler as msgspec (srt/managers/
                # io_struct.py), which cannot hold integers past 64 bits; this stand-in refuses them from 2^63.
                if not INT64_MIN <= getattr(self, key) <= INT64_MAX:
                    raise bad(key, "must be a finite number (an integer must fit in a signed 64-bit integer)")
                setattr(self, key, float(getattr(self, key)))
        for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be a boolean")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            raise bad("min_new_tokens", "must be >= 0")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise bad("top_k", "must be -1 (all tokens) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers")
        if self.sampling_seed is not None and (
                isinstance(self.sampling_seed, bool) or not isinstance(self.sampling_seed, int)):
            raise bad("sampling_seed", "must be an integer")

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    def to_dict(self) -> dict:
        """Plain dict of the fields (SGLang key names)."""
        return dataclasses.asdict(self)


@dataclass
class GenerationRequest:
    """One prompt to complete `params.n` times."""

    input_ids: list[int]
    """Prompt token ids."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters."""


@dataclass
class GenerationOutput:
    """One completed sample."""

    output_ids: list[int]
    """Generated token ids (a matched stop token is included, as in SGLang)."""
    logprobs: list[float]
    """log_softmax of the raw logits at each chosen token, aligned with output_ids."""
    finish_reason: dict
    """SGLang finish reason: {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | {"type": "abort", "message": s}."""
    prompt_tokens: int
    """Prompt length."""
    text: Optional[str] = None
    """Decoded completion (None without a tokenizer)."""


def _is_finite(x: float) -> bool:
    """False for NaN, +-inf and integers too large for a float (JSON allows them; the sampler cannot take them)."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def load_hf_model(path: str, dtype: torch.dtype = torch.float32, strict: bool = True) -> torch.nn.Module:
    """Default model loader: an HF causal LM from a local directory (config.json + safetensors), eval mode.

    strict: a checkpoint with missing, unexpected or mis-shaped tensors is an error (HF would
    otherwise random-initialize what is missing, silently corrupting a weight sync).
    """
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model_path {path!r} is not a directory with a config.json")
    from megatron_rl.precision import kv_scales
    from megatron_rl.precision.rollout_formats import checkpoint_format, load_quantized_model, read_config

    raw_config = read_config(path)
    with _LOAD_LOCK:
        if checkpoint_format(raw_config) is not None:  # FP8 rollout weights, in any registered format
            return load_quantized_model(path, dtype)
        kwargs = {}
        if kv_scales.creates_kv_scales(raw_config):  # unquantized weights carrying K/V cache scales
            from transformers import AutoConfig

            kwargs["config"] = AutoConfig.from_pretrained(path, local_files_only=True)
            # the K/V scales are ours to serve; transformers' own FP8 integration needs a GPU
            delattr(kwargs["config"], "quantization_config")
        # ignore_mismatched_sizes: transformers then lists mis-shaped tensors in `info` (raised below, in strict mode,
        # with their shapes) instead of raising a message that points at a report it only logged
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                           output_loading_info=True, ignore_mismatched_sizes=strict,
                                                           **kwargs)
    unknown_scales: list[str] = []
    if kv_scales.creates_kv_scales(raw_config):
        kv_scales.attach_kv_scales(model)
        unknown_scales = kv_scales.load_kv_scales(model, kv_scales.read_kv_scale_tensors(path))
    if strict:
        unexpected = set(info.get("unexpected_keys") or ())
        if kv_scales.creates_kv_scales(raw_config):  # the scales loaded above, except those no layer has
            unexpected = {k for k in unexpected if not kv_scales.is_kv_scale_name(k)} | set(unknown_scales)
        if getattr(model.config, "tie_word_embeddings", False):
            unexpected.discard("lm_head.weight")
        problems = {"missing": sorted(info.get("missing_keys") or ()), "unexpected": sorted(unexpected),
                    "mismatched": sorted(f"{k[0]} is {list(k[1])} in the checkpoint but {list(k[2])} by config.json"
                                         if isinstance(k, tuple) else str(k) for k in (info.get("mismatched_keys") or ()))}
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            detail = "; ".join(f"{k}: {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for k, v in problems.items())
            raise ValueError(f"checkpoint {path!r} does not match its config.json ({detail})")
    return model.eval()


def load_tokenizer(path: str):
    """An HF tokenizer from a local directory (no hub access)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer_path {path!r} is not a directory")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def eos_token_ids(model: torch.nn.Module) -> set[int]:
    """The model's EOS ids from its config and generation config (SGLang uses both)."""
    ids: set[int] = set()
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """SGLang's top-k / top-p / min-p filter of [B, V] probabilities (all three judged on the unfiltered distribution), renormalized."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).expand_as(sorted_probs)
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = cum_before > top_p[:, None]
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    drop |= sorted_probs < (sorted_probs[:, :1] * min_p[:, None])
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def _seed_for(base: int, sample_index: int) -> int:
    """Distinct, reproducible generator seed of sample `sample_index` of a request seeded `base`."""
    return (int(base) * 1_000_003 + sample_index * 7_919 + 12_345) % (2**63 - 1)


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest vocabulary entry (0 without a tokenizer or vocabulary).

    Byte-level vocabularies spell a byte per character and others a character per character, so
    a token decodes to at most this many characters of text.
    """
    vocab = getattr(tokenizer, "get_vocab", None)
    return max((len(t) for t in vocab()), default=0) if callable(vocab) else 0


class Engine:
    """Loads a causal LM and generates batches of SGLang-style requests on CPU (thread-confined: call from one thread)."""

    def __init__(self, model_path: str, tokenizer_path: Optional[str] = None,
                 model_loader: Optional[ModelLoader] = None, random_seed: int = 0,
                 max_context_len: Optional[int] = None, kv_cache_dtype: str = "auto"):
        """Load the model (and tokenizer if given); `model_loader(path)` replaces the default HF loader.

        kv_cache_dtype: "fp8_e4m3" stores K/V in an emulated E4M3 cache with each layer's served per-tensor
        scales (1.0 unless the checkpoint or an update carried them; precision/kv_cache.py, kv_scales.py), as
        `--kv-cache-dtype fp8_e4m3` does on GPU.
        """
        from megatron_rl.precision.kv_cache import KV_CACHE_DTYPES

        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
        self.kv_cache_dtype = kv_cache_dtype
        self.model_loader: ModelLoader = model_loader or load_hf_model
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
        self.max_token_chars = longest_token_chars(self.tokenizer)
        self.random_seed = int(random_seed)
        self._seed_gen = torch.Generator().manual_seed(self.random_seed)
        self._max_context_override = max_context_len
        self.model: torch.nn.Module = self._load(model_path)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------- weights
    def _load(self, path: str) -> torch.nn.Module:
        """Build a model with the loader and read the facts the decode loop needs."""
        return self._adopt(self.model_loader(path))

    def _adopt(self, model: torch.nn.Module) -> torch.nn.Module:
        """Read the facts the decode loop needs from `model` (eval mode)."""
        model.eval()
        self._eos = eos_token_ids(model)
        cfg = getattr(model, "config", None)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
        self.max_context_len = int(self._max_context_override or getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`; support both.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params
        return model

    def load_weights(self, path: str, check: Optional[Callable[[torch.nn.Module], None]] = None) -> None:
        """Replace the model with the one at `path` (built by the same loader) after checking it has the served
        architecture (config fields, every tensor's name, shape and dtype) and passes `check` (raising refuses it);
        the old one stays on any failure."""
        from megatron_rl.engine.weight_receiver import check_same_architecture

        model = self.model_loader(path)
        check_same_architecture(self.model, model, f"checkpoint {path!r}")
        if check is not None:
            check(model)
        with self._lock:
            self.model = self._adopt(model)
            self.model_path = path

    @property
    def eos_ids(self) -> set[int]:
        """EOS token ids of the loaded model."""
        return set(self._eos)

    # -------------------------------------------------------------------------------- forward
    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, cache: Any, last_only: bool) -> tuple[torch.Tensor, Any]:
        """One model call; returns (float32 logits [B, T or 1, V], cache)."""
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return out.logits.float(), new_cache

    def _new_cache(self, capacity: int = 0) -> Any:
        """An empty KV cache reserving `capacity` positions (FP8-emulated under kv_cache_dtype=fp8_e4m3)."""
        from megatron_rl.precision.kv_cache import new_kv_cache
        from megatron_rl.precision.kv_scales import served_kv_scales

        # read per batch: every weight update (disk, tensor, distributed) lands between batches
        return new_kv_cache(self.model.config, self.kv_cache_dtype, capacity=capacity,
                            scales=served_kv_scales(self.model) if self.kv_cache_dtype != "auto" else None)

    # ------------------------------------------------------------------------------- generate
    def check_request(self, req: GenerationRequest) -> None:
        """Raise InvalidRequest (naming the field) for a request this model cannot take.

        Every token-id-valued field is range-checked here: an id outside the vocabulary would index
        out of range inside the decode loop and fail the whole batch it shares.
        """
        ids = req.input_ids
        if not ids:
            raise InvalidRequest("input_ids is empty")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= self.vocab_size for t in ids):
            raise InvalidRequest(f"input_ids contains a token outside [0, {self.vocab_size})")
        if len(ids) >= self.max_context_len:
            raise InvalidRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                                 f"({self.max_context_len} tokens).")
        p = req.params
        bad_stop = [t for t in p.stop_token_ids if t < 0 or t >= self.vocab_size]
        if bad_stop:
            raise SamplingParamsError("stop_token_ids", f"sampling_params.stop_token_ids contains {bad_stop[0]}, "
                                      f"outside the vocabulary [0, {self.vocab_size})")
        if p.min_new_tokens > 0:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self._eos)
            if len(stops) >= self.vocab_size:
                raise SamplingParamsError("min_new_tokens", "sampling_params.min_new_tokens > 0 masks every stop "
                                          "token, but stop_token_ids (with EOS) cover the whole vocabulary")
        if p.stop and self.tokenizer is None:
            raise SamplingParamsError("stop", "sampling_params.stop needs a tokenizer (start the server with --tokenizer-path)")

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest],
                 is_aborted: Optional[Callable[[int], bool]] = None) -> list[list[GenerationOutput]]:
        """Complete every request `params.n` times in one batch; result[i][j] is sample j of request i.

        `is_aborted(i)` is polled each step; rows of an aborted request finish with an abort reason.
        """
        for req in requests:
            self.check_request(req)
        with self._lock:
            return self._generate(list(requests), is_aborted)

    def _generate(self, requests: list[GenerationRequest], is_aborted) -> list[list[GenerationOutput]]:
        rows: list[tuple[int, int]] = []  # (request index, sample index), prompt-major
        gens: list[torch.Generator] = []
        for i, req in enumerate(requests):
            base = req.params.sampling_seed
            if base is None:
                base = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            for j in range(req.params.n):
                rows.append((i, j))
                gens.append(torch.Generator().manual_seed(_seed_for(base, j)))
        nrows = len(rows)
        prompts = [requests[i].input_ids for i, _ in rows]
        params = [requests[i].params for i, _ in rows]
        budget = [min(p.max_new_tokens, self.max_context_len - len(ids)) for p, ids in zip(params, prompts)]
        stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else self._eos) for p in params]
        out_ids: list[list[int]] = [[] for _ in range(nrows)]
        out_lp: list[list[float]] = [[] for _ in range(nrows)]
        reasons: list[Optional[dict]] = [None] * nrows
        for r in range(nrows):
            if budget[r] <= 0:
                reasons[r] = {"type": "length", "length": params[r].max_new_tokens}

        # capped at float32's largest value: beyond it the tensor would hold inf, and a masked (-inf) logit
        # divided by inf is NaN; the capped value gives the same (uniform) distribution
        temp = torch.tensor([min(max(p.temperature, GREEDY_TEMPERATURE), MAX_TEMPERATURE) for p in params])
        greedy = torch.tensor([p.greedy for p in params])
        # a top_k beyond the vocabulary keeps every token (and may not fit an int64)
        top_k = torch.tensor([min(p.top_k, self.vocab_size) for p in params])
        top_p = torch.tensor([float(p.top_p) for p in params])
        min_p = torch.tensor([float(p.min_p) for p in params])

        active = [r for r in range(nrows) if reasons[r] is None]
        if active:
            width = max(len(prompts[r]) for r in active)
            pad = 0
            ids = torch.full((len(active), width), pad, dtype=torch.long)
            mask = torch.zeros((len(active), width), dtype=torch.long)
            for k, r in enumerate(active):
                n = len(prompts[r])
                ids[k, width - n:] = torch.tensor(prompts[r])
                mask[k, width - n:] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            capacity = width + max(budget[r] for r in active)
            logits, cache = self._forward(ids, mask, positions, self._new_cache(capacity), last_only=True)
            logits = logits[:, -1]
            next_pos = positions[:, -1] + 1
        while active:
            idx = torch.tensor(active)
            tokens, logprobs = self._choose(logits, idx, temp, greedy, top_k, top_p, min_p,
                                            [gens[r] for r in active],
                                            [stop_ids[r] if len(out_ids[r]) < params[r].min_new_tokens else None
                                             for r in active])
            keep: list[int] = []
            for k, r in enumerate(active):
                tok = int(tokens[k])
                out_ids[r].append(tok)
                out_lp[r].append(float(logprobs[k]))
                if tok in stop_ids[r]:
                    reasons[r] = {"type": "stop", "matched": tok}
                elif params[r].stop and (hit := self._stop_string_hit(out_ids[r], params[r])) is not None:
                    reasons[r] = {"type": "stop", "matched": hit}
                elif len(out_ids[r]) >= budget[r]:
                    reasons[r] = {"type": "length", "length": len(out_ids[r])}
                elif is_aborted is not None and is_aborted(rows[r][0]):
                    reasons[r] = {"type": "abort", "message": "Abort request"}
                else:
                    keep.append(k)
            if not keep:
                break
            if len(keep) < len(active):
                sel = torch.tensor(keep)
                cache.batch_select_indices(sel)
                mask, next_pos, tokens = mask[sel], next_pos[sel], tokens[sel]
                active = [active[k] for k in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype)], dim=1)
            logits, cache = self._forward(tokens[:, None], mask, next_pos[:, None], cache, last_only=True)
            logits = logits[:, -1]
            next_pos = next_pos + 1

        results: list[list[GenerationOutput]] = [[] for _ in requests]
        for r, (i, _) in enumerate(rows):
            results[i].append(GenerationOutput(
                output_ids=out_ids[r], logprobs=out_lp[r], finish_reason=reasons[r] or {"type": "abort", "message": "internal"},
                prompt_tokens=len(prompts[r]), text=self._detok(out_ids[r], params[r], reasons[r])))
        return results

    def _choose(self, logits: torch.Tensor, idx: torch.Tensor, temp, greedy, top_k, top_p, min_p,
                gens: list[torch.Generator], min_len_masks: list[Optional[set[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick the next token of each active row; returns (tokens [A], raw-logit log-probs [A])."""
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        proc = logits.clone()
        for k, banned in enumerate(min_len_masks):
            if banned:
                proc[k, list(banned)] = float("-inf")
        g_rows = greedy[idx]
        tokens = torch.empty(len(gens), dtype=torch.long)
        probs = None
        if not bool(g_rows.all()):
            probs = torch.softmax(proc / temp[idx][:, None], dim=-1)
            k, p, m = top_k[idx], top_p[idx], min_p[idx]
            if bool((k > 0).any() | (p < 1.0).any() | (m > 0).any()):  # the sort is the costly part on big vocabularies
                probs = filter_probs(probs, k, p, m)
        if bool(g_rows.any()):
            tokens[g_rows] = proc[g_rows].argmax(dim=-1)
        sampled = (~g_rows).nonzero()[:, 0]
        if sampled.numel():
            # one uniform per row from the row's own generator (its samples never depend on the batch), then one
            # batched inverse-CDF draw: the first token whose cumulative probability exceeds u (never a zero-probability one)
            u = torch.cat([torch.rand(1, generator=gens[k], dtype=torch.float64) for k in sampled.tolist()])
            cdf = probs[sampled].double().cumsum(dim=-1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            tokens[sampled] = pick.clamp(max=probs.shape[-1] - 1)
        return tokens, raw_logprobs.gather(-1, tokens[:, None])[:, 0]

    def _stop_string_hit(self, ids: list[int], params: SamplingParams) -> Optional[str]:
        """The first stop string found in the tail of the decoded completion, if any."""
        longest = max(len(s) for s in params.stop)
        # a stop string cannot span more tokens than characters, plus one for a partial token
        tail = self.tokenizer.decode(ids[-(longest + 1):], skip_special_tokens=False)
        for s in params.stop:
            if s in tail:
                return s
        return None

    def _detok(self, ids: list[int], params: SamplingParams, reason: Optional[dict]) -> Optional[str]:
        """Completion text as SGLang returns it (stop token / string trimmed unless no_stop_trim)."""
        if self.tokenizer is None:
            return None
        matched = (reason or {}).get("matched")
        if isinstance(matched, int) and not params.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                     spaces_between_special_tokens=params.spaces_between_special_tokens)
        if isinstance(matched, str) and not params.no_stop_trim:
            pos = text.find(matched)
            if pos != -1:
                text = text[:pos]
        return text

    def token_text(self, token_id: int) -> Optional[str]:
        """Text of one token (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; needs a tokenizer."""
        if self.tokenizer is None:
            raise InvalidRequest("text input needs a tokenizer (start the server with --tokenizer-path), or send input_ids")
        return list(self.tokenizer.encode(text))
