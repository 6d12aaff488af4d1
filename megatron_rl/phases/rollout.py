"""Rollout phase: prompts -> SGLang /generate (through the HTTP client) -> Samples; and greedy eval."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.reward import RewardFn
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.types import RolloutBatch, Sample


class PromptStream:
    """The training prompts in a per-epoch seeded shuffle, read from a cursor (saved in checkpoints, so resume is exact).

    Without dynamic sampling step k reads prompts [k * per_step, (k + 1) * per_step); DAPO's extra
    generation rounds read further, as DAPO's dataloader does.
    """

    def __init__(self, rows: Sequence[PromptRow], seed: int, cursor: int = 0) -> None:
        """Stream `rows` shuffled with `seed + epoch`, starting at prompt number `cursor`."""
        self.rows, self.seed, self.cursor = rows, seed, cursor
        self._perms: dict[int, torch.Tensor] = {}

    def take(self, count: int) -> list[PromptRow]:
        """The next `count` prompts (the cursor advances)."""
        out = []
        for k in range(self.cursor, self.cursor + count):
            epoch, offset = divmod(k, len(self.rows))
            if epoch not in self._perms:
                self._perms = {epoch: torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + epoch))}  # device-ok: seeded host draw
            out.append(self.rows[int(self._perms[epoch][offset])])
        self.cursor += count
        return out


def round_seed(seed: int, step: int, generation_round: int) -> int:
    """Sampling seed of a step's generation round (round 0 keeps the step's historical seed; DAPO refills draw new ones)."""
    base = int(seed) * 1_000_003 + step
    return base if generation_round == 0 else (base + generation_round * 1_000_000_007) % (2**62)


def encode_prompts(tokenizer, rows: Sequence[PromptRow]) -> list[list[int]]:
    """Token ids of each prompt (no special tokens: the task format is the whole context)."""
    ids = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in rows]
    for k, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {k} ({rows[k].prompt!r}) encodes to no tokens")
    return ids


def sampling_params(cfg: RolloutConfig, seed: int, n: int, eos_token_id: int) -> dict:
    """SGLang sampling_params for training rollouts (only keys SGLang accepts)."""
    s = cfg.sampling
    return {
        "n": n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": sorted(set(s.stop_token_ids) | {eos_token_id}),
        "sampling_seed": int(seed),
        "skip_special_tokens": False,
    }


def _decode_response(tokenizer, response_ids: list[int]) -> str:
    """Completion text with the stop token removed."""
    return tokenizer.decode(response_ids, skip_special_tokens=True)


def prompt_seed(seed: int, k: int) -> int:
    """sampling_seed of the k-th prompt of a step seeded `seed`: every prompt draws its own random stream."""
    return (int(seed) * 1_000_003 + k) % (2**62)


def _weight_version(samples: Sequence[Sample]) -> float:
    """The oldest weight version that produced `samples` (nan if an engine reports a non-numeric one)."""
    try:
        return float(min(int(s.weight_version) for s in samples))
    except ValueError:
        return float("nan")


def generate_samples(client: RolloutClient, tokenizer, rows: Sequence[PromptRow], cfg: RolloutConfig, seed: int) -> RolloutBatch:
    """n samples per prompt (prompt-major), with engine log-probs and decoded text."""
    prompt_ids = encode_prompts(tokenizer, rows)
    n = cfg.n_samples_per_prompt
    start = time.perf_counter()
    # one seed per prompt (not one per step): otherwise sample j of every prompt shares its random draws
    params = [sampling_params(cfg, prompt_seed(seed, k), n, tokenizer.eos_token_id) for k in range(len(prompt_ids))]
    results = client.generate_batch_sync(prompt_ids, params)
    elapsed = time.perf_counter() - start
    samples: list[Sample] = []
    for group_id, (row, ids, outs) in enumerate(zip(rows, prompt_ids, results)):
        for out in outs:
            if len(out.logprobs) != len(out.output_ids):
                raise ValueError(f"engine returned {len(out.logprobs)} log-probs for {len(out.output_ids)} tokens")
            sample = out.to_sample(ids, group_id, row.answer)
            sample.response_text = _decode_response(tokenizer, sample.response_ids)
            samples.append(sample)
    lengths = [len(s.response_ids) for s in samples]
    stats = {
        "rollout/time_s": elapsed,
        "rollout/tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
        "rollout/response_len_mean": sum(lengths) / max(len(lengths), 1),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1),
        "rollout/empty_frac": sum(n_ == 0 for n_ in lengths) / max(len(lengths), 1),
        "rollout/weight_version": _weight_version(samples) if samples else float("nan"),
    }
    return RolloutBatch(samples=samples, n_per_prompt=n, stats=stats)


def greedy_eval(client: RolloutClient, tokenizer, rows: Sequence[PromptRow], reward_fn: RewardFn, max_new_tokens: int,
                is_malformed: Optional[Callable[[str], bool]] = None) -> dict[str, float]:
    """Greedy completions of held-out prompts: {"accuracy": fraction the reward marks correct, "malformed": fraction
    that does not parse in the task's format (only with `is_malformed`)}."""
    if not rows:
        return {"accuracy": float("nan")}
    params = {"n": 1, "temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": [tokenizer.eos_token_id]}
    results = client.generate_batch_sync(encode_prompts(tokenizer, rows), params, return_logprob=False)
    correct = malformed = 0
    for row, outs in zip(rows, results):
        text = _decode_response(tokenizer, outs[0].output_ids)
        _, ok = reward_fn(text, row.answer)
        correct += int(ok)
        malformed += int(is_malformed(text)) if is_malformed is not None else 0
    out = {"accuracy": correct / len(rows)}
    if is_malformed is not None:
        out["malformed"] = malformed / len(rows)
    return out


def greedy_accuracy(client: RolloutClient, tokenizer, rows: Sequence[PromptRow], reward_fn: RewardFn, max_new_tokens: int) -> float:
    """Fraction of held-out prompts whose greedy completion the reward function marks correct."""
    return greedy_eval(client, tokenizer, rows, reward_fn, max_new_tokens)["accuracy"]
