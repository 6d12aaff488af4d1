"""The dose-response instrument's configuration and loss hook (algo.experimental.clip_error_scale, experiment only):
no shipped training config sets it, combinations it cannot serve are refused by name, and in the RL loss it moves
only the clip decision (same loss and gradient as the ordinary loss when the low-precision error is zero), feeding
the calibration tap the ratio the loss clipped by."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.algo import AlgoConfig, CalibrationConfig
from megatron_rl.config.experimental import ExperimentalConfig
from megatron_rl.config.train import TrainConfig
from megatron_rl.phases import batching, error_scale
from megatron_rl.phases.loss import CalibrationTap, RLLoss
from megatron_rl.types import Sample

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_no_shipped_training_config_turns_the_instrument_on(path):
    assert load_config(path).algo.experimental == ExperimentalConfig()


@pytest.mark.parametrize("overrides, fragment", [
    (["algo.experimental.clip_error_scale=2"], "precision.recipe=none"),
    (["precision.recipe=blockwise", "algo.experimental.clip_error_scale=2", "algo.policy_loss.name=cispo"], "cispo"),
    (["precision.recipe=blockwise", "algo.experimental.clip_error_scale=2", "algo.calibration.enabled=true",
      "algo.calibration.shadow_fraction=0.5"], "shadow_fraction"),
    (["precision.recipe=blockwise", "algo.experimental.clip_error_scale=2", "algo.calibration.enabled=true",
      "algo.calibration.bounds_update=per_minibatch"], "per_minibatch"),
    (["precision.recipe=blockwise", "algo.experimental.clip_error_scale=100"], "algo.experimental.clip_error_scale"),
])
def test_combinations_it_cannot_serve_are_refused_by_name(overrides, fragment):
    with pytest.raises(ConfigError, match="algo.experimental.clip_error_scale") as exc:
        load_config(REPO / "examples" / "configs" / "tiny_grpo.yaml", overrides)
    assert fragment in str(exc.value)


def test_a_study_may_set_it():
    cfg = load_config(REPO / "examples" / "configs" / "tiny_grpo.yaml",
                      ["precision.recipe=blockwise", "algo.experimental.clip_error_scale=4"])
    assert cfg.algo.experimental.clip_error_scale == 4.0


class _Ctx:
    micro_batch_index = 0


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6, 7, 8], rollout_logprobs=[-0.1] * 6,
                      finish_reason="stop", group_id=i // 4) for i in range(8)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.2, -0.2])
    batch = batching.with_token_weights(batching.build_train_batch(samples, adv, pad_id=0), "token-mean")
    old = torch.randn(batch.input_ids.shape, generator=g) * 0.1 - 1.0
    drift = 0.15 * torch.randn(old.shape, generator=g)
    logprobs = (old + drift).requires_grad_()
    return batch.with_fields(old_logprobs=old), logprobs, drift


def _run(algo, batch, logprobs, tap=None):
    lp = logprobs.detach().clone().requires_grad_()
    loss_fn = RLLoss(algo, None, tap)
    loss, _ = loss_fn(lp, torch.zeros_like(lp), batch, _Ctx())
    loss.backward()
    return loss, lp.grad, loss_fn.sums


def test_without_low_precision_error_the_loss_and_gradient_are_the_ordinary_ones():
    batch, logprobs, _ = _batch()
    # high-precision log-probs equal to the learner's: r_hp = r_lp, so r_k = r_lp for every k
    hp = batch.with_fields(old_logprobs_hp=batch.old_logprobs.clone(), logprobs_hp=logprobs.detach().clone())
    plain_loss, plain_grad, plain_sums = _run(AlgoConfig(), batch, logprobs)
    algo = AlgoConfig(experimental=ExperimentalConfig(clip_error_scale=8.0))
    loss, grad, sums = _run(algo, hp, logprobs)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    for key, value in plain_sums.items():
        assert torch.equal(sums[key], value), key
    assert {k for k in sums if k.startswith("experimental/")} >= {"experimental/lp_clipfrac_lower_neg/num",
                                                                  "experimental/hp_clipfrac_lower_neg/num"}


def test_scaled_error_moves_the_mask_and_the_tap_sees_the_decision_ratio():
    batch, logprobs, drift = _batch(1)
    # a low-precision error of -0.05 on every token's log-ratio: k = 4 pushes ratios down by 0.15 more
    old_hp = batch.old_logprobs.clone()
    hp = batch.with_fields(old_logprobs_hp=old_hp, logprobs_hp=old_hp + drift + 0.05)
    algo = AlgoConfig(experimental=ExperimentalConfig(clip_error_scale=4.0),
                      calibration=CalibrationConfig(enabled=True, strength="full", calibrate_every=1))
    plan = CalibrationPlan.build(0, algo.calibration, TrainConfig(num_minibatches=2), batch_size=8)
    stats = CalibratedClipper(algo.calibration, eps_low=0.2, eps_high=0.2).new_stats(reference=True, record=True)
    _, grad, sums = _run(algo, hp, logprobs, CalibrationTap(plan, stats, update=1))
    mask = hp.loss_mask > 0
    lr = (logprobs.detach() - batch.old_logprobs)
    r_k = torch.exp(lr + 3.0 * (lr - (drift + 0.05)))
    clipped = mask & (((hp.advantages < 0) & (r_k < 0.8)) | ((hp.advantages > 0) & (r_k > 1.2)))
    plain_clipped = mask & (((hp.advantages < 0) & (torch.exp(lr) < 0.8)) | ((hp.advantages > 0) & (torch.exp(lr) > 1.2)))
    assert clipped.sum() > plain_clipped.sum()  # the data makes the instrument matter
    assert torch.all(grad[clipped] == 0) and torch.all(grad[mask & ~clipped] != 0)
    torch.testing.assert_close(torch.from_numpy(stats.dump_arrays()["ratio"]), r_k[mask].double(), rtol=1e-6, atol=0)
    neg = mask & (hp.advantages < 0)
    got = float(sums["clipfrac_lower_neg/num"]) / float(sums["clipfrac_lower_neg/den"])
    assert got == pytest.approx(float((neg & (r_k < 0.8)).sum()) / float(neg.sum()))


def test_first_update_reuses_pi_old_hp_and_off_is_free():
    batch, _, _ = _batch()
    on = AlgoConfig(experimental=ExperimentalConfig(clip_error_scale=2.0))
    b = batch.with_fields(old_logprobs_hp=batch.old_logprobs + 1.0)
    assert error_scale.with_logprobs_hp(None, b, 4, on, first_update=True).logprobs_hp is b.old_logprobs_hp
    assert error_scale.with_logprobs_hp(None, batch, 4, AlgoConfig(), first_update=False) is batch
    assert error_scale.with_old_logprobs_hp(None, batch, 4, AlgoConfig()) is batch
    assert error_scale.clip_decision(batch.old_logprobs, batch, AlgoConfig(), None) == (None, {})


# algo.policy_loss.clip_decision=high_precision: the instrument at k = 0 as a supported option

@pytest.mark.parametrize("overrides, fragment", [
    ([], "precision.recipe=none"),
    (["precision.recipe=blockwise", "algo.policy_loss.name=cispo"], "cispo"),
    (["precision.recipe=blockwise", "algo.calibration.enabled=true"], "algo.calibration.enabled"),
    (["precision.recipe=blockwise", "algo.experimental.clip_error_scale=0"], "algo.experimental.clip_error_scale"),
])
def test_high_precision_clip_decision_refuses_what_it_cannot_serve_by_name(overrides, fragment):
    with pytest.raises(ConfigError, match="algo.policy_loss.clip_decision=high_precision") as exc:
        load_config(REPO / "examples" / "configs" / "tiny_grpo.yaml", ["algo.policy_loss.clip_decision=high_precision", *overrides])
    assert fragment in str(exc.value)


def test_high_precision_clip_decision_is_the_instrument_at_k0_and_clips_what_high_precision_clips():
    batch, logprobs, drift = _batch(2)
    # the learner's log-ratio carries an error of -0.1 on every token; the high-precision one is the pure drift
    old_hp = batch.old_logprobs.clone()
    hp = batch.with_fields(old_logprobs_hp=old_hp, logprobs_hp=old_hp + drift + 0.1)
    option = AlgoConfig(policy_loss={"clip_decision": "high_precision"})
    assert error_scale.active(option) and error_scale.decision_scale(option) == 0.0
    loss, grad, sums = _run(option, hp, logprobs)
    k0_loss, k0_grad, k0_sums = _run(AlgoConfig(experimental=ExperimentalConfig(clip_error_scale=0.0)), hp, logprobs)
    assert torch.equal(loss, k0_loss) and torch.equal(grad, k0_grad)
    assert all(torch.equal(sums[k], v) for k, v in k0_sums.items()) and sums.keys() == k0_sums.keys()
    mask = hp.loss_mask > 0
    r_hp = torch.exp(drift + 0.1)
    clipped = mask & (((hp.advantages < 0) & (r_hp < 0.8)) | ((hp.advantages > 0) & (r_hp > 1.2)))
    r_lp = torch.exp(logprobs.detach() - batch.old_logprobs)
    lp_clipped = mask & (((hp.advantages < 0) & (r_lp < 0.8)) | ((hp.advantages > 0) & (r_lp > 1.2)))
    assert not torch.equal(clipped, lp_clipped)  # the data makes the decision matter
    assert torch.all(grad[clipped] == 0) and torch.all(grad[mask & ~clipped] != 0)
    # the loss's clip fraction is high precision's on the same tokens
    assert torch.equal(sums["clipfrac/num"], sums["experimental/hp_clipfrac/num"])



@pytest.mark.parametrize("strength", ["targeted", "decision"])
def test_the_clip_deciding_rules_refuse_a_loss_without_a_clip_decision_by_name(strength):
    """strength=targeted (the default) and decision decide the PPO clip: cispo has none, and the error names the rule
    that serves it."""
    with pytest.raises(ConfigError, match=f"algo.calibration.strength={strength}") as exc:
        load_config(REPO / "examples" / "configs" / "tiny_grpo.yaml",
                    ["precision.recipe=blockwise", "algo.calibration.enabled=true", "algo.policy_loss.name=cispo",
                     *([] if strength == "targeted" else [f"algo.calibration.strength={strength}"])])
    assert "algo.calibration.strength to full" in str(exc.value) and "cispo" in str(exc.value)


def test_the_decision_rule_is_the_option_in_the_loss_and_calibration_sees_the_learner():
    """gate_open=True under strength=decision: loss, gradient and clip sums are those of clip_decision=high_precision
    bit for bit, while the calibration tap records the learner's own ratios (the events keep measuring the
    distortion); gate_open=False is the ordinary loss."""
    batch, logprobs, drift = _batch(2)
    old_hp = batch.old_logprobs.clone()
    hp = batch.with_fields(old_logprobs_hp=old_hp, logprobs_hp=old_hp + drift + 0.1)
    decided = AlgoConfig(calibration=CalibrationConfig(enabled=True, calibrate_every=1, strength="decision"))
    assert not error_scale.active(decided) and error_scale.active(decided, gate_open=True)
    plan = CalibrationPlan.build(0, decided.calibration, TrainConfig(num_minibatches=2), batch_size=8)
    stats = CalibratedClipper(decided.calibration, eps_low=0.2, eps_high=0.2).new_stats(reference=True, record=True)
    lp = logprobs.detach().clone().requires_grad_()
    loss_fn = RLLoss(decided, None, CalibrationTap(plan, stats, update=1), gate_open=True)
    loss, _ = loss_fn(lp, torch.zeros_like(lp), hp, _Ctx())
    loss.backward()
    opt_loss, opt_grad, opt_sums = _run(AlgoConfig(policy_loss={"clip_decision": "high_precision"}), hp, logprobs)
    assert torch.equal(loss, opt_loss) and torch.equal(lp.grad, opt_grad)
    assert all(torch.equal(loss_fn.sums[k], v) for k, v in opt_sums.items())
    mask = hp.loss_mask > 0
    r_lp = torch.exp(logprobs.detach() - batch.old_logprobs)
    torch.testing.assert_close(torch.from_numpy(stats.dump_arrays()["ratio"]), r_lp[mask].double(), rtol=1e-6, atol=0)
    assert not torch.equal(loss_fn.sums["clipfrac/num"], loss_fn.sums["experimental/lp_clipfrac/num"])  # it mattered
    closed_loss, closed_grad, closed_sums = _run(decided, hp, logprobs)
    plain_loss, plain_grad, plain_sums = _run(AlgoConfig(), hp, logprobs)
    assert torch.equal(closed_loss, plain_loss) and torch.equal(closed_grad, plain_grad) and closed_sums.keys() == plain_sums.keys()


def _calibration_event(clippers, noise: float, generator: torch.Generator) -> None:
    """One calibration event of 400 tokens (half negative) fed to every clipper: high-precision ratios of spread 0.15,
    low-precision ones with log-normal noise of `noise` on top."""
    adv = torch.where(torch.arange(400) % 2 == 0, -1.0, 1.0)
    r_hp = torch.exp(0.15 * torch.randn(400, generator=generator))
    r_lp = r_hp * torch.exp(noise * torch.randn(400, generator=generator))
    for c in clippers:
        stats = c.new_stats(reference=True)
        stats.add(r_lp, adv, ratio_hp=r_hp)
        c.solve(stats, smooth=False)


# algo.calibration.strength=decision: every clip decided on its high-precision ratio from the first step

def test_the_decision_rule_decides_from_the_first_step_moves_no_bound_and_measures_the_distortion():
    """strength=decision decides on high-precision ratios before any calibration event and after every one, holds
    1 -/+ eps (on-policy updates included) whatever the events measure, counts the shadow's and the learner's clipped
    tokens as strength=full does (calib/gate_ratio reports the distortion) and resumes; a full checkpoint is refused
    under it by name (a run must not switch rules mid-way), and a decision checkpoint under full."""
    g = torch.Generator().manual_seed(3)
    decision = CalibratedClipper(CalibrationConfig(enabled=True, strength="decision"), eps_low=0.2, eps_high=0.2)
    full = CalibratedClipper(CalibrationConfig(enabled=True, strength="full"), eps_low=0.2, eps_high=0.2)
    assert CalibrationConfig(enabled=True).strength == "targeted"  # the default
    assert decision.decides_on_high_precision() and not full.decides_on_high_precision()
    for noise in (0.01, 0.3, 0.3):
        _calibration_event((decision, full), noise, g)
        assert decision.gate_counts == full.gate_counts  # the same measurement as the full rule's
        assert decision.decides_on_high_precision()
        assert (decision.lower, decision.upper) == (pytest.approx(0.8), pytest.approx(1.2))
        assert [float(b) for b in decision.on_policy_bounds()] == [pytest.approx(0.8), pytest.approx(1.2)]
    assert decision.metrics()["calib/gate_ratio"] > 1.5  # large noise: the learner's ratios clip far more
    assert decision.last is not None and decision.last.lower < 0.8  # the solve ran; its bounds were not applied
    resumed = CalibratedClipper(decision.cfg, eps_low=0.2, eps_high=0.2)
    resumed.load_state_dict(decision.state_dict())
    assert resumed.decides_on_high_precision() and resumed.gate_counts == decision.gate_counts
    with pytest.raises(ConfigError, match=r"algo\.calibration\.strength=decision.*strength=full"):
        CalibratedClipper(decision.cfg, eps_low=0.2, eps_high=0.2).load_state_dict(full.state_dict())
    with pytest.raises(ConfigError, match=r"algo\.calibration\.strength=full.*strength=decision"):
        CalibratedClipper(full.cfg, eps_low=0.2, eps_high=0.2).load_state_dict(decision.state_dict())


@pytest.mark.parametrize("overrides", [
    [], ["precision.recipe=tensorwise"],
    ["precision.recipe=tensorwise", "algo.calibration.enabled=true", "algo.calibration.strength=decision"],
    ["precision.recipe=tensorwise", "algo.calibration.enabled=true", "algo.calibration.strength=full"],
    ["precision.recipe=tensorwise", "algo.policy_loss.clip_decision=high_precision"],
    ["precision.recipe=tensorwise", "algo.experimental.clip_error_scale=8"],
    ["precision.recipe=tensorwise", "algo.experimental.clip_error_scale=8", "algo.calibration.enabled=true",
     "algo.calibration.strength=decision"],
    ["algo.calibration.enabled=true", "algo.calibration.strength=decision"]])
def test_the_config_level_decision_scale_is_the_loops_at_the_first_step(overrides):
    """The planner and the study reports read every_step_decision_scale from the config; it must be the k the loop's
    first step decides at."""
    cfg = load_config(REPO / "examples" / "configs" / "tiny_grpo.yaml", overrides)
    clipper = CalibratedClipper(cfg.algo.calibration, eps_low=cfg.algo.policy_loss.eps_low,
                                eps_high=cfg.algo.policy_loss.eps_high) if cfg.algo.calibration.enabled else None
    first_step = error_scale.decision_scale(cfg.algo, error_scale.gate_open(clipper, cfg.precision.recipe))
    assert cfg.algo.every_step_decision_scale(cfg.precision.recipe) == first_step


def test_the_default_targeted_rule_decides_a_share_of_the_answers_per_row():
    """strength=targeted (the default) decides its targeted rows at k = 0 and the others at the instrument's k: the
    config's every-step k is the untargeted rows' and its high-precision share the targeted_fraction, which the planner
    reads."""
    for k in (1.0, 8.0):
        cfg = load_config(REPO / "examples" / "configs" / "tiny_grpo.yaml",
                          ["precision.recipe=tensorwise", "algo.calibration.enabled=true",
                           f"algo.experimental.clip_error_scale={k}"])
        assert cfg.algo.calibration.strength == "targeted"
        assert cfg.algo.every_step_decision_scale("tensorwise") == k
        assert cfg.algo.every_step_hp_share("tensorwise") == (cfg.algo.calibration.targeted_fraction if k == 1.0 else 1.0)
