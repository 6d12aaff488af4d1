"""Phase glue: sample -> TrainBatch alignment, mini-batch/DP splits, RL loss = objective at calibrated bounds."""
import pytest
import torch

from megatron_rl.algo.calibration import reference_targets, solve_bounds
from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.objective import policy_objective
from megatron_rl.algo.ratio_stats import SampleStats
from megatron_rl.config.algo import AlgoConfig, CalibrationConfig
from megatron_rl.phases import batching
from megatron_rl.config.train import TrainConfig
from megatron_rl.phases.loss import CalibrationTap, RLLoss
from megatron_rl.types import Sample


def _sample(prompt, response, gid=0):
    return Sample(prompt_ids=prompt, response_ids=response, rollout_logprobs=[-0.1 * (i + 1) for i in range(len(response))],
                  finish_reason="stop", group_id=gid)


def test_train_batch_alignment_and_empty_completion():
    samples = [_sample([5, 6, 7], [8, 9]), _sample([5, 6], []), _sample([4], [3, 2, 1])]
    batch = batching.build_train_batch(samples, torch.tensor([1.0, -1.0, 0.5]), pad_id=0, seq_multiple=4)
    assert batch.input_ids.shape == (3, 4)  # longest is 1+3-1 = 3 tokens, rounded up to 4
    # Row 0: tokens 5 6 7 8 9 -> labels 6 7 8 9; the response labels 8, 9 sit at positions 2, 3.
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8] and batch.labels[0].tolist() == [6, 7, 8, 9]
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1]
    assert batch.rollout_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2])
    assert batch.advantages[0].tolist() == [0, 0, 1, 1]
    assert batch.loss_mask[1].sum() == 0  # an empty completion trains on nothing but keeps its row
    assert batch.labels[2, :3].tolist() == [3, 2, 1] and batch.loss_mask[2].tolist() == [1, 1, 1, 0]


def test_too_long_sequences_and_indivisible_batches_are_reported():
    with pytest.raises(ValueError, match="max_seq_len=2"):
        batching.build_train_batch([_sample([1, 2], [3, 4])], torch.zeros(1), pad_id=0, max_seq_len=2)


