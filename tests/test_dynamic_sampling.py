"""DAPO dynamic sampling as a phase: groups without reward spread are dropped and refilled round by round, up to
algo.dapo.max_gen_batches; the prompt stream and round seeds that feed the rounds."""
from __future__ import annotations

import pytest

from megatron_rl.config.algo import DapoConfig
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.phases.reward import DynamicSamplingError, GroupCollector
from megatron_rl.phases.rollout import PromptStream, round_seed
from megatron_rl.types import RolloutBatch, Sample

N = 4


def _round(rewards_per_group: list[list[float]], tag: str) -> RolloutBatch:
    samples = []
    for g, rewards in enumerate(rewards_per_group):
        for r in rewards:
            samples.append(Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-0.1, -0.2], finish_reason="stop",
                                  group_id=g, answer=f"{tag}{g}", reward=r))
    return RolloutBatch(samples=samples, n_per_prompt=N, stats={"rollout/time_s": 2.0, "rollout/response_len_mean": 2.0})


SPREAD, SOLVED, FAILED = [1.0, 0.0, 1.0, 0.0], [1.0] * N, [0.0] * N


def test_rounds_refill_until_full_then_surplus_is_dropped():
    c = GroupCollector(3, DapoConfig(dynamic_sampling=True, max_gen_batches=5))
    rounds = [_round([SPREAD, SOLVED, FAILED], "a"), _round([SOLVED, SOLVED, FAILED], "b"), _round([SPREAD, SPREAD, SOLVED], "c")]
    used = 0
    while c.needs_more():
        c.add(rounds[used], {"reward/mean": [0.5, 0.5, 0.6][used]})
        used += 1
    assert used == 3
    batch, metrics = c.result()
    # the kept groups in order: a0, c0, c1 (a surplus group would be cut), renumbered 0..2, prompt-major
    assert [s.answer for s in batch.samples[::N]] == ["a0", "c0", "c1"]
    assert [s.group_id for s in batch.samples] == [g for g in range(3) for _ in range(N)]
    assert metrics["dapo/gen_batches"] == 3.0
    assert metrics["dapo/filtered_frac"] == pytest.approx(6 / 9) == metrics["groups/no_spread_frac"]
    assert metrics["rollout/time_s"] == 6.0  # times add up; per-sample means are weighted over all rounds
    assert metrics["reward/mean"] == pytest.approx((0.5 + 0.5 + 0.6) / 3)
    assert metrics["rollout/tokens_per_s"] == pytest.approx(2.0 * 36 / 6.0)


def test_cap_reached_names_the_field():
    c = GroupCollector(2, DapoConfig(dynamic_sampling=True, max_gen_batches=2))
    with pytest.raises(DynamicSamplingError, match=r"algo\.dapo\.max_gen_batches=2: 2 generation rounds .* only 1 of the 2"):
        while c.needs_more():
            c.add(_round([SPREAD, SOLVED] if c.rounds == 0 else [SOLVED, FAILED], "x"), {})


def test_without_dynamic_sampling_one_round_keeps_every_group():
    c = GroupCollector(3, DapoConfig(dynamic_sampling=False))
    assert c.needs_more()
    c.add(_round([SPREAD, SOLVED, FAILED], "a"), {})
    assert not c.needs_more()
    batch, metrics = c.result()
    assert len(batch.samples) == 3 * N and "dapo/gen_batches" not in metrics
    assert metrics["groups/no_spread_frac"] == pytest.approx(2 / 3)


def test_prompt_stream_reads_a_seeded_shuffle_per_epoch_from_its_cursor():
    rows = [PromptRow(f"{i}+0=", str(i)) for i in range(10)]
    a = PromptStream(rows, seed=5)
    first = a.take(4) + a.take(4) + a.take(4)  # crosses into epoch 1
    assert sorted(r.prompt for r in first[:10]) == sorted(r.prompt for r in rows)
    b = PromptStream(rows, seed=5, cursor=8)
    assert b.take(4) == first[8:]
    assert round_seed(3, 7, 0) == 3 * 1_000_003 + 7 and len({round_seed(3, 7, k) for k in range(5)}) == 5
