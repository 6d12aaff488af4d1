"""Rollout weight formats: trainer-side quantizers, checkpoint layout, engine-side loading of the same bits; FP8 KV cache."""
import json
import typing

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.rollout_formats import (
    ROLLOUT_FORMATS, checkpoint_format, load_quantized_model, rollout_format, write_launch_checkpoint,
)
from megatron_rl.rollout.sync.disk import write_hf_checkpoint
from megatron_rl.engine.testing import make_tiny_model

torch.set_num_threads(1)


def test_registry_covers_every_config_value():
    values = typing.get_args(PrecisionConfig.model_fields["rollout_quantization"].annotation)
    assert set(values) == set(ROLLOUT_FORMATS)
    for v in values:
        assert rollout_format(PrecisionConfig(rollout_quantization=v)).name == v


def test_fp8_channel_layout_is_sglang_w8a8_fp8():
    torch.manual_seed(0)
    w = torch.randn(96, 80) * torch.logspace(-2, 1, 96)[:, None]  # rows of very different magnitudes
    fmt = rollout_format(PrecisionConfig(rollout_quantization="fp8-channel"))
    out = fmt.quantize("model.layers.0.mlp.down_proj.weight", w)
    q, s = out["model.layers.0.mlp.down_proj.weight"], out["model.layers.0.mlp.down_proj.weight_scale"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (96, 80)
    assert s.dtype == torch.float32 and s.shape == (96, 1)
    # one scale per output row: amax(row) / 448, and every row uses the full E4M3 range
    torch.testing.assert_close(s[:, 0], w.abs().amax(dim=1) / 448.0)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((96,), 448.0))
    assert (q.float() * s - w).abs().max() <= (w.abs().amax(dim=1, keepdim=True) / 448.0 * 32).max()
    # high-precision tensors pass through untouched
    e = torch.randn(10, 8)
    assert fmt.quantize("model.embed_tokens.weight", e)["model.embed_tokens.weight"] is e
    assert fmt.config_updates() == {"quantization_config": {"quant_method": "w8a8_fp8", "fmt": "e4m3",
                                                            "activation_scheme": "dynamic"}}
    assert fmt.sglang_quantization == "w8a8_fp8"


def test_checkpoint_format_detection():
    assert checkpoint_format({}) is None
    assert checkpoint_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == "fp8-blockwise"
    assert checkpoint_format({"quantization_config": {"quant_method": "w8a8_fp8"}}) == "fp8-channel"
    with pytest.raises(ValueError, match="not a rollout format"):
        checkpoint_format({"quantization_config": {"quant_method": "awq"}})