def test_minibatches_partition_rows_and_weights_sum_to_one():
    samples = [_sample([1, 2], [3] * (1 + i % 3), gid=i // 4) for i in range(16)]
    batch = batching.build_train_batch(samples, torch.randn(16), pad_id=0)
    parts = batching.minibatches(batch, 4, seed=7)
    rows = torch.cat([p.sample_index for p in parts]).sort().values
    assert rows.tolist() == list(range(16))
    assert [p.sample_index.tolist() for p in parts] == [p.sample_index.tolist() for p in batching.minibatches(batch, 4, seed=7)]
    for mode in ("token-mean", "seq-mean-token-mean"):
        weighted = batching.with_token_weights(parts[0], mode)
        assert float(weighted.token_weight.sum()) == pytest.approx(1.0)
    halves = [batching.dp_shard(parts[0], r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h.input_ids for h in halves]), parts[0].input_ids)


class _Ctx:
    group = None
    micro_batch_index = 0


@pytest.mark.parametrize("mode", ["per_calibration", "per_step"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rl_loss_clips_at_its_bounds_and_taps_the_plans_tokens(fraction, mode):
    torch.manual_seed(0)
    samples = [_sample([1, 2], [3, 4, 5, 6], gid=i // 4) for i in range(8)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.2, -0.2])
    batch = batching.with_token_weights(batching.build_train_batch(samples, adv, pad_id=0), "token-mean")
    old = torch.randn(batch.input_ids.shape) * 0.1 - 1.0
    old_hp = old + 0.01 * torch.randn_like(old)
    cur_hp = old_hp + 0.3 * torch.randn_like(old)
    batch = batch.with_fields(old_logprobs=old, old_logprobs_hp=old_hp, logprobs_hp=cur_hp)
    logprobs = (old + 0.3 * torch.randn_like(old)).requires_grad_()
    algo = AlgoConfig(calibration=CalibrationConfig(enabled=True, strength="full", calibrate_every=1, smoothing=0.0, shadow_fraction=fraction,
                                                    bounds_update=mode))
    plan = CalibrationPlan.build(0, algo.calibration, TrainConfig(num_minibatches=2), batch_size=8)
    clipper = CalibratedClipper(algo.calibration, eps_low=0.2, eps_high=0.2)
    stats = clipper.new_stats(reference=True, record=True)
    bounds = (torch.tensor(0.7), torch.tensor(1.3))
    loss_fn = RLLoss(algo, bounds, CalibrationTap(plan, stats, update=1))
    loss, _ = loss_fn(logprobs, torch.zeros_like(old), batch, _Ctx())

    ref, _ = policy_objective(logprobs, old, batch.advantages, batch.token_weight, batch.loss_mask, bounds,
                              rollout_logprobs=batch.rollout_logprobs, entropy=torch.zeros_like(old), cfg=algo)
    torch.testing.assert_close(loss, ref)
    assert "hp/clipfrac_lower_neg/num" in loss_fn.sums and "clipfrac_lower_neg/num" in loss_fn.sums
    # the tap holds the valid tokens with the ratios the objective clips: per_calibration the shadow rows only,
    # per_step every row's FP8 ratio (the next step's bounds) and the shadow rows' high-precision ratio (the targets)
    rows = torch.tensor([i in plan.shadow_rows for i in range(8)])
    mask = (batch.loss_mask > 0) & rows[:, None]
    fp8 = (batch.loss_mask > 0) & (torch.ones(8, dtype=torch.bool) if mode == "per_step" else rows)[:, None]
    assert (len(plan.shadow_rows) == 8) == (fraction == 1.0)
    dumped = stats.dump_arrays()
    assert torch.equal(torch.from_numpy(dumped["ratio"]), torch.exp((logprobs.detach() - old).clamp(-20, 20))[fp8].double())
    want_hp = torch.where(mask, torch.exp(cur_hp - old_hp), torch.full_like(old, float("nan")))[fp8].double()
    torch.testing.assert_close(torch.from_numpy(dumped["ratio_hp"]), want_hp, equal_nan=True, rtol=0, atol=0)
    assert dumped["minibatch"].tolist() == [1] * int(fp8.sum())
    # and the solve over it is the one-shot solve over those tokens: targets from the shadow rows, L and H from `fp8`
    sol = clipper.solve(stats, quantile=plan.quantile)
    targets = reference_targets(torch.exp(cur_hp - old_hp)[mask], batch.advantages[mask], eps_low=0.2, eps_high=0.2)
    assert (clipper.targets.alpha, clipper.targets.rho) == (targets.alpha, pytest.approx(targets.rho, rel=1e-12))
    want = solve_bounds(SampleStats(torch.exp(logprobs.detach() - old)[fp8], batch.advantages[fp8]), targets,
                        eps_low=0.2, eps_high=0.2, lower_min=algo.calibration.lower_min,
                        upper_max=algo.calibration.upper_max, relax_only=True, quantile=plan.quantile)
    assert (sol.lower, sol.upper) == (want.lower, want.upper)


def test_on_policy_only_rows_are_the_first_minibatch_of_a_single_epoch():
    samples = [_sample([1, 2], [3, 4], gid=i // 4) for i in range(16)]
    batch = batching.build_train_batch(samples, torch.randn(16), pad_id=0)
    first = batching.minibatches(batch, 4, batching.minibatch_seed(3, 7, 0))[0]
    assert batching.on_policy_only_rows(16, 4, 1, 3, 7) == tuple(sorted(first.sample_index.tolist()))
    assert batching.on_policy_only_rows(16, 4, 2, 3, 7) == ()  # a second epoch trains every row off-policy
    # the plan runs no shadow forward on them, and shadow_fraction draws from the rest
    cfg = CalibrationConfig(enabled=True, strength="full", calibrate_every=1, shadow_fraction=1.0)
    skip = batching.on_policy_only_rows(16, 4, 1, 3, 7)
    plan = CalibrationPlan.build(7, cfg, TrainConfig(num_minibatches=4), 16, skip_rows=skip)
    assert set(plan.shadow_rows) == set(range(16)) - set(skip) and len(plan.shadow_rows) == 12
    half = CalibrationPlan.build(7, cfg.model_copy(update={"shadow_fraction": 0.5}), TrainConfig(num_minibatches=4), 16,
                                 skip_rows=skip)
    assert len(half.shadow_rows) == 6 and not set(half.shadow_rows) & set(skip)
