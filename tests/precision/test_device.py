"""Device facts decide what the learner may run: recipes against the GPU's compute capability (TE's rules), checked
when the config loads, with the facts injected (no GPU needed)."""
import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.precision.device import CPU, gpu_facts, learner_device_errors, recipe_capability_error

RECIPES = ["none", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"]
HOPPER, BLACKWELL = gpu_facts((9, 0)), gpu_facts((10, 0))


@pytest.mark.parametrize("recipe", RECIPES)
def test_cpu_emulates_every_recipe(recipe):
    assert load_config(None, [f"precision.recipe={recipe}"], device_facts=CPU).precision.recipe == recipe
    assert learner_device_errors(load_config(None, [f"precision.recipe={recipe}"]).precision, CPU) == []


def test_config_refuses_mxfp8_on_hopper_naming_field_and_capability():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["precision.recipe=mxfp8"], device_facts=HOPPER)
    message = str(info.value)
    assert "precision.recipe=mxfp8" in message and "compute capability 10.0" in message and "has 9.0" in message
    assert load_config(None, ["precision.recipe=mxfp8"], device_facts=BLACKWELL).precision.recipe == "mxfp8"
    # what the device cannot run is the only thing refused: the same config without device checks loads
    assert load_config(None, ["precision.recipe=mxfp8"], check_device=False, device_facts=HOPPER).precision.recipe == "mxfp8"


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_and_config_commands_refuse_what_this_gpu_cannot_run(recipe, monkeypatch, capsys, tmp_path):
    """`megatron-rl config` (and `train`, which loads the same way) print one error line on a Hopper GPU."""
    from megatron_rl import cli
    from megatron_rl.precision import device

    monkeypatch.setattr(device, "detect_device_facts", lambda: HOPPER)
    code = cli.main(["config", str(_write(tmp_path, recipe))])
    err = capsys.readouterr().err
    if recipe in ("mxfp8", "nvfp4", "mxfp4"):
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and f"precision.recipe={recipe}" in err
    else:
        assert code == 0 and err == ""
    if recipe == "mxfp8":
        assert cli.main(["train", str(_write(tmp_path, recipe))]) == 2
        assert "precision.recipe=mxfp8" in capsys.readouterr().err


def _write(tmp_path, recipe: str):
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\nprecision:\n  recipe: {recipe}\n")
    return path


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)])
def test_capability_rules(capability):
    errors = {r: recipe_capability_error(r, capability) for r in RECIPES}
    ok = {r for r, e in errors.items() if e is None}
    expected = {"none"}
    if capability >= (8, 9):
        expected |= {"delayed", "tensorwise"}
    if capability >= (9, 0):
        expected |= {"blockwise"}
    if capability >= (10, 0):
        expected |= {"nvfp4"} | ({"mxfp8"} if capability < (12, 0) else set())
    assert ok == expected
    for r, e in errors.items():
        if e is not None:
            assert f"precision.recipe={r}" in e and f"{capability[0]}.{capability[1]}" in e
