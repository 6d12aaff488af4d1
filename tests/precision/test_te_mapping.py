"""GPU mapping checked on CPU: TransformerConfig accepts the kwargs, TE recipe selection, forward context."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import fp8_forward_context, high_precision
from megatron_rl.precision import te as te_map


def _tc(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # cuda_graph_scope=[]: megatron's default "full" means the same but is deprecated (with a warning)
    return TransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4, cuda_graph_scope=[], **kw)


@pytest.mark.parametrize("recipe", ["none", "delayed", "tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_transformer_config_accepts_the_kwargs(recipe, fmt):
    k = 0 if recipe == "delayed" else 2
    cfg = PrecisionConfig(recipe=recipe, fp8_format=fmt, first_last_layers_high_precision=k, amax_history_len=16,
                          amax_compute_algo="max", margin=1)
    kw = te_map.transformer_config_kwargs(cfg)
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(kw) <= names
    tc = _tc(**kw)
    if recipe == "none":
        assert tc.fp8 is None
        return
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_margin, tc.fp8_amax_history_len, tc.fp8_amax_compute_algo) == (fmt, recipe, 1, 16, "max")
    assert tc.first_last_layers_bf16 == (k > 0)
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    from megatron_rl.precision import layer_uses_fp8

    # megatron's own per-layer BF16 decision agrees with the CPU path's
    assert [not is_first_last_bf16_layer(tc, i) for i in range(6)] == [layer_uses_fp8(cfg, i, 6) for i in range(6)]


def test_launcher_env_only_for_fp32_block_scales():
    assert te_map.launcher_env(PrecisionConfig(recipe="blockwise")) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert te_map.launcher_env(PrecisionConfig(recipe="blockwise", power_of_two_scales=True)) == {}
    assert te_map.launcher_env(PrecisionConfig(recipe="tensorwise")) == {}


def _fake_te(monkeypatch, block_pow2: bool):
    """A stand-in for transformer_engine.common.recipe with the real class and field names."""

    @dataclasses.dataclass
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0

    class Format:
        E4M3, HYBRID = "E4M3", "HYBRID"

    def recipe_cls(name, **class_attrs):
        def init(self, **kw):
            self.kw = kw

        return type(name, (), {"__init__": init, **class_attrs})

    mod = types.ModuleType("transformer_engine.common.recipe")
    mod.Format = Format
    mod.DelayedScaling = recipe_cls("DelayedScaling")
    mod.Float8CurrentScaling = recipe_cls("Float8CurrentScaling")
    mod.MXFP8BlockScaling = recipe_cls("MXFP8BlockScaling")
    mod.Float8BlockScaling = recipe_cls("Float8BlockScaling", fp8_quant_fwd_inp=QParams(power_2_scale=block_pow2))
    common = types.ModuleType("transformer_engine.common")
    common.recipe = mod
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", mod)
    return mod


def test_te_recipe_selection(monkeypatch):
    mod = _fake_te(monkeypatch, block_pow2=False)
    r = te_map.te_recipe(PrecisionConfig(recipe="delayed", margin=2, amax_history_len=8, amax_compute_algo="max"))
    assert type(r).__name__ == "DelayedScaling"
    assert r.kw == dict(margin=2, fp8_format="HYBRID", amax_history_len=8, amax_compute_algo="max")
    assert type(te_map.te_recipe(PrecisionConfig(recipe="tensorwise", fp8_format="e4m3"))).__name__ == "Float8CurrentScaling"
    assert te_map.te_recipe(PrecisionConfig(recipe="mxfp8")).kw == {"fp8_format": "HYBRID"}
    assert type(te_map.te_recipe(PrecisionConfig(recipe="blockwise"))) is mod.Float8BlockScaling
    assert te_map.te_recipe(PrecisionConfig()) is None
    # TE imported with power-of-two block scales but the policy wants FP32: fail fast, name the variable
    with pytest.raises(RuntimeError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES"):
        te_map.te_recipe(PrecisionConfig(recipe="blockwise", power_of_two_scales=True))


def test_forward_context_is_a_no_op_without_te():
    import contextlib

    if te_map.te_available():
        pytest.skip("TE present: covered by tests/gpu")
    for recipe in ("none", "tensorwise", "blockwise"):
        cfg = PrecisionConfig(recipe=recipe)
        assert isinstance(fp8_forward_context(cfg), contextlib.nullcontext)
        with high_precision():
            assert isinstance(fp8_forward_context(cfg), contextlib.nullcontext)


def test_config_validation():
    with pytest.raises(ValueError):
        PrecisionConfig(recipe="delayed", first_last_layers_high_precision=1)
    with pytest.raises(ValueError):
        PrecisionConfig(fp8_params=True)
    with pytest.raises(ValueError):
        PrecisionConfig(recipe="tensorwise", margin=-1)


def test_nvfp4_maps_onto_megatron_fp4_fields():
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.precision import layer_uses_fp8

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for k in (0, 1):
        cfg = PrecisionConfig(recipe="nvfp4", first_last_layers_high_precision=k)
        kw = te_map.transformer_config_kwargs(cfg)
        assert set(kw) <= names
        tc = _tc(**kw)
        assert (tc.fp8, tc.fp4, tc.fp4_recipe, tc.fp4_param) == (None, "e2m1", "nvfp4", False)
        # megatron's get_fp4_context uses the same first/last BF16 layer rule as FP8's
        assert [not is_first_last_bf16_layer(tc, i) for i in range(6)] == [layer_uses_fp8(cfg, i, 6) for i in range(6)]
    assert _tc(**te_map.transformer_config_kwargs(PrecisionConfig(recipe="nvfp4", fp8_params=True))).fp4_param
    with pytest.raises(ValueError, match="precision.recipe=mxfp4"):
        te_map.transformer_config_kwargs(PrecisionConfig(recipe="mxfp4"))


def test_nvfp4_launcher_env():
    assert te_map.launcher_env(PrecisionConfig(recipe="nvfp4")) == {}
    assert te_map.launcher_env(PrecisionConfig(recipe="nvfp4", fp4_hadamard_wgrad=False, fp4_stochastic_rounding=False)) == {
        "NVTE_NVFP4_DISABLE_RHT": "1", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1"}
    assert te_map.launcher_env(PrecisionConfig(recipe="mxfp4")) == {}


def _fake_nvfp4(monkeypatch, disable_rht: bool, disable_sr: bool, capability=(10, 0)):
    mod = _fake_te(monkeypatch, block_pow2=False)

    @dataclasses.dataclass
    class NVFP4BlockScaling:  # TE >= 2.8: options default from the environment at import time
        disable_rht: bool = False
        disable_stochastic_rounding: bool = False
        disable_2d_quantization: bool = False

    NVFP4BlockScaling.disable_rht = disable_rht
    NVFP4BlockScaling.disable_stochastic_rounding = disable_sr
    mod.NVFP4BlockScaling = NVFP4BlockScaling
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: capability)
    return mod


def test_nvfp4_te_recipe_and_environment_checks(monkeypatch):
    _fake_nvfp4(monkeypatch, disable_rht=False, disable_sr=False)
    r = te_map.te_recipe(PrecisionConfig(recipe="nvfp4"))
    assert type(r).__name__ == "NVFP4BlockScaling" and not r.disable_rht and not r.disable_stochastic_rounding
    with pytest.raises(RuntimeError, match="NVTE_NVFP4_DISABLE_RHT=1"):
        te_map.check_te_environment(PrecisionConfig(recipe="nvfp4", fp4_hadamard_wgrad=False))
    _fake_nvfp4(monkeypatch, disable_rht=True, disable_sr=True)
    te_map.check_te_environment(PrecisionConfig(recipe="nvfp4", fp4_hadamard_wgrad=False, fp4_stochastic_rounding=False))
    with pytest.raises(RuntimeError, match="NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=0"):
        te_map.check_te_environment(PrecisionConfig(recipe="nvfp4", fp4_hadamard_wgrad=False))
    _fake_nvfp4(monkeypatch, False, False, capability=(9, 0))
    with pytest.raises(RuntimeError, match="Blackwell"):
        te_map.check_te_environment(PrecisionConfig(recipe="nvfp4"))
    _fake_te(monkeypatch, block_pow2=False)  # an older TE without NVFP4BlockScaling
    with pytest.raises(RuntimeError, match="2.8"):
        te_map.check_te_environment(PrecisionConfig(recipe="nvfp4"))
    with pytest.raises(ValueError, match="mxfp4"):
        te_map.check_te_environment(PrecisionConfig(recipe="mxfp4"))


def test_te_disabled_clears_fp8_and_fp4(monkeypatch):
    import contextlib

    monkeypatch.setattr(te_map, "te_autocast", lambda enabled, *a, **k: contextlib.nullcontext())
    mc = types.SimpleNamespace(fp8=None, fp4="e2m1")
    with te_map.te_disabled(mc):
        assert mc.fp4 is None and mc.fp8 is None
    assert mc.fp4 == "e2m1"


def test_fp4_config_validation():
    with pytest.raises(ValueError, match="mxfp4"):
        PrecisionConfig(recipe="mxfp4", fp8_params=True)
    with pytest.raises(ValueError, match="fp4_seed"):
        PrecisionConfig(recipe="nvfp4", fp4_seed=-1)
    assert PrecisionConfig(recipe="nvfp4").fp4_enabled and not PrecisionConfig(recipe="mxfp8").fp4_enabled
    # FP4 rollout weights are not served (no rollout format): rejected when the config loads, by name
    from megatron_rl.config import ConfigError, load_config

    for value in ("nvfp4", "mxfp4"):
        with pytest.raises(ConfigError, match="precision.rollout_quantization"):
            load_config(None, ["precision.recipe=nvfp4", f"precision.rollout_quantization={value}"])
