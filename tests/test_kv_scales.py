"""FP8 KV cache scales: the learner's amax probe against the HF model's post-RoPE K/V, the smoothing rule, the names SGLang
loads, the engine's cache using the scales it received, and export with every weight sync.

Run: pytest -q tests/test_kv_scales.py
"""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.models import hf_mapping
from megatron_rl.models.presets import hf_config
from megatron_rl.parallel import state
from megatron_rl.precision import kv_scales
from megatron_rl.precision.kv_cache import fake_quantize_kv, new_kv_cache
from megatron_rl.types import TrainBatch

warnings.filterwarnings("ignore", category=UserWarning)
VOCAB, B, S, PAD = 50, 4, 12, 7
LENGTHS = (12, 9, 7, 11)
"""Tokens each row holds (the rest is right padding)."""


@pytest.fixture(scope="module")
def learner():
    from megatron_rl.trainer.learner import Learner

    torch.set_num_threads(1)
    lrn = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=VOCAB, seed=5)
    yield lrn
    state.destroy_distributed()


def padded_batch() -> TrainBatch:
    """Rows of LENGTHS tokens then PAD, the loss mask on each row's response (positions 2.. of its tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    ids[ids == PAD] = PAD + 1
    pos = torch.arange(S)[None]
    length = torch.tensor(LENGTHS)[:, None]
    ids = torch.where(pos < length, ids, torch.full_like(ids, PAD))
    mask = ((pos >= 2) & (pos < length)).float()
    return TrainBatch(ids, ids.roll(-1, 1), mask, torch.zeros(B, S), torch.zeros(B, S))


def hf_kv_amax(learner, ids: torch.Tensor) -> torch.Tensor:
    """[L, 2] amax of the K/V the HF model (same weights) caches for each row's LENGTHS tokens, one row at a time."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_config(hf_config(learner.arch), dtype=torch.float32).eval()
    model.load_state_dict(hf_mapping.to_hf(learner.gather_full_state_dict(), learner.arch), strict=False)
    out = torch.zeros(learner.arch.num_layers, 2, dtype=torch.float64)
    with torch.no_grad():
        for row, n in enumerate(LENGTHS):
            cache = model(ids[row:row + 1, :n], cache=DynamicCache(config=model.config), use_cache=True).cache
            for i, layer in enumerate(cache.layers):
                out[i, 0] = max(out[i, 0], float(layer.keys.abs().max()))
                out[i, 1] = max(out[i, 1], float(layer.values.abs().max()))
    return out