def _reference_channel_forward(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Independent W8A8 per-channel reference: per-row weight scales, per-token activation scales, fp32 GEMM."""
    ws = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / 448.0
    wq = torch.clamp(w / ws, -448, 448).to(torch.float8_e4m3fn).float() * ws
    xs = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    xq = torch.clamp(x / xs, -448, 448).to(torch.float8_e4m3fn).float() * xs
    return xq @ wq.t()


def test_fp8_channel_end_to_end_engine_serves_the_trainer_bits(tmp_path):
    from megatron_rl.precision.w8a8 import W8A8Linear
    from megatron_rl.engine.generation import load_hf_model

    model = make_tiny_model(str(tmp_path / "hf"), seed=3)
    precision = PrecisionConfig(rollout_quantization="fp8-channel")
    fmt = rollout_format(precision)
    payload = fmt.quantize_state_dict(model.state_dict())
    (tmp_path / "ckpt").mkdir()
    write_hf_checkpoint(payload, str(tmp_path / "hf"), str(tmp_path / "ckpt"), fmt.config_updates())
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]["quant_method"] == "w8a8_fp8"
    served = load_hf_model(str(tmp_path / "ckpt"))  # the embedded engine's loader
    linears = {n: m for n, m in served.named_modules() if isinstance(m, W8A8Linear)}
    assert len(linears) == 2 * 7  # q/k/v/o + gate/up/down in each of the 2 layers
    for name, m in linears.items():
        assert torch.equal(m.weight_q.view(torch.uint8), payload[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(m.weight_scale_inv, payload[f"{name}.weight_scale"])
        x = torch.randn(3, 5, m.in_features)
        torch.testing.assert_close(m(x), _reference_channel_forward(model.get_submodule(name).weight.detach(), x),
                                   rtol=1e-5, atol=1e-5)
    # the whole served model == the trainer's model with its Linears quantized in memory (same bits, same math)
    import copy

    from megatron_rl.precision.w8a8 import convert_to_w8a8

    in_memory = copy.deepcopy(model)
    convert_to_w8a8(in_memory, "fp8-channel")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(served(ids).logits, in_memory(ids).logits)
        assert not torch.equal(served(ids).logits, model(ids).logits)


def test_launch_checkpoint(tmp_path):
    make_tiny_model(str(tmp_path / "hf"), seed=1)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    hf = str(tmp_path / "hf")
    assert write_launch_checkpoint(hf, PrecisionConfig(), str(tmp_path / "out")) == hf
    for q, method in (("fp8-channel", "w8a8_fp8"), ("fp8-blockwise", "fp8")):
        path = write_launch_checkpoint(hf, PrecisionConfig(rollout_quantization=q), str(tmp_path / "out"))
        assert path.endswith(f"launch_{q}")
        assert json.loads(open(f"{path}/config.json").read())["quantization_config"]["quant_method"] == method
        assert (tmp_path / "out" / f"launch_{q}" / "tokenizer.json").exists()
        load_quantized_model(path)  # loads strictly
        # already in the format: used as is
        assert write_launch_checkpoint(path, PrecisionConfig(rollout_quantization=q), str(tmp_path / "out2")) == path
    with pytest.raises(ValueError, match="rollout_quantization=none"):
        write_launch_checkpoint(path, PrecisionConfig(), str(tmp_path / "out3"))


# ------------------------------------------------------------------------------------------ FP8 KV cache
def test_fake_quantize_kv_is_e4m3_with_scale():
    from megatron_rl.precision.kv_cache import fake_quantize_kv

    x = torch.tensor([0.0, 1.0, 1.06, -3.3, 500.0, -1e4, 1e-3])
    expected = torch.clamp(x, -448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(fake_quantize_kv(x), expected)
    assert torch.equal(fake_quantize_kv(x, 2.0), (torch.clamp(x / 2, -448, 448).to(torch.float8_e4m3fn).float() * 2))
    assert fake_quantize_kv(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_fp8_kv_cache_stores_quantized_keys_and_values(tmp_path):
    from megatron_rl.precision.kv_cache import fake_quantize_kv, new_kv_cache

    model = make_tiny_model(str(tmp_path / "m"), seed=2)
    ids = torch.tensor([[3, 9, 4, 17, 5, 22]])
    with torch.no_grad():
        plain = model(ids, cache=new_kv_cache(model.config, "auto"), use_cache=True).cache
        fp8 = model(ids, cache=new_kv_cache(model.config, "fp8_e4m3"), use_cache=True).cache
    # layer 0 sees the same inputs: its cache holds exactly the E4M3 rounding of the plain K/V
    assert torch.equal(fp8.layers[0].keys, fake_quantize_kv(plain.layers[0].keys))
    assert torch.equal(fp8.layers[0].values, fake_quantize_kv(plain.layers[0].values))
    assert not torch.equal(fp8.layers[0].keys, plain.layers[0].keys)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        new_kv_cache(model.config, "fp8_e5m2")


def test_engine_with_fp8_kv_cache_matches_teacher_forced_fp8_reference(tmp_path):
    from megatron_rl.precision.kv_cache import new_kv_cache
    from megatron_rl.engine.generation import Engine, GenerationRequest, SamplingParams

    model = make_tiny_model(str(tmp_path / "m"), seed=4)
    prompt = [3, 8, 13, 21]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, sampling_seed=11)
    out = {}
    for dtype in ("auto", "fp8_e4m3"):
        engine = Engine(str(tmp_path / "m"), kv_cache_dtype=dtype)
        out[dtype] = engine.generate([GenerationRequest(prompt, params)])[0][0]
    fp8 = out["fp8_e4m3"]
    # incremental decode with the FP8 cache == one teacher-forced pass through the FP8 cache
    ids = torch.tensor([prompt + fp8.output_ids])
    with torch.no_grad():
        logits = model(ids, cache=new_kv_cache(model.config, "fp8_e4m3"), use_cache=True).logits[0]
        plain_logits = model(ids).logits[0]
    lp = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(fp8.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(fp8.logprobs), lp, rtol=0, atol=2e-5)
    plain_lp = torch.log_softmax(plain_logits.float(), -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(fp8.output_ids)[:, None])[:, 0]
    assert (torch.tensor(fp8.logprobs) - plain_lp).abs().max() > 1e-4  # the FP8 cache changes the numbers
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(str(tmp_path / "m"), kv_cache_dtype="fp8")


@pytest.mark.parametrize("capacity", [0, 3, 64])
def test_preallocated_cache_decodes_as_transformers_dynamic_cache(tmp_path, capacity):
    """Step-by-step decode (with rows leaving the batch, and growth past the reservation) gives the logits of
    transformers' own concatenating DynamicCache."""
    from transformers import DynamicCache

    from megatron_rl.precision.kv_cache import new_kv_cache

    model = make_tiny_model(str(tmp_path / "m"), seed=5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (3, 5), generator=g)
    steps = torch.randint(3, 30, (3, 7), generator=g)
    with torch.no_grad():
        caches = {"ours": new_kv_cache(model.config, "auto", capacity=capacity), "hf": DynamicCache(config=model.config)}
        out = {k: model(ids, cache=c, use_cache=True).logits for k, c in caches.items()}
        torch.testing.assert_close(out["ours"], out["hf"], rtol=0, atol=1e-6)
        rows = torch.arange(3)
        for t in range(steps.shape[1]):
            if t == 3:  # a request finished: its row leaves both caches
                rows = rows[[0, 2]]
                for c in caches.values():
                    c.batch_select_indices(torch.tensor([0, 2]))
            tok = steps[rows, t][:, None]
            pos = torch.full_like(tok, ids.shape[1] + t)
            for k, c in caches.items():
                out[k] = model(tok, cache=c, position_ids=pos, use_cache=True).logits
            torch.testing.assert_close(out["ours"], out["hf"], rtol=0, atol=1e-6)
        assert caches["ours"].get_seq_length() == caches["hf"].get_seq_length() == ids.shape[1] + steps.shape[1]
