"""Checkpoint conversion for Llama-3, Qwen2.5 and Qwen3 tiny HF models built offline from configs.

HF -> torch_dist -> HF reproduces every tensor bit for bit (fp32 and bf16); our megatron model's
logits equal transformers' to 1e-5; an FP8 checkpoint made from either side holds the same bits
and is served by the embedded engine; unsupported configs are rejected naming the key.
"""
import json

import pytest
import torch

from convert_models import FAMILIES, VOCAB, make_hf_model, tiny_hf_config
from megatron_rl.cli import main
from megatron_rl.convert.safetensors_io import INDEX_FILE, iter_hf_tensors
from megatron_rl.models.hf_arch import UnsupportedArchitecture, architecture_differences, architecture_from_hf
from megatron_rl.models.presets import hf_config


def _tensors(path) -> dict[str, torch.Tensor]:
    return dict(iter_hf_tensors(path))


def _assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.bool else a[k],
                           b[k].view(torch.uint8) if b[k].dtype != torch.bool else b[k]), k


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_from_hf_config_renders_back_to_the_same_config(family):
    cfg = tiny_hf_config(family).to_dict()
    arch = architecture_from_hf(cfg)
    assert arch.family == family and arch.vocab_size == VOCAB
    assert arch.qkv_bias == (family == "qwen2") and arch.qk_layernorm == (family == "qwen3")
    assert arch.rope_scaling_factor == (8.0 if family == "llama" else None)
    assert architecture_differences(architecture_from_hf(hf_config(arch).to_dict()), arch) == {}


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16), ("qwen3", torch.float32)])
def test_hf_megatron_hf_round_trip_is_bitwise(tmp_path, family, dtype):
    make_hf_model(family, tmp_path / "hf", dtype=dtype)
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg")]) == 0
    assert main(["convert", "megatron-to-hf", str(tmp_path / "mg"), str(tmp_path / "back"),
                 "--hf-config", str(tmp_path / "hf"), "--max-shard-size", "30KB"]) == 0
    _assert_bitwise(_tensors(tmp_path / "hf"), _tensors(tmp_path / "back"))
    index = json.loads((tmp_path / "back" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1, "a 30KB shard limit must split the tiny model"
    # Without --hf-config, config.json is rendered from the checkpoint's recorded architecture.
    assert main(["convert", "megatron-to-hf", str(tmp_path / "mg"), str(tmp_path / "plain")]) == 0
    rendered = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert architecture_differences(architecture_from_hf(rendered), architecture_from_hf(tiny_hf_config(family).to_dict())) == {}
    _assert_bitwise(_tensors(tmp_path / "hf"), _tensors(tmp_path / "plain"))


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_match_transformers(tmp_path, family):
    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.trainer.checkpoint import load_checkpoint
    from megatron_rl.trainer.checkpoint_reader import checkpoint_architecture
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.trainer.model import unwrap

    hf = make_hf_model(family, tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg")]) == 0
    arch = checkpoint_architecture(tmp_path / "mg")
    learner = Learner(ModelConfig(), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=VOCAB, seed=5,
                      architecture=arch)
    load_checkpoint(learner, str(tmp_path / "mg"), load_optimizer=False, load_rng=False)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        ours = unwrap(learner.model[0]).eval()(ids, pos, None).float()
        ref = hf(input_ids=ids).logits.float()
    assert ref.abs().max() > 1.0, "logits too flat to test the mapping"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_fp8_from_megatron_equals_fp8_from_hf_and_is_served(tmp_path):
    from megatron_rl.precision import quantize_blockwise
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.engine.testing import ThreadedServer, make_tiny_tokenizer
    from megatron_rl.precision.w8a8 import w8a8_weights

    make_hf_model("qwen2", tmp_path / "hf", dtype=torch.bfloat16)
    make_tiny_tokenizer(str(tmp_path / "hf"), vocab_size=VOCAB)
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg")]) == 0
    assert main(["convert", "hf-to-fp8", str(tmp_path / "hf"), str(tmp_path / "fp8_hf")]) == 0
    assert main(["convert", "megatron-to-fp8", str(tmp_path / "mg"), str(tmp_path / "fp8_mg"),
                 "--hf-config", str(tmp_path / "hf")]) == 0
    _assert_bitwise(_tensors(tmp_path / "fp8_hf"), _tensors(tmp_path / "fp8_mg"))
    config = json.loads((tmp_path / "fp8_mg" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (tmp_path / "fp8_mg" / "tokenizer.json").exists()
    source = _tensors(tmp_path / "hf")
    served = w8a8_weights(load_hf_model(str(tmp_path / "fp8_mg")))
    assert len(served) == 2 * 7, "every q/k/v/o/gate/up/down projection of both layers is served in FP8"
    for module, (q, _) in served.items():
        assert torch.equal(q.view(torch.uint8), quantize_blockwise(source[f"{module}.weight"])[0].view(torch.uint8)), module
    with ThreadedServer(str(tmp_path / "fp8_mg"), str(tmp_path / "hf")) as srv:
        out = RolloutClient(srv.url).generate_batch_sync([[5, 6, 7]], {"n": 2, "max_new_tokens": 4, "temperature": 1.0})
    assert len(out[0]) == 2 and all(len(o.output_ids) >= 1 for o in out[0])


def test_hf_to_megatron_checks_an_explicit_model_config(tmp_path, capsys):
    make_hf_model("qwen3", tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg"), "model.preset=tiny",
                 "model.hidden_size=64", "model.num_layers=3"]) == 2
    assert "num_layers" in capsys.readouterr().err
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("change,key", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"model_type": "mistral"}, "model_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_hf_configs_are_named(change, key):
    cfg = tiny_hf_config("llama").to_dict()
    cfg.pop("rope_parameters", None)
    cfg.update(change)
    with pytest.raises(UnsupportedArchitecture, match=key):
        architecture_from_hf(cfg)


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    make_hf_model("qwen3", tmp_path / "hf")
    make_hf_model("qwen3", tmp_path / "other", num_hidden_layers=3)
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg")]) == 0
    assert main(["convert", "megatron-to-hf", str(tmp_path / "mg"), str(tmp_path / "out"), "--hf-config", str(tmp_path / "other")]) == 2
    assert "num_layers" in capsys.readouterr().err
    assert main(["convert", "megatron-to-hf", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "no complete megatron_rl checkpoint" in capsys.readouterr().err


def test_learner_vocabulary_follows_the_init_checkpoint_not_the_tokenizer(tmp_path):
    """Real checkpoints pad the embedding beyond the tokenizer (Qwen3: 151936 rows for 151669 tokens)."""
    from megatron_rl.engine.testing import make_tiny_tokenizer
    from megatron_rl.warm_start import model_vocab_size

    make_hf_model("qwen3", tmp_path / "hf")
    small, large = make_tiny_tokenizer(str(tmp_path / "t40"), 40), make_tiny_tokenizer(str(tmp_path / "t120"), 120)
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg")]) == 0
    assert model_vocab_size(str(tmp_path / "hf"), small) == VOCAB
    assert model_vocab_size(str(tmp_path / "mg"), small) == VOCAB
    assert model_vocab_size(str(tmp_path / "nowhere"), small) == 40
    with pytest.raises(ValueError, match="fewer than the tokenizer"):
        model_vocab_size(str(tmp_path / "hf"), large)
