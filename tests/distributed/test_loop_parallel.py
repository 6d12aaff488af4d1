"""The tiny calibrated RL run under torchrun (gloo) with DP=2, TP=2, PP=2 and CP=2 equals the single-process run.

Same warm start, seed and global batch; per-step bounds (calib/lower, calib/upper, targets, the
unsmoothed solve calib/solve_*), losses, clip fractions and every other logged metric must match the
DP=1 run to ~1e-5, and the rollouts (all 16 sampled texts of each step) must be identical. The
calibration state lives on the last pipeline stage, so under PP=2 these metrics come from stage 1 and
rank 0 (stage 0) only logs them: the PP=2 run is also stopped after its first step and resumed from
the checkpoint, which must restore the calibrated bounds, the held targets and every calibration metric
(the resumed step 1 is not a calibration event: under the default bounds_update per_step it solves its own
tokens at the targets the checkpoint holds). The multi-process runs sync
weights with the other transports (DP=2 and PP=2: `tensor`, under PP=2 from both stages' senders; TP=2:
`distributed` over gloo) while the reference uses `disk`, so identical rollouts also show that every transport
leaves the engine with the same weights. The engines run in their default SGLang 0.5.23 mode, which refuses
a distributed or tensor update outside a weight-update session. (tests/distributed/test_weight_sync_parallel.py
has `distributed` under PP=2 and `tensor` under TP=2, with a 0.5.8-mode engine beside a 0.5.23 one.)

Every run dumps its calibration tokens; an independent implementation of the spec
(tests/calibration_spec.py) recomputes alpha, rho, L and H of each step's solve (per_step: every step;
targets from the events' shadow rows, shadow_fraction 0.5) from the union of the rank files (one per
DP x CP rank of the last stage, TP rank 0 only) and must get the logged solve, whichever advantage signs
the event's shadow rows hold (they come from this machine's rollouts: on one CPU step 2's shadow rows held
only negative tokens, and the spec then keeps the previous rho).

Layout notes. The DP=1, TP=2, PP=2 and CP=2 runs use micro-batches of 8 rows; the DP=2 run 4 rows per
rank. The statistics of a solve pool every off-policy micro-batch of the step and are reduced once,
so micro-batching does not change them. The learner runs without FP8 here: FP8 quantization is not
layout-invariant (under TP the 1x128 activation groups of linear_proj cover a 64-wide shard) and
turns last-bit differences of the DP gradient sum into different FP8 roundings after the first
update; the calibration machinery (shadow pass, pooled targets, collective solve) runs all the same.
Without FP8 the shadow and the learner ratios agree, so the solve lands on the reference bounds'
neighbours; relax_only is off so that those calibrated bounds differ from the defaults at all.
"""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from calibration_spec import check_run_dumps
from rl_runs import comparable, tiny_overrides, train, warm_start

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 3
# constant lr: the PP=2 run is stopped by train.steps=1 and resumed with train.steps=3, and a decaying schedule is
# re-planned over the new total on resume (tests/test_checkpoint.py), which an uninterrupted run never does
COMMON = (f"train.steps={STEPS}", "optim.lr_decay_style=constant", "precision.recipe=none", "precision.rollout_quantization=none",
          "algo.calibration.calibrate_every=2", "algo.calibration.relax_only=false", "algo.calibration.strength=full",
          "algo.calibration.shadow_fraction=0.5", "tracking.log_samples=16",
          "tracking.dump_ratios=true")
SPEC = dict(quantile="next_tokens")  # per_step (the default) solves for the next step's tokens
CALIB_KEYS = ("calib/lower", "calib/upper", "calib/alpha_target", "calib/rho_target", "calib/alpha_achieved",
              "calib/rho_achieved")


# every pipeline stage streams its own layers in its own buckets, so the bucket count depends on PP (sync/bytes does not)
LAYOUT_DEPENDENT = ("sync/buckets",)


