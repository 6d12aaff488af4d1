"""HF FP8 checkpoints: layout, safetensors round trip, and trainer/server holding identical FP8 bits."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megatron_rl.precision import load_fp8_checkpoint, load_fp8_checkpoint_into, quantize_blockwise, save_fp8_checkpoint
from megatron_rl.precision.hf_fp8 import dequantize_state_dict, is_quantized_weight
from megatron_rl.precision.w8a8 import W8A8Linear, w8a8_weights

from .fp8_reference import ckpt_dequantize, ckpt_quantize

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _tiny_qwen3(tie: bool = True, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=256, hidden_size=160, intermediate_size=272, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=40, tie_word_embeddings=tie, max_position_embeddings=64)
    return Qwen3ForCausalLM(cfg).eval(), cfg


def test_which_weights_are_quantized():
    assert is_quantized_weight("model.layers.3.self_attn.q_proj.weight")
    assert is_quantized_weight("model.layers.0.mlp.down_proj.weight")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert not is_quantized_weight(name), name


@pytest.mark.parametrize("tie", [True, False])
def test_checkpoint_layout_and_round_trip(tmp_path, tie):
    model, cfg = _tiny_qwen3(tie)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    save_fp8_checkpoint(sd, cfg.to_dict(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    assert config["hidden_size"] == 160
    tensors, config2 = load_fp8_checkpoint(tmp_path)
    assert config2 == config
    assert ("lm_head.weight" in tensors) == (not tie)
    for layer in range(2):
        for proj in PROJ:
            name = f"model.layers.{layer}.{proj}.weight"
            w = sd[name]
            q, s = tensors[name], tensors[name + "_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
            assert s.dtype == torch.float32 and s.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
            rq, rs = ckpt_quantize(w.numpy(), (128, 128))
            assert np.array_equal(q.double().numpy(), rq) and np.array_equal(s.numpy(), rs)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert tensors[name].dtype == sd[name].dtype and torch.equal(tensors[name], sd[name])
    deq = dequantize_state_dict(tensors)
    name = "model.layers.1.mlp.up_proj.weight"
    rq, rs = ckpt_quantize(sd[name].numpy(), (128, 128))
    assert np.array_equal(deq[name].numpy(), ckpt_dequantize(rq, rs, (128, 128)))
    assert not any(k.endswith("_scale_inv") for k in deq)


def test_sharded_checkpoint_round_trip(tmp_path):
    model, cfg = _tiny_qwen3()
    sd = model.state_dict()
    save_fp8_checkpoint(sd, cfg.to_dict(), tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tensors, _ = load_fp8_checkpoint(tmp_path)
    assert set(tensors) == set(index["weight_map"])


def test_ue8m0_checkpoint_marks_scale_fmt(tmp_path):
    model, cfg = _tiny_qwen3()
    save_fp8_checkpoint(model.state_dict(), cfg.to_dict(), tmp_path, scale_fmt="ue8m0")
    tensors, config = load_fp8_checkpoint(tmp_path)
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    s = tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    m, _ = np.frexp(s.numpy())
    assert np.all(m == 0.5)


def test_server_holds_the_trainer_quantized_bits(tmp_path):
    """Trainer-side blockwise quantization == what the rollout model holds after loading the checkpoint."""
    model, cfg = _tiny_qwen3(tie=False)
    trainer_sd = {k: v.clone() for k, v in model.state_dict().items()}
    save_fp8_checkpoint(trainer_sd, cfg.to_dict(), tmp_path)
    server, _ = _tiny_qwen3(tie=False, seed=123)  # different random init: everything must come from the file
    load_fp8_checkpoint_into(server, tmp_path)
    held = w8a8_weights(server)
    assert len(held) == 2 * len(PROJ)
    for name, (q_srv, s_srv) in held.items():
        q_tr, s_tr = quantize_blockwise(trainer_sd[f"{name}.weight"])
        assert torch.equal(q_srv.view(torch.uint8), q_tr.view(torch.uint8)), name
        assert torch.equal(s_srv, s_tr), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(server.state_dict()[name], trainer_sd[name])
    # a second load (weight sync) updates in place
    module = server.get_submodule("model.layers.0.mlp.down_proj")
    trainer_sd["model.layers.0.mlp.down_proj.weight"] *= 2
    save_fp8_checkpoint(trainer_sd, cfg.to_dict(), tmp_path / "v2")
    load_fp8_checkpoint_into(server, tmp_path / "v2")
    assert server.get_submodule("model.layers.0.mlp.down_proj") is module
    q2, s2 = quantize_blockwise(trainer_sd["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(module.weight_q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(module.weight_scale_inv, s2)


def test_w8a8_linear_forward_is_the_deepseek_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(136, 200, generator=g) * 0.05
    x = torch.randn(2, 5, 200, generator=g) * torch.logspace(-2, 1, 200)
    b = torch.randn(136, generator=g)
    q, s = quantize_blockwise(w)
    lin = W8A8Linear(q, s, b)
    rq, rs = ckpt_quantize(w.numpy(), (128, 128))
    xq, xs = ckpt_quantize(x.reshape(10, 200).numpy(), (1, 128))
    want = torch.from_numpy(ckpt_dequantize(xq, xs, (1, 128))) @ torch.from_numpy(ckpt_dequantize(rq, rs, (128, 128))).t() + b
    assert torch.equal(lin(x).reshape(10, 136), want)


def test_w8a8_model_generates_close_to_bf16(tmp_path):
    model, cfg = _tiny_qwen3()
    save_fp8_checkpoint(model.state_dict(), cfg.to_dict(), tmp_path)
    fp8_model, _ = _tiny_qwen3(seed=5)
    load_fp8_checkpoint_into(fp8_model, tmp_path)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = torch.log_softmax(model(ids).logits, -1)
        b = torch.log_softmax(fp8_model(ids).logits, -1)
    diff = (a - b).abs().mean().item()
    assert 1e-5 < diff < 5e-2  # quantized (not identical) yet close


def test_loading_a_non_fp8_checkpoint_fails(tmp_path):
    model, cfg = _tiny_qwen3()
    save_fp8_checkpoint(model.state_dict(), cfg.to_dict(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError):
        load_fp8_checkpoint_into(model, tmp_path)


@pytest.mark.parametrize("mode", ["fp8-blockwise", "fp8-channel"])
def test_convert_in_place_matches_reference(mode):
    from megatron_rl.precision.w8a8 import convert_to_w8a8

    model, _ = _tiny_qwen3()
    w = model.get_submodule("model.layers.0.mlp.gate_proj").weight.detach().clone()
    names = convert_to_w8a8(model, mode)
    assert len(names) == 2 * len(PROJ)
    assert not isinstance(model.get_submodule("lm_head"), W8A8Linear)
    q, s = w8a8_weights(model)["model.layers.0.mlp.gate_proj"]
    block = (128, 128) if mode == "fp8-blockwise" else (1, w.shape[1])
    rq, rs = ckpt_quantize(w.numpy(), block)
    assert np.array_equal(q.double().numpy(), rq) and np.array_equal(s.numpy(), rs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, w.shape[1], generator=g)
    lin = model.get_submodule("model.layers.0.mlp.gate_proj")
    act = (1, 128) if mode == "fp8-blockwise" else (1, w.shape[1])
    xq, xs = ckpt_quantize(x.numpy(), act)
    want = torch.from_numpy(ckpt_dequantize(xq, xs, act)) @ torch.from_numpy(ckpt_dequantize(rq, rs, block)).t()
    assert torch.equal(lin(x), want)


@pytest.mark.parametrize("cols, group", [(64, 128), (128, 128), (256, 128), (32, 16), (100, 128), (200, 128)])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_activation_fast_path_is_bitwise_the_general_one(cols, group, scale_fmt):
    """Rows tiled by their groups take a broadcast fast path; it must give the general path's bits, specials included."""
    from megatron_rl.precision.blockwise import dequantize_blockwise, fake_quantize_activation_groups, quantize_activation_groups

    g = torch.Generator().manual_seed(cols + group)
    x = torch.randn(3, 5, cols, generator=g) * torch.logspace(-6, 3, cols)
    x[0, 0] = 0.0  # an all-zero row: the amax floor
    x[0, 1, 0], x[0, 1, 1], x[0, 2, 2] = float("nan"), float("inf"), -1e9  # NaN is skipped by amax, inf saturates
    q, s = quantize_activation_groups(x, group, scale_fmt)
    general = dequantize_blockwise(q.reshape(-1, cols), s.reshape(15, -1), (1, group)).reshape(x.shape)
    fast = fake_quantize_activation_groups(x, group, scale_fmt)
    assert torch.equal(fast.isnan(), general.isnan())
    assert torch.equal(torch.nan_to_num(fast), torch.nan_to_num(general))
