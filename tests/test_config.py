"""Config loading: YAML + base chain + dotted overrides, errors that name the key, every field documented."""
from pathlib import Path

import pytest
from pydantic import BaseModel

from megatron_rl.config import ConfigError, RunConfig, load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_base_chain_and_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("train: {steps: 7, prompts_per_step: 4, num_minibatches: 2}\nalgo: {policy_loss: {eps_high: 0.28}}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ntrain: {steps: 9}\n")
    cfg = load_config(child, ["algo.calibration.enabled=true", "rollout.sampling.max_new_tokens=3"])
    assert cfg.train.steps == 9 and cfg.train.prompts_per_step == 4  # merged section by section
    assert cfg.algo.policy_loss.eps_high == 0.28
    assert cfg.algo.calibration.enabled is True and cfg.rollout.sampling.max_new_tokens == 3


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.stepz=3", "train.stepz: unknown key"),
        ("algo.calibration.upper=sideways", "algo.calibration.upper"),
        ("train.steps=abc", "train.steps"),
        ("train.steps=0", "train.steps must be >= 1"),
        ("parallel.sequence_parallel=true", "parallel.sequence_parallel"),
        ("rollout.engine=external", "rollout.urls"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, [override])


def test_malformed_files_and_overrides(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["train.steps"])
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(loop)


def _walk(model, prefix=""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _walk(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def test_every_field_has_a_one_line_doc():
    undocumented = [name for name, field in _walk(RunConfig) if not (field.description or "").strip()]
    assert not undocumented, undocumented


def test_api_key_is_redacted_in_the_run_record(tmp_path):
    """config.yaml is copied and shared with run directories: the rollout API key never reaches it."""
    from megatron_rl.config import dump_config, load_config

    cfg = load_config(None, ["rollout.api_key=s3cret-token"])
    dump_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "s3cret-token" not in text and "api_key: <redacted>" in text
    assert cfg.rollout.api_key == "s3cret-token"
