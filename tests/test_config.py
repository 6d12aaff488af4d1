"""Config loading: YAML + base chain + dotted overrides, errors that name the key, every field documented and
every numeric field range-checked at load time (NaN/inf included), batch geometry checked for the DP size."""
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from megatron_rl.config import ConfigError, RunConfig, load_config
from megatron_rl.config.base import field_range
from megatron_rl.config.run import check_config_for_world

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
        ("train.steps=0", "train.steps: Input should be greater than or equal to 1"),
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


def _base_types(annotation) -> set:
    """The scalar types an annotation admits (through Optional, Annotated, list and dict values)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _base_types(args[0])
    if args:
        return set().union(*(_base_types(a) for a in (args[1:] if typing.get_origin(annotation) is dict else args)))
    return {annotation}


def _numeric_fields():
    for name, field in _walk(RunConfig):
        kinds = _base_types(field.annotation) - {type(None)}
        if kinds & {int, float} and bool not in kinds:
            yield name, field, float in kinds


def test_every_numeric_field_declares_a_range():
    fields = list(_numeric_fields())
    assert len(fields) > 60  # the walk finds the numeric fields (a broken walk would pass vacuously)
    missing = [name for name, field, _ in fields if not field_range(field)]
    assert not missing, f"numeric config fields without a declared range: {missing}"


@pytest.mark.parametrize("name", [name for name, _, is_float in _numeric_fields() if is_float])
def test_nan_and_inf_rejected_by_name(name):
    for bad in (".nan", ".inf", "-.inf"):
        with pytest.raises(ConfigError, match=rf"{name.replace('.', chr(92) + '.')}: Input should be a finite number"):
            load_config(None, [f"{name}={bad}"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=-1e-5", "optim.lr"),
        ("optim.lr=.nan", "optim.lr"),
        ("optim.adam_beta1=1.5", "optim.adam_beta1"),
        ("optim.adam_beta2=1.0", "optim.adam_beta2"),
        ("optim.adam_eps=0", "optim.adam_eps"),
        ("optim.clip_grad=-1", "optim.clip_grad"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.min_lr=1.0", "optim.min_lr"),
        ("sft.global_batch_size=0", "sft.global_batch_size"),
        ("sft.steps=-5", "sft.steps"),
        ("sft.lr=0", "sft.lr"),
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
        ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
        ("rollout.sampling.top_k=0", "rollout.sampling.top_k"),
        ("rollout.sampling.top_k=-2", "rollout.sampling.top_k"),
        ("rollout.sampling.max_new_tokens=0", "rollout.sampling.max_new_tokens"),
        ("rollout.sampling.stop_token_ids=[3,-1]", "rollout.sampling.stop_token_ids.1"),
        ("train.micro_batch_size=3", "train.micro_batch_size"),
        ("sft.micro_batch_size=48", "sft.micro_batch_size"),
        ("train.health.max_kl_ref=0.5", "train.health.max_kl_ref"),
        ("train.health.max_entropy_frac=1.5", "train.health.max_entropy_frac"),
    ],
)
def test_bad_numeric_values_are_rejected_by_dotted_name(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_batch_geometry_is_checked_again_for_the_real_dp_size():
    cfg = load_config(None, ["train.prompts_per_step=4", "rollout.n_samples_per_prompt=3", "train.num_minibatches=2",
                             "train.micro_batch_size=2", "sft.global_batch_size=8", "sft.micro_batch_size=4"])
    check_config_for_world(cfg, 1)  # 12 rows = 1 * 2 * 6... loads with DP = 1
    with pytest.raises(ConfigError) as exc:
        check_config_for_world(cfg, 2)  # 12 rows cannot split over 2 DP ranks * 2 mini-batches * 2 rows
    for name in ("train.prompts_per_step", "rollout.n_samples_per_prompt", "train.num_minibatches",
                 "train.micro_batch_size", "data-parallel size (2)"):
        assert name in str(exc.value)
    rl_fits = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prompts_per_step": 16})})
    with pytest.raises(ConfigError, match=r"sft\.global_batch_size \(8\) must be divisible by data-parallel size \(4\)"):
        check_config_for_world(rl_fits, 4)
    check_config_for_world(rl_fits, 4, sft=False)  # a run that reuses a warm start never splits the SFT batch


def test_cli_config_rejects_a_bad_value_by_name():
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "config", str(EXAMPLES[0]), "optim.lr=-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "optim.lr: Input should be greater than 0 (got -1)" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("algo.clip_eps_lowr=0.1", "algo.clip_eps_lowr", "algo.policy_loss.eps_low"),  # near leaf name, wrong section
        ("train.eps_high=0.3", "train.eps_high", "algo.policy_loss.eps_high"),
        ("train.stesp=3", "train.stesp", "train.steps"),
        ("trian.steps=3", "trian", "train"),  # a typo'd section
        ("tracking.progressbar=false", "tracking.progressbar", "tracking.progress_bar"),
    ],
)
def test_unknown_key_suggests_the_nearest_valid_names(override, key, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert f"{key}: unknown key (did you mean {suggestion}?)" in str(info.value)


def test_suggestions_are_few_and_absent_when_nothing_is_close():
    from megatron_rl.config.run import dotted_field_paths, suggest_keys

    paths = dotted_field_paths()
    assert "algo.policy_loss.eps_low" in paths and "algo" in paths and len(paths) == len(set(paths))
    assert suggest_keys("steps") == ["sft.steps", "train.steps"]  # equally near: both, best first then by name
    assert suggest_keys("zzzz.qqqq") == []
    with pytest.raises(ConfigError) as info:
        load_config(None, ["zzzz.qqqq=1"])
    assert "zzzz: unknown key" in str(info.value) and "did you mean" not in str(info.value)


def test_api_key_is_redacted_in_the_run_record(tmp_path):
    """config.yaml is copied and shared with run directories: the rollout API key never reaches it."""
    from megatron_rl.config import dump_config, load_config

    cfg = load_config(None, ["rollout.api_key=s3cret-token"])
    dump_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "s3cret-token" not in text and "api_key: <redacted>" in text
    assert cfg.rollout.api_key == "s3cret-token"


def test_sequences_per_request_default_and_router_rule():
    """Embedded engines addressed directly pack 256 samples per call; a router (one sampling_params per call in
    sglang-router 0.3.2) or external URLs get one prompt per call, and an explicit packing there is refused."""
    base = Path(__file__).parent.parent / "examples" / "configs" / "tiny_fp8_grpo.yaml"
    assert load_config(base).rollout.resolved_sequences_per_request == 256
    routed = load_config(base, ["rollout.use_router=true"]).rollout
    assert routed.resolved_sequences_per_request == 1  # greedy evaluations (n = 1) must not pack either
    assert load_config(base, ["rollout.sequences_per_request=32"]).rollout.resolved_sequences_per_request == 32
    with pytest.raises(ConfigError, match=r"rollout\.sequences_per_request=32.*sglang-router"):
        load_config(base, ["rollout.use_router=true", "rollout.sequences_per_request=32"])
    with pytest.raises(ConfigError, match=r"rollout\.sequences_per_request"):
        load_config(base, ["rollout.sequences_per_request=2000"])


def test_fp8_params_is_refused_beside_high_precision_forwards():
    """FP8 parameters make a 'high-precision' forward multiply FP8 weights: each setting that needs those forwards
    is refused with precision.fp8_params, both fields named; the same run without them loads."""
    base = Path(__file__).parent.parent / "examples" / "configs" / "tiny_fp8_grpo.yaml"
    assert load_config(base).algo.calibration.enabled  # the main job calibrates: hp forwards every event
    off = ["algo.calibration.enabled=false"]
    assert load_config(base, off + ["precision.fp8_params=true"]).precision.fp8_params
    cases = [([], r"algo\.calibration\.enabled=true"),
             (off + ["algo.policy_loss.clip_decision=high_precision"], r"algo\.policy_loss\.clip_decision=high_precision"),
             (off + ["algo.experimental.clip_error_scale=0.5"], r"algo\.experimental\.clip_error_scale=0\.5")]
    for extra, field in cases:
        with pytest.raises(ConfigError, match=r"precision\.fp8_params=true.*" + field):
            load_config(base, extra + ["precision.fp8_params=true"])
        load_config(base, extra)  # without FP8 parameters the same setting is fine
