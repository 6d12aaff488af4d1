"""Megatron <-> HF mapping: a tiny model's logits agree in both directions, layouts round-trip."""
import pytest
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.models import hf_mapping
from megatron_rl.models.presets import hf_config


@pytest.fixture(scope="module")
def learner():
    from megatron_rl.trainer.learner import Learner

    torch.manual_seed(0)
    return Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=50, seed=3)


def _megatron_logits(learner, ids):
    from megatron_rl.trainer.model import unwrap

    model = unwrap(learner.model[0]).eval()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None).float()


def _hf_model(learner, state_dict=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(hf_config(learner.arch), torch_dtype=torch.float32).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected, unexpected
        assert not [m for m in missing if "rotary" not in m], missing
    return model


def test_qkv_split_merge_is_inverse_and_grouped(learner):
    arch = learner.arch
    rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
    qkv = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    q, k, v = hf_mapping.split_qkv(qkv, arch)
    assert torch.equal(hf_mapping.merge_qkv(q, k, v, arch), qkv)
    per = arch.num_attention_heads // arch.num_query_groups
    # The first group's block starts with its query heads, then one key head, then one value head.
    d = arch.head_dim
    assert torch.equal(qkv[: per * d], q[: per * d])
    assert torch.equal(qkv[per * d : per * d + d], k[:d])
    assert torch.equal(qkv[per * d + d : per * d + 2 * d], v[:d])


def test_megatron_to_hf_logits_agree(learner):
    sd = learner.gather_full_state_dict()
    hf_sd = hf_mapping.to_hf(sd, learner.arch)
    model = _hf_model(learner, hf_sd)
    ids = torch.randint(0, 50, (3, 17))
    ref = _megatron_logits(learner, ids)
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    assert ref.shape == got.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_hf_to_megatron_logits_agree(learner):
    model = _hf_model(learner)  # an independent random HF model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from 1 so their mapping matters
    mg = hf_mapping.to_megatron(model.state_dict(), learner.arch)
    hf_mapping.check_complete(mg, learner.expected_full_shapes(), "HF -> megatron")
    before = learner.gather_full_state_dict()
    try:
        learner.load_full_state_dict(mg)
        ids = torch.randint(0, 50, (2, 13))
        with torch.no_grad():
            ref = model(input_ids=ids).logits.float()
        torch.testing.assert_close(_megatron_logits(learner, ids), ref, atol=1e-5, rtol=1e-5)
    finally:
        learner.load_full_state_dict(before)


def test_round_trip_and_te_names(learner):
    sd = learner.gather_full_state_dict()
    back = hf_mapping.to_megatron(hf_mapping.to_hf(sd, learner.arch), learner.arch)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    te = hf_mapping.to_megatron(hf_mapping.to_hf(sd, learner.arch), learner.arch, te_fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.input_layernorm.weight" not in te
    assert set(hf_mapping.to_hf(te, learner.arch)) == set(hf_mapping.to_hf(sd, learner.arch))


def test_unknown_names_are_reported(learner):
    with pytest.raises(hf_mapping.MappingError, match="model.layers.0.self_attn.rogue"):
        hf_mapping.to_megatron({"model.layers.0.self_attn.rogue.weight": torch.zeros(1)}, learner.arch)
    with pytest.raises(hf_mapping.MappingError, match="decoder.bogus"):
        hf_mapping.to_hf({"decoder.bogus": torch.zeros(1)}, learner.arch)
