"""HF -> torch_dist under TP2 x PP2 (4 gloo processes) -> HF in one process reproduces every bit.

The saving layout shards q/k/v (with Qwen2's bias), the gated fc1, the vocabulary and the layers;
the reader assembles them from global coordinates alone. Run: pytest -q -m distributed tests/distributed/test_convert_layouts.py
"""
from pathlib import Path

import pytest
import torch

from conftest import run_distributed
from convert_models import make_hf_model
from megatron_rl.convert import megatron_to_hf
from megatron_rl.convert.safetensors_io import iter_hf_tensors

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("convert_worker.py")


@pytest.mark.parametrize("family,tp,pp", [("qwen2", 2, 2)])
def test_round_trip_through_a_sharded_layout_is_bitwise(tmp_path, family, tp, pp):
    make_hf_model(family, tmp_path / "hf", dtype=torch.bfloat16)
    run_distributed(WORKER, tp * pp, [str(tmp_path / "hf"), str(tmp_path / "mg"), str(tp), str(pp)], timeout=300)
    megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"), hf_config_dir=str(tmp_path / "hf"))
    src, back = dict(iter_hf_tensors(tmp_path / "hf")), dict(iter_hf_tensors(tmp_path / "back"))
    assert sorted(src) == sorted(back)
    for k in src:
        assert back[k].dtype == torch.bfloat16 and torch.equal(src[k].view(torch.uint8), back[k].view(torch.uint8)), k
