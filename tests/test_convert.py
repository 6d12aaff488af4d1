"""`megatron-rl convert hf-to-fp8`: the checkpoint SGLang would load, served here with the same FP8 bits."""
import json

import torch
from safetensors.torch import load_file

from megatron_rl.cli import main
from megatron_rl.precision import quantize_blockwise
from megatron_rl.precision.w8a8 import w8a8_weights
from megatron_rl.rollout.engine import load_hf_model
from megatron_rl.rollout.testing import make_tiny_model


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
