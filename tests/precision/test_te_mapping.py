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
