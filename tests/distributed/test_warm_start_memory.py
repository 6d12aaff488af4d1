"""The HF warm start reads each rank's own TP x PP share of the checkpoint, not the model (4 gloo processes).

Run: pytest -q -m distributed tests/distributed/test_warm_start_memory.py
"""
from pathlib import Path

import pytest
import torch

from conftest import run_distributed
from convert_models import make_hf_model
from megatron_rl.convert.safetensors_io import iter_hf_tensors
from megatron_rl.models.hf_arch import architecture_from_hf, read_hf_config
from megatron_rl.plan.memory import largest_param_shard

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("warm_start_worker.py")


def test_each_rank_of_a_tp2_pp2_warm_start_reads_only_its_share(tmp_path):
    make_hf_model("qwen3", tmp_path / "hf", dtype=torch.bfloat16)
    whole = sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(tmp_path / "hf"))
    ranks = run_distributed(WORKER, 4, [str(tmp_path / "hf"), "2", "2"], timeout=300)
    assert ranks[0]["diff"] == 0.0  # the sliced reads assemble exactly the checkpoint's model
    for r in ranks:
        # what a rank materialized is exactly its own parameters (nothing of other ranks' shards) ...
        assert r["read"] == r["share"], r
        # ... about a quarter of the model: a TP2 x PP2 rank holds half the layers, half of each split tensor
        assert r["read"] < 0.35 * whole, (r, whole)
    assert sum(r["read"] for r in ranks) < 1.05 * whole  # only norms (replicated over TP) are read twice
    # `megatron-rl plan` sizes a rank's warm-start peak by its largest parameter slice: the one these ranks hold
    arch = architecture_from_hf(read_hf_config(tmp_path / "hf"))
    assert max(r["largest"] for r in ranks) == largest_param_shard(arch, 2)