def test_probe_measures_the_post_rope_kv_an_engine_caches(learner):
    """The hook's amax equals the HF model's cached (k-norm + RoPE) K and V on the same tokens, padding excluded: the
    pad token's embedding is aligned with a row of layer 0's V projection, so counting it would raise that amax."""
    from megatron_rl.phases.logprobs import _global_forward
    from megatron_rl.trainer.kv_scales import KvAmaxProbe

    sd = learner.gather_full_state_dict()
    _, _, v = hf_mapping.split_qkv(sd["decoder.layers.0.self_attention.linear_qkv.weight"], learner.arch)
    sd["embedding.word_embeddings.weight"][PAD] = v[v.abs().sum(1).argmax()].sign()  # RMSNorm keeps the direction only
    learner.load_full_state_dict(sd)
    batch = padded_batch()
    probe = KvAmaxProbe(learner)
    try:
        with probe.recording():
            _global_forward(learner, batch, 2)
        got = probe.result()
        with probe.recording():  # every position counted: what the mask keeps out
            probe_all = batch.with_fields(loss_mask=torch.ones(B, S))
            _global_forward(learner, probe_all, 2)
        unmasked = probe.result()
        _global_forward(learner, batch, 2)  # outside recording(): nothing is recorded
        assert torch.equal(probe.result(), unmasked)
    finally:
        probe.close()
    want = hf_kv_amax(learner, batch.input_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (unmasked > got * 1.5).any(), "the padded positions must be what the mask leaves out"
    assert learner.kv_probe is None


def test_tracker_rule_window_headroom_and_state():
    """scale = headroom x max over the last `window` steps / 448; unmeasured layers keep 1.0; state round-trips."""
    t = kv_scales.KvScaleTracker(num_layers=2, window=2, headroom=1.5, power_of_two=False)
    assert not t.calibrated and torch.equal(t.scales(), torch.ones(2, 2))
    t.observe(torch.tensor([[4.0, 100.0], [0.0, 2.0]], dtype=torch.float64))
    t.observe(torch.tensor([[2.0, 300.0], [float("nan"), 1.0]], dtype=torch.float64))
    expect = torch.tensor([[4.0, 300.0], [0.0, 2.0]]) * 1.5 / 448
    expect[1, 0] = 1.0  # never a finite positive amax: SGLang's default
    torch.testing.assert_close(t.scales(), expect)
    t.observe(torch.tensor([[1.0, 10.0], [1.0, 1.0]], dtype=torch.float64))  # the first step leaves the window
    torch.testing.assert_close(t.scales()[0], torch.tensor([2.0, 300.0]) * 1.5 / 448)
    u = kv_scales.KvScaleTracker(num_layers=2, window=2, headroom=1.5, power_of_two=False)
    u.load_state_dict(t.state_dict())
    assert torch.equal(u.scales(), t.scales())
    with pytest.raises(ValueError, match="shape"):
        t.observe(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="headroom"):
        kv_scales.KvScaleTracker(2, 1, headroom=0.5)


def test_power_of_two_scales_round_up_and_cache_exactly_as_unit_in_range():
    """The default rule rounds headroom x amax / 448 up to a power of two: never less headroom than asked, and an FP8
    cache at such a scale rounds every in-range value exactly as at 1.0 (an arbitrary scale draws other errors)."""
    from megatron_rl.precision.kv_cache import fake_quantize_kv

    t = kv_scales.KvScaleTracker(num_layers=2, window=1, headroom=2.0)
    t.observe(torch.tensor([[6.5, 2.8], [448.0 / 2.0, 3000.0]], dtype=torch.float64))
    s = t.scales()
    exact = torch.tensor([[6.5, 2.8], [224.0, 3000.0]]) * 2.0 / 448
    assert torch.equal(s, torch.exp2(torch.ceil(torch.log2(exact))))
    assert (s >= exact).all() and (s < 2 * exact).all() and s[1, 0] == 1.0  # 224 x 2 / 448 is already 2^0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g, dtype=torch.float64) * 2.0  # |x| well inside [2^-6, 448]: normal at scale 1.0
    x = x[x.abs() > 2.0 ** -6]
    assert torch.equal(fake_quantize_kv(x, float(s[0, 0])), fake_quantize_kv(x, 1.0))
    assert not torch.equal(fake_quantize_kv(x, float(exact[0, 0])), fake_quantize_kv(x, 1.0))
    u = kv_scales.KvScaleTracker(num_layers=2, window=1, headroom=2.0)
    u.load_state_dict(t.state_dict())
    assert torch.equal(u.scales(), s) and t.state_dict()["power_of_two"] is True


def test_names_sglang_loads_per_family_and_its_scale_rules():
    """Qwen3/Llama load `self_attn.k_scale` (maybe_remap_kv_scale_name); Qwen2's legacy loader the parameter's own name."""
    assert kv_scales.kv_scale_names("qwen3", 3) == ("model.layers.3.self_attn.k_scale", "model.layers.3.self_attn.v_scale")
    assert kv_scales.kv_scale_names("llama", 0)[1] == "model.layers.0.self_attn.v_scale"
    assert kv_scales.kv_scale_names("qwen2", 1)[0] == "model.layers.1.self_attn.attn.k_scale"
    with pytest.raises(ValueError, match="model_type"):
        kv_scales.kv_scale_names("gpt2", 0)
    assert all(kv_scales.is_kv_scale_name(n) for f in kv_scales.kv_scale_families() for n in kv_scales.kv_scale_names(f, 2))
    assert not kv_scales.is_kv_scale_name("model.layers.0.self_attn.k_proj.weight_scale_inv")
    assert kv_scales.effective_kv_scales(0.5, 0.25) == (0.5, 0.25)
    assert kv_scales.effective_kv_scales(-1.0, -1.0) == (1.0, 1.0)
    assert kv_scales.effective_kv_scales(0.5, -1.0) == (0.5, 0.5)
    with pytest.raises(ValueError, match="k_scale > 0"):
        kv_scales.effective_kv_scales(0.0, 0.5)


def test_config_resolves_and_refuses_what_cannot_work():
    """auto recalibrates with an FP8 cache (not under w8a8_fp8, which loads no scales); explicit impossibilities fail."""
    assert PrecisionConfig(kv_cache_dtype="fp8_e4m3").recalibrates_kv_scales
    assert PrecisionConfig(kv_cache_dtype="fp8_e4m3", rollout_quantization="fp8-blockwise").recalibrates_kv_scales
    assert not PrecisionConfig(kv_cache_dtype="fp8_e4m3", kv_cache_scales="unit").recalibrates_kv_scales
    assert not PrecisionConfig(kv_cache_dtype="fp8_e4m3", rollout_quantization="fp8-channel").recalibrates_kv_scales
    assert not PrecisionConfig().recalibrates_kv_scales
    with pytest.raises(ValueError, match="kv_cache_scales=recalibrate needs precision.kv_cache_dtype"):
        PrecisionConfig(kv_cache_scales="recalibrate")
    with pytest.raises(ValueError, match="fp8-channel"):
        PrecisionConfig(kv_cache_dtype="fp8_e4m3", kv_cache_scales="recalibrate", rollout_quantization="fp8-channel")
    with pytest.raises(ValueError, match="kv_cache_scale_headroom"):
        PrecisionConfig(kv_cache_scale_headroom=0.9)


def test_cache_layers_quantize_with_their_own_scales(tmp_path):
    """Each layer of an FP8 cache stores fake_quantize_kv(x, its scale): a scale that fits V and one that saturates it."""
    from megatron_rl.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), seed=2).eval()
    ids = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        plain = model(ids, cache=new_kv_cache(model.config, "auto"), use_cache=True).cache
        scales = [(0.01, 0.02), (3e-4, 1e-3)]
        fp8 = model(ids, cache=new_kv_cache(model.config, "fp8_e4m3", scales=scales), use_cache=True).cache
    # layer 0's input is the embedding, identical in both runs: its entries are exactly the quantized plain K/V
    assert torch.equal(fp8.layers[0].keys, fake_quantize_kv(plain.layers[0].keys, 0.01))
    assert torch.equal(fp8.layers[0].values, fake_quantize_kv(plain.layers[0].values, 0.02))
    assert fp8.layers[1].k_scale == 3e-4 and fp8.layers[1].v_scale == 1e-3
    assert not torch.equal(fake_quantize_kv(plain.layers[0].values, 1e-4), fake_quantize_kv(plain.layers[0].values, 0.02))
    with pytest.raises(ValueError, match="scale pairs"):
        new_kv_cache(model.config, "fp8_e4m3", scales=scales[:1])
