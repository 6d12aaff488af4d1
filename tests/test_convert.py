"""`megatron-rl convert hf-to-fp8`: the checkpoint SGLang would load, served here with the same FP8 bits."""
import json

import torch
from safetensors.torch import load_file

from megatron_rl.cli import main
from megatron_rl.precision import quantize_blockwise
from megatron_rl.precision.w8a8 import w8a8_weights
from megatron_rl.engine.generation import load_hf_model
from megatron_rl.engine.testing import make_tiny_model


def test_hf_to_fp8_conversion_is_served_with_the_same_bits(tmp_path):
    src, dst = tmp_path / "hf", tmp_path / "fp8"
    make_tiny_model(str(src))
    assert main(["convert", "hf-to-fp8", str(src), str(dst)]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    source = load_file(str(src / "model.safetensors"))
    served = w8a8_weights(load_hf_model(str(dst)))
    assert served, "no linear layer was served in FP8"
    for module, (q, scale_inv) in served.items():
        ref_q, ref_scale = quantize_blockwise(source[f"{module}.weight"])
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), module
        assert torch.equal(scale_inv, ref_scale), module
    assert "model.embed_tokens.weight" in load_file(str(dst / "model.safetensors"))  # embeddings stay high precision


def test_hf_to_megatron_checkpoint_starts_a_learner_with_the_hf_weights(tmp_path):
    """Convert under one config, load as model.init_checkpoint: the learner's log-probs equal the HF model's."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.config import load_config
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.models.presets import hf_config, resolve_architecture
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import initialize_learner, is_megatron_checkpoint

    cfg = load_config(None, ["model.preset=tiny"])
    tok = build_char_tokenizer(tmp_path / "tok")
    arch = resolve_architecture(cfg.model, len(tok))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(arch)).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    # a decaying schedule (as the tiny configs have) must not stop a conversion, which trains nothing
    assert main(["convert", "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mg"), "model.preset=tiny",
                 "optim.lr_decay_style=cosine"]) == 0
    assert is_megatron_checkpoint(tmp_path / "mg") and not is_megatron_checkpoint(tmp_path / "hf")

    learner = Learner(cfg.model, cfg.parallel, cfg.optim, cfg.precision, vocab_size=len(tok), seed=123)
    served_from = initialize_learner(learner, str(tmp_path / "mg"), tok, tmp_path / "run")
    ids = torch.randint(3, len(tok), (2, 10))
    from megatron_rl.types import TrainBatch

    zeros = torch.zeros(2, 9)
    batch = TrainBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], loss_mask=zeros + 1, advantages=zeros, rollout_logprobs=zeros)
    lp, _ = learner.forward_logprobs(batch, 2)
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=ids[:, :-1]).logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    exported = load_file(str(tmp_path / "run" / "init_hf" / "model.safetensors"))  # what the engines will serve
    assert torch.equal(exported["model.embed_tokens.weight"], hf.state_dict()["model.embed_tokens.weight"])
    assert served_from == str(tmp_path / "run" / "init_hf")
