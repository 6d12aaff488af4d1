"""The layer spec follows the device facts (CUDA and an importable Transformer Engine), injected here: a GPU
without TE builds the local spec, and an FP8/FP4 recipe there is one error line naming precision.recipe."""
import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.device import CPU, DeviceFacts, gpu_facts, learner_device_errors
from megatron_rl.trainer.spec import uses_te_spec

BARE_H200 = DeviceFacts(cuda=True, capability=(9, 0), te=False, te_error="ModuleNotFoundError: No module named 'transformer_engine'")
FP_RECIPES = ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"]


def test_spec_choice_needs_cuda_and_te():
    assert uses_te_spec(gpu_facts((9, 0))) is True
    assert uses_te_spec(BARE_H200) is False  # megatron's TE spec would raise NameError: TESpecProvider
    assert uses_te_spec(CPU) is False
    assert uses_te_spec(DeviceFacts(cuda=False, te=True)) is False


@pytest.mark.parametrize("recipe", FP_RECIPES)
def test_a_recipe_needing_te_on_a_gpu_without_it_is_one_error_line(recipe, tmp_path, monkeypatch, capsys):
    errors = learner_device_errors(PrecisionConfig(recipe=recipe), BARE_H200)
    assert len(errors) == 1 and f"precision.recipe={recipe}" in errors[0] and "Transformer Engine" in errors[0]
    assert "No module named 'transformer_engine'" in errors[0]  # why it does not import
    with pytest.raises(ConfigError, match=f"precision.recipe={recipe}"):
        load_config(None, [f"precision.recipe={recipe}"], device_facts=BARE_H200)
    # the CLI: exactly one line on stderr, exit 2, before anything starts
    from megatron_rl import cli
    from megatron_rl.precision import device

    monkeypatch.setattr(device, "detect_device_facts", lambda: BARE_H200)
    (tmp_path / "c.yaml").write_text(f"run_dir: {tmp_path / 'run'}\nprecision:\n  recipe: {recipe}\n")
    assert cli.main(["train", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and f"precision.recipe={recipe}" in err
    assert not (tmp_path / "run").exists()


def test_recipe_none_on_a_gpu_without_te_loads_and_uses_the_local_spec():
    cfg = load_config(None, ["precision.recipe=none"], device_facts=BARE_H200)
    assert learner_device_errors(cfg.precision, BARE_H200) == [] and not uses_te_spec(BARE_H200)


def test_learner_refuses_what_its_facts_cannot_run():
    """A Learner built directly (tests/gpu, tools) goes through the same check as the config."""
    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.trainer.learner import Learner

    with pytest.raises(ValueError, match="precision.recipe=blockwise runs through Transformer Engine"):
        Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(recipe="blockwise"),
                vocab_size=64, device_facts=BARE_H200)


def test_block_spec_builds_the_local_spec_when_told_no_te():
    """block_spec with the Learner's decision: the local spec's RMSNorm and SDPA core attention (no TE import)."""
    import sys

    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.models.presets import resolve_architecture
    from megatron_rl.parallel import state
    from megatron_rl.trainer.model import build_transformer_config
    from megatron_rl.trainer.spec import RMSNorm, SDPACoreAttention, block_spec

    if not state.is_initialized():
        state.init_distributed(ParallelConfig(), 0)
    config = build_transformer_config(resolve_architecture(ModelConfig(preset="tiny"), 64), ParallelConfig(),
                                      OptimConfig(), PrecisionConfig())
    spec = block_spec(config, PrecisionConfig(), use_te=uses_te_spec(BARE_H200))
    assert spec.layer_norm is RMSNorm
    assert spec.layer_specs[0].submodules.self_attention.submodules.core_attention is SDPACoreAttention
    assert "transformer_engine" not in sys.modules
