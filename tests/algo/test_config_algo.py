"""AlgoConfig validation names the failing field; config choices match the algo registries."""
from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from megatron_rl.algo.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.algo.aggregation import AGG_MODES
from megatron_rl.algo.calibration import STATS_BACKENDS, UPPER_RULES
from megatron_rl.algo.kl import KL_ESTIMATORS
from megatron_rl.algo.losses import POLICY_LOSSES
from megatron_rl.algo.rollout_correction import ROLLOUT_CORRECTIONS
from megatron_rl.config import RunConfig
from megatron_rl.config.algo import (
    AdvantageConfig,
    AlgoConfig,
    CalibrationConfig,
    DapoConfig,
    KLConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)


@pytest.mark.parametrize(
    "model,field,registry",
    [
        (AdvantageConfig, "estimator", ADVANTAGE_ESTIMATORS),
        (PolicyLossConfig, "name", POLICY_LOSSES),
        (PolicyLossConfig, "agg_mode", AGG_MODES),
        (CalibrationConfig, "upper", UPPER_RULES),
        (CalibrationConfig, "backend", STATS_BACKENDS),
        (KLConfig, "estimator", KL_ESTIMATORS),
        (RolloutCorrectionConfig, "mode", ROLLOUT_CORRECTIONS),
    ],
)
def test_config_choices_are_registered(model, field, registry):
    assert sorted(typing.get_args(model.model_fields[field].annotation)) == registry.names()


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"policy_loss": {"eps_low": 1.5}}, "algo.policy_loss.eps_low"),
        ({"policy_loss": {"agg_mode": "seq-mean-token-sum-norm", "max_response_length": 0}}, "algo.policy_loss.max_response_length"),
        ({"dapo": {"max_gen_batches": -1}}, "algo.dapo.max_gen_batches"),
        ({"policy_loss": {"dual_clip_c": 1.0}}, "algo.policy_loss.dual_clip_c"),
        ({"calibration": {"lower_min": 1.5}}, "algo.calibration.lower_min"),
        ({"calibration": {"calibrate_every": 0}}, "algo.calibration.calibrate_every"),
        ({"rollout_correction": {"mis_low": 3.0}}, "algo.rollout_correction.mis_low"),
        ({"dapo": {"overlong_buffer": 10, "max_response_length": 5}}, "algo.dapo.max_response_length"),
        ({"kl": {"coef": -1}}, "algo.kl.coef"),
    ],
)
def test_errors_name_the_field(data, needle):
    with pytest.raises(ValidationError, match=needle.replace(".", r"\.")):
        RunConfig.model_validate({"algo": data})


def test_unknown_key_rejected_and_every_field_documented():
    with pytest.raises(ValidationError, match="clip_eps"):
        AlgoConfig.model_validate({"policy_loss": {"clip_eps": 0.2}})
    for model in (AlgoConfig, AdvantageConfig, PolicyLossConfig, CalibrationConfig, KLConfig, RolloutCorrectionConfig, DapoConfig):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no docstring"


@pytest.mark.parametrize("overrides,needles", [
    (["algo.calibration.enabled=true", "train.num_minibatches=1", "train.ppo_epochs=1"],
     ["algo.calibration.enabled", "train.num_minibatches", "train.ppo_epochs"]),
    (["algo.calibration.bounds_update=per_microbatch"], ["algo.calibration.bounds_update", "per_minibatch"]),
])
def test_calibration_config_errors_at_load_time(overrides, needles):
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(err.value)
    # one off-policy update is enough, and calibration off needs none
    load_config(None, ["algo.calibration.enabled=true", "train.num_minibatches=1", "train.ppo_epochs=2"])
    load_config(None, ["train.num_minibatches=1"])


def test_calibration_is_twelve_fields_each_with_a_short_docstring():
    assert len(CalibrationConfig.model_fields) == 12
    for name, f in CalibrationConfig.model_fields.items():
        assert len(f.description) <= 300 and f.description.count(". ") <= 1, name


@pytest.mark.parametrize("field", ["gate_opens_to", "lower_target", "target_events", "on_policy_bounds", "hist_log_min",
                                   "seed", "static_alpha"])
def test_a_removed_calibration_field_is_refused_with_its_dotted_name(field, tmp_path):
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.config.algo import REMOVED_CALIBRATION_FIELDS

    kept, instead = REMOVED_CALIBRATION_FIELDS[field]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"algo.calibration.{field}={kept if kept is not None else 1}"])
    assert f"algo.calibration.{field} was removed" in str(err.value) and instead in str(err.value)
    # the same from a YAML file
    path = tmp_path / "run.yaml"
    path.write_text(f"algo:\n  calibration:\n    enabled: true\n    {field}: 1\n")
    with pytest.raises(ConfigError, match=rf"algo\.calibration\.{field} was removed"):
        load_config(path)


@pytest.mark.parametrize("rule", ["gated", "excess"])
def test_a_removed_strength_is_refused_naming_what_to_set(rule):
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"algo\.calibration\.strength={rule} was removed.*decision.*full"):
        load_config(None, [f"algo.calibration.strength={rule}"])