def _assert_same(reference: list[dict], other: list[dict], name: str) -> None:
    assert [r["step"] for r in other] == [r["step"] for r in reference], name
    for ref, got in zip(reference, other):
        ref, got = comparable(ref), comparable(got)
        for key in LAYOUT_DEPENDENT:
            ref.pop(key, None), got.pop(key, None)
        assert sorted(got) == sorted(ref), f"{name}: metric keys differ: {sorted(set(got) ^ set(ref))}"
        for key, want in ref.items():
            have = got[key]
            if isinstance(want, float) and isinstance(have, float):
                # a layout sums in another order (CP's split attention, TP's reduce-scatter, DP's all-reduce): fp32
                # figures such as the grad norm move by ~1e-5 relative (1.4e-5 seen for CP=2 on ATen's AVX2 path)
                assert math.isclose(have, want, rel_tol=1e-4, abs_tol=1e-5), \
                    f"{name} step {ref['step']}: {key} = {have}, single process {want}"
            else:
                assert have == want, f"{name} step {ref['step']}: {key} = {str(have)[:200]}, single process {str(want)[:200]}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(warm start, rows of the single-process reference run)."""
    warm = warm_start(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("loop") / "dp1"
    rows = train(run_dir, tiny_overrides(warm, *COMMON, "train.micro_batch_size=8"))
    # the comparison must be about calibrated bounds, not the defaults 1 - eps_low / 1 + eps_high
    assert any(abs(r["calib/lower"] - 0.8) > 1e-3 or abs(r["calib/upper"] - 1.2) > 1e-3 for r in rows)
    assert any(r["groups/no_spread_frac"] < 1.0 for r in rows)
    # the held bounds are always finite (spec 2.4); a target or achieved value of a side without tokens is logged
    # as null (rho_target is inf when the first event's shadow rows had no negative mass), never left out
    assert all(math.isfinite(r["calib/lower"]) and math.isfinite(r["calib/upper"]) for r in rows)
    assert all(k in r for r in rows for k in CALIB_KEYS)
    assert [("calib/solve_lower" in r) for r in rows] == [True, True, True]  # per_step: every step solves
    assert [("hp/clipfrac" in r) for r in rows] == [True, False, True]  # shadow events at steps 0 and 2
    assert check_run_dumps(run_dir, rows, ranks=1, eps_low=0.2, eps_high=0.2, relax_only=False, **SPEC) == [0, 1, 2]
    return warm, rows


@pytest.mark.parametrize("layout,overrides,dump_ranks", [
    ("DP=2", ("train.micro_batch_size=4", "rollout.weight_sync.transport=tensor"), 2),
    ("TP=2", ("train.micro_batch_size=8", "parallel.tensor_model_parallel_size=2",
              "rollout.weight_sync.transport=distributed"), 1),
    ("CP=2", ("train.micro_batch_size=8", "parallel.context_parallel_size=2"), 2),
])
def test_layout_matches_single_process(single, tmp_path, layout, overrides, dump_ranks):
    warm, reference = single
    # DP=2 under torchrun itself (fresh interpreters, torchrun's agent and rendezvous: the README's launch); the other
    # layouts' ranks are forked with torchrun's worker variables (tests/cli_forkserver.py), as is the reference
    rows = train(tmp_path / "run", tiny_overrides(warm, *COMMON, *overrides), nproc=2, torchrun=layout == "DP=2")
    _assert_same(reference, rows, layout)
    assert check_run_dumps(tmp_path / "run", rows, ranks=dump_ranks, eps_low=0.2, eps_high=0.2, relax_only=False,
                           **SPEC) == [0, 1, 2]


def test_pp2_matches_single_process_and_resumes_calibrated(single, tmp_path):
    from megatron_rl.trainer.checkpoint import RL_STATE_FILE, latest_checkpoint

    warm, reference = single
    run_dir = tmp_path / "pp2"
    pp = tiny_overrides(warm, *COMMON, "train.micro_batch_size=8", "parallel.pipeline_model_parallel_size=2",
                        "rollout.weight_sync.transport=tensor")
    first = train(run_dir, [*pp, "train.steps=1"], nproc=2)  # stops after step 0 (an event) with a checkpoint
    held = pickle.loads((Path(latest_checkpoint(run_dir / "checkpoints")) / RL_STATE_FILE).read_bytes())["clipper"]
    # what rank 0 checkpointed is the last stage's calibrated state, not stage 0's defaults
    assert (held["lower"], held["upper"]) == (first[0]["calib/lower"], first[0]["calib/upper"])
    assert (held["lower"], held["upper"]) != pytest.approx((0.8, 1.2))
    rows = train(run_dir, pp, nproc=2)  # resumes at step 1
    _assert_same(reference, rows, "PP=2 (resumed after step 0)")
    assert all(k in rows[1] for k in CALIB_KEYS)  # nothing calibration logs is lost by a resume (values: _assert_same)
    assert check_run_dumps(run_dir, rows, ranks=1, eps_low=0.2, eps_high=0.2, relax_only=False, **SPEC) == [0, 1, 2]


EPS = 0.05
"""The decision tests' clip range: narrow, so that one off-policy update clips tokens on every CPU's kernels (at 0.2
the step-0 update of ATen's plain path clipped none, and the comparison would be about two zeros)."""
DECISION = ("train.steps=1", "algo.calibration.enabled=true", "algo.calibration.strength=decision",
            f"algo.policy_loss.eps_low={EPS}", f"algo.policy_loss.eps_high={EPS}", "tracking.dump_ratios=true")
"""Calibration's strength=decision, with its events beside it. The other route to the same clip decision,
algo.policy_loss.clip_decision=high_precision, forwards and gathers through the same phases/error_scale functions (the
config only sets their k to 0: tests/test_experimental_instrument.py), and runs through the loop in one process in
tests/test_dose_instrument_run.py; one DP=2 run of it here cost two more launches of this, the suite's longest, file."""
NEAR_BOUND = 1e-3
"""|log r_hp - log bound| within which two layouts may decide a token differently: their first updates differ in the
last bits of reduction order (PP's gradient norm is summed over stages), which moves r_hp by ~1e-7, far inside this."""


@pytest.fixture(scope="module")
def decision_single(tmp_path_factory):
    """Single-process strength=decision runs by micro-batch size: (warm start, {size: (run dir, rows)}), made on demand.

    Each layout is compared with the single process of its own micro-batch size: the blockwise FP8 learner quantizes
    its weight-gradient operands in 128-token blocks, so micro-batches of 4 and of 8 rows give different first updates,
    while DP=2 x 4 rows sums the same two micro-batch gradients that a single process of 4 rows accumulates."""
    warm = warm_start(tmp_path_factory)
    made: dict[int, tuple[Path, list[dict]]] = {}

    def rows_for(micro_batch_size: int) -> tuple[Path, list[dict]]:
        if micro_batch_size not in made:
            run_dir = tmp_path_factory.mktemp("decision") / f"mbs{micro_batch_size}"
            rows = train(run_dir, tiny_overrides(warm, *DECISION, f"train.micro_batch_size={micro_batch_size}"))
            assert rows[0]["experimental/hp_clipfrac_lower_neg"] > 0  # about clipped tokens, not two zeros
            made[micro_batch_size] = (run_dir, rows)
        return made[micro_batch_size]

    return warm, rows_for


def _tokens_by_update(run_dir: Path) -> dict[str, np.ndarray]:
    """Step 0's dumped tokens (every rank file), ordered by update and then by rank: the single process's row order."""
    files = sorted((run_dir / "calibration").glob("step_000000.rank*.npz"))
    parts = [dict(np.load(f)) for f in files]
    assert parts, f"no ratio dumps under {run_dir}"
    updates = sorted({int(u) for part in parts for u in part["minibatch"]})
    return {key: np.concatenate([part[key][part["minibatch"] == u] for u in updates for part in parts])
            for key in ("ratio_hp", "adv")}


@pytest.mark.trajectory  # its clip decisions sit closest to a one-token flip; the layout tests compare at 1e-4
@pytest.mark.parametrize("layout", [
    ("train.micro_batch_size=4",),
    ("train.micro_batch_size=8", "parallel.pipeline_model_parallel_size=2"),
], ids=["decision_dp2", "decision_pp2"])
def test_high_precision_clip_decision_under_dp2_and_pp2(decision_single, tmp_path, layout):
    """strength=decision with DP=2 or PP=2: every DP rank forwards its shard of pi_old and of each update's policy in high
    precision and the rows are gathered back in place (PP: the last stage's log-probs reach every stage like pi_old's).
    Against the single process of the same micro-batch size: the same tokens get the same high-precision ratios (to
    1e-5) and, away from the bounds, the same clip decisions; in both runs the loss clips what high precision clips."""
    warm, rows_for = decision_single
    micro_batch_size = int(layout[0].split("=")[1])
    single_dir, single = rows_for(micro_batch_size)
    parallel = train(tmp_path / "run", tiny_overrides(warm, *DECISION, *layout, "rollout.weight_sync.transport=tensor"),
                     nproc=2)
    for rows in (single, parallel):  # the loss's clip is the high-precision one, exactly: one mask decides both
        for side in ("clipfrac", "clipfrac_lower_neg", "clipfrac_upper_pos"):
            assert rows[0][side] == rows[0][f"experimental/hp_{side}"], side
    ref, got = _tokens_by_update(single_dir), _tokens_by_update(tmp_path / "run")
    assert np.array_equal(ref["adv"], got["adv"])  # the same rollouts and tokens, in the same order
    np.testing.assert_allclose(got["ratio_hp"], ref["ratio_hp"], rtol=1e-5, atol=0)
    log_ref, log_got = np.log(ref["ratio_hp"]), np.log(got["ratio_hp"])
    lower, upper = math.log(1 - EPS), math.log(1 + EPS)
    for name, bound, clipped in (("lower", lower, lambda lr: (lr < lower) & (ref["adv"] < 0)),
                                 ("upper", upper, lambda lr: (lr > upper) & (ref["adv"] > 0))):
        far = np.abs(log_ref - bound) > NEAR_BOUND
        assert np.array_equal(clipped(log_ref)[far], clipped(log_got)[far]), f"{name} clip decisions differ"
    assert ((log_ref < lower) & (ref["adv"] < 0)).any()  # the decisions compared include clipped tokens


def test_the_targeted_decision_picks_the_same_answers_under_dp2(tmp_path_factory, tmp_path):
    """strength=targeted (the default) with DP=2: each rank holds half the answers, but the entropy it ranks them by is
    gathered first, so both ranks decide the same answers in high precision as the single process does (the same share
    of the off-policy tokens) and the step's clip fractions, low- and high-precision, are the single process's."""
    warm = warm_start(tmp_path_factory)
    targeted = ("train.steps=1", "algo.calibration.enabled=true", "algo.calibration.strength=targeted",  # tiny_overrides: full
                "algo.calibration.targeted_fraction=0.25",
                "train.micro_batch_size=4")
    single = train(tmp_path / "single", tiny_overrides(warm, *targeted))
    parallel = train(tmp_path / "dp2", tiny_overrides(warm, *targeted, "rollout.weight_sync.transport=tensor"), nproc=2)
    assert 0 < single[0]["calib/targeted_token_share"] < 0.6
    assert parallel[0]["calib/targeted_token_share"] == single[0]["calib/targeted_token_share"]
    for key in ("clipfrac", "experimental/hp_clipfrac", "experimental/lp_clipfrac"):
        assert parallel[0][key] == pytest.approx(single[0][key], abs=0.02), key
