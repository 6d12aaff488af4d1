"""The tables of tools/ratio_error_sources.py (megatron_rl/study/ratio_error_sources.py) on synthetic errors: shares add
up, the tail is found where it was put, and the GEMM variants name every linear the way the learner does."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.study import ratio_error_sources as res


def _errors():
    rng = np.random.default_rng(0)
    seq = np.repeat(np.arange(100), 40)
    e = rng.normal(0, 1e-3, seq.size)
    e[seq == 7] += rng.normal(0, 0.5, 40)  # one answer holds the tail
    return e, seq


def test_one_answer_with_the_tail_holds_it():
    e, seq = _errors()
    thr = float(np.percentile(np.abs(e), 99))
    rows = res.sequence_concentration(e, seq, thr)
    top1 = rows[0]
    assert top1["sequences"] == 1 and top1["sq_share"] > 0.99 and top1["tail_share"] == 1.0
    assert rows[-1]["sequences"] == 1  # answers with any tail token
    assert all(a["sq_share"] <= b["sq_share"] for a, b in zip(rows[:2], rows[1:3]))


def test_bucket_shares_add_up_and_find_the_tail():
    e, seq = _errors()
    thr = float(np.percentile(np.abs(e), 99))
    key = (seq == 7).astype(float)  # bucket [0.5, 2) is the tail's answer
    rows = res.bucket_table(e, key, (0.0, 0.5, 2.0), thr)
    assert abs(sum(r["sq_share"] for r in rows) - 1) < 1e-12 and abs(sum(r["tail_share"] for r in rows) - 1) < 1e-12
    assert rows[1]["tail_share"] == 1.0 and rows[1]["n"] == 40


def test_error_stats_against_the_baseline():
    e, _ = _errors()
    thr = float(np.percentile(np.abs(e), 99))
    same = res.error_stats(e, thr, e)
    half = res.error_stats(e / 2, thr, e)
    assert same["sq_left"] == 1.0 and same["tail_left"] == 1.0
    assert abs(half["sq_left"] - 0.25) < 1e-12 and half["tail_left"] == 1.0  # the tail is 100x the threshold
    assert res.error_stats(e / 1000, thr, e)["tail_left"] == 0.0


def test_variants_cover_layers_and_roles():
    names = [f"decoder.layers.{i}.{suffix}" for i in range(2) for suffix in res.ROLES.values()]
    plan = res.variants(names, 2)
    by_label = {label: hp for _, label, hp in plan}
    assert by_label["all low precision"] == []
    assert len(by_label["layer 1 in hp"]) == 4 and all(".1." in n for n in by_label["layer 1 in hp"])
    assert sorted(by_label["only layer 1 in lp"]) == sorted(by_label["layer 0 in hp"])
    assert by_label["fc2 in hp"] == [n for n in names if n.endswith("linear_fc2")]
    assert len(by_label["only qkv in lp"]) == 6
    assert len(plan) == 1 + 2 + 2 + 4 + 4
    names3 = [f"decoder.layers.{i}.{suffix}" for i in range(3) for suffix in res.ROLES.values()]
    assert ("ends hp", "layers 0 and 2 in hp", [n for n in names3 if ".0." in n or ".2." in n]) in res.variants(names3, 3)


def test_predictor_capture_ranks_answers_by_their_scores():
    # 10 answers of 4 tokens; answer 7 holds all the error. A score that marks it captures everything, one that
    # marks another answer nothing; the oracle always everything; chance is the picked share.
    seq = np.repeat(np.arange(10), 4)
    e = np.zeros(40)
    e[7 * 4 + 2] = 0.5
    marks_7 = np.where(seq == 7, 0.2, 0.01)
    marks_3 = np.where(seq == 3, 0.2, 0.01)
    rows = {r["predictor"]: r for r in res.predictor_capture(e, seq, {"sum right": marks_7, "max wrong": marks_3}, 0.1)}
    assert rows["oracle: sum e^2"]["sq_share"] == pytest.approx(1.0)
    assert rows["sum right"]["sq_share"] == pytest.approx(1.0) and rows["sum right"]["tail_share"] == pytest.approx(1.0)
    assert rows["max wrong"]["sq_share"] == 0.0
    assert rows["chance"]["sq_share"] == pytest.approx(0.1) and rows["chance"]["answers"] == 1
