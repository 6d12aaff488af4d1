"""The deep miniature's task (addition_trace) and the malformed metric: the trace is right by an independent
reading, every generated answer parses in the registered format, garbled ones do not, and the reward phase
reports the malformed fraction only for prompts whose task has a format."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.data.tasks import answer_format, carry_trace, generate, malformed_checker
from megatron_rl.phases.reward import score
from megatron_rl.reward import get_reward_fn
from megatron_rl.types import RolloutBatch, Sample


def _read_trace(text: str) -> tuple[list[tuple[int, int, int, int]], int]:
    """(columns (x, y, carry, column sum), final sum) of a trace, by plain string splitting."""
    body, total = text.split(":")
    cols = []
    for col in body.split(","):
        lhs, rhs = col.split("=")
        x, y, c = (int(v) for v in lhs.split("+"))
        cols.append((x, y, c, int(rhs)))
    return cols, int(total)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6).flatmap(lambda d: st.tuples(st.integers(10 ** (d - 1), 10**d - 1), st.integers(10 ** (d - 1), 10**d - 1))))
def test_trace_columns_add_up_and_end_in_the_sum(ab):
    a, b = ab
    cols, total = _read_trace(carry_trace(a, b))
    assert total == a + b
    assert [(x, y) for x, y, _, _ in cols] == [(int(p), int(q)) for p, q in zip(str(a)[::-1], str(b)[::-1])]
    carry = 0
    for x, y, c, s in cols:
        assert c == carry and s == x + y + c
        carry = s // 10
    assert answer_format("addition_trace").fullmatch(carry_trace(a, b))


def test_generated_rows_are_long_parse_and_score():
    rows = generate("addition_trace", 300, seed=3, digits=4)
    assert all(r.meta["task"] == "addition_trace" for r in rows)
    assert min(len(r.answer) for r in rows) >= 40  # + EOS: >= 41 generated tokens
    assert {len(r.prompt) for r in rows} == {10}
    check = malformed_checker(rows)
    reward = get_reward_fn("exact_match")
    for r in rows[:50]:
        assert not check(r.answer) and reward(r.answer, r.answer) == (1.0, True)
        a, b = (int(v) for v in r.prompt[:-1].split("+"))
        assert r.answer == carry_trace(a, b)


@pytest.mark.parametrize("text, malformed", [
    ("8+5+0=13,3+6+1=10,7+2+1=10,4+9+1=14:14003", False),
    ("8+5+0=13,3+6+1=10,7+2+1=10,4+9+1=14:99999", False),  # wrong but parses: an error, not garbage
    ("  8+5+0=13:13 ", False),
    ("8+5+0=13,3+6+1=10,7+2+1=10,4+9+1=14", True),  # no final sum
    ("8+5+0=13,,3+6+1=10:1", True),
    ("8+5+2=13:1", True),  # a carry is 0 or 1
    ("8+5+0=3:3", True),  # column sums have two digits
    ("14003", True),
    ("", True),
])
def test_malformed_is_the_format_not_the_value(text, malformed):
    assert malformed_checker([PromptRow("1234+5678=", "x", {"task": "addition_trace"})])(text) is malformed


def test_no_check_without_one_task_that_has_a_format():
    assert malformed_checker([PromptRow("1+1=", "2")]) is None  # user data without a task key
    mixed = [PromptRow("1+1=", "2", {"task": "addition"}), PromptRow("1234+5678=", "x", {"task": "addition_trace"})]
    assert malformed_checker(mixed) is None
    assert malformed_checker([PromptRow("1+1=", "2", {"task": "addition"})])("12") is False
    assert malformed_checker([PromptRow("1+1=", "2", {"task": "addition"})])("1 2") is True


def test_score_reports_the_malformed_fraction_only_with_a_check():
    rows = generate("addition_trace", 4, seed=1)
    texts = [rows[0].answer, "garbage", rows[2].answer[:-1] + "x", rows[3].answer]
    samples = [Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop", group_id=0,
                      answer=r.answer, response_text=t) for r, t in zip(rows, texts)]
    batch = RolloutBatch(samples=samples, n_per_prompt=4)
    reward = get_reward_fn("exact_match")
    m = score(batch, reward, AlgoConfig(), max_new_tokens=48, is_malformed=malformed_checker(rows))
    assert m["malformed/train"] == pytest.approx(0.5) and m["accuracy/train"] == pytest.approx(0.5)
    assert "malformed/train" not in score(batch, reward, AlgoConfig(), max_new_tokens=48)
