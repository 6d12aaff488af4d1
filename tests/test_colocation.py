"""The colocated tensor sync's layout (rollout/colocation.py): which learner rank feeds which TP rank of which engine.

A colocated SGLang engine sees only its own GPUs and exits on a CUDA-IPC handle of any other (SGLang's
srt/utils/patch_torch.py: "Invalid device_uuid=..."), so engine TP rank r must get its tensors from the learner
rank on its r-th device. Checked here without processes: the engines' devices are the ones the launchers give
them, the feeds follow, layouts that cannot work are errors naming the fields, embedded colocated engines are
started seeing only their own device, and the poster refuses to send a payload from another device.
The multi-process proof (2 engines, PP=2) is tests/distributed/test_colocated_tensor_sync.py.

Run: pytest -q tests/test_colocation.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.colocation import EngineFeed, assign_feeds, colocated_engines, engine_device_groups
from megatron_rl.rollout.sglang_launcher import engine_gpu_groups


@pytest.mark.parametrize("fields", [dict(num_engines=8), dict(num_engines=2, engine_tp_size=4),
                                    dict(num_engines=2, engine_tp_size=2, engine_gpus=[6, 7, 2, 3])],
                         ids=["8xTP1", "2xTP4", "explicit-gpus"])
def test_engine_devices_are_the_ones_the_sglang_launcher_assigns(fields):
    cfg = RolloutConfig(engine="sglang", placement="colocated", mem_fraction_static=0.3, **fields)
    assert engine_device_groups(cfg) == engine_gpu_groups(cfg, visible_gpus=8, learner_gpus=8)


def test_every_engine_tp_rank_is_fed_by_the_learner_rank_on_its_device():
    # 8 TP-1 engines on 8 learner ranks (qwen3_8b's layout): rank e feeds engine e alone and posts
    eight = assign_feeds([(f"http://e{e}", [f"cpu:{e}"]) for e in range(8)], [f"cpu:{r}" for r in range(8)])
    assert [(eight[r].url, eight[r].tp_rank, eight[r].poster) for r in range(8)] == [(f"http://e{r}", 0, True)
                                                                                      for r in range(8)]
    # TP-4 engines, learner ranks numbered apart from their devices: the feeders follow the devices
    ranks = ["gpu-b", "gpu-a", "gpu-d", "gpu-c"]
    feeds = assign_feeds([("http://x", ["gpu-a", "gpu-b", "gpu-c", "gpu-d"])], ranks)
    assert feeds[1] == EngineFeed("http://x", 0, ("gpu-a", "gpu-b", "gpu-c", "gpu-d"), (1, 0, 3, 2))
    assert [feeds[r].tp_rank for r in range(4)] == [1, 0, 3, 2] and feeds[2].device == "gpu-d"
    # learner ranks on no engine's device feed nothing
    assert sorted(assign_feeds([("http://x", ["cpu:1"])], ["cpu:0", "cpu:1"])) == [1]


def test_layouts_that_cannot_work_are_errors():
    with pytest.raises(ValueError, match=r"engine http://x runs on device cpu:2, where no learner rank runs"):
        assign_feeds([("http://x", ["cpu:2"])], ["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="both list device cpu:0"):
        assign_feeds([("http://x", ["cpu:0"]), ("http://y", ["cpu:0"])], ["cpu:0"])
    with pytest.raises(ValueError, match="learner ranks 0 and 1 both run on device cpu:0"):
        assign_feeds([("http://x", ["cpu:0"])], ["cpu:0", "cpu:0"])
    cfg = RolloutConfig(engine="external", urls=["http://127.0.0.1:1"], placement="colocated", num_engines=2)
    with pytest.raises(ValueError, match=r"1 engine\(s\) receive weights .* rollout.num_engines=2"):
        colocated_engines(cfg, ["http://127.0.0.1:1"])
    assert colocated_engines(cfg, ["http://127.0.0.1:1/", "http://127.0.0.1:2"]) == [
        ("http://127.0.0.1:1", ("cpu:0",)), ("http://127.0.0.1:2", ("cpu:1",))]


def test_sglang_engines_on_gpus_of_their_own_cannot_take_tensor_handles():
    with pytest.raises(ValueError, match="transport=tensor with rollout.engine=sglang needs rollout.placement=colocated"):
        RolloutConfig(engine="sglang", weight_sync={"transport": "tensor"})
    assert RolloutConfig(engine="sglang", placement="colocated", mem_fraction_static=0.3).weight_sync.transport == "tensor"


def test_embedded_colocated_engines_see_only_their_own_device():
    from megatron_rl.rollout.launcher import plan_from_config

    for placement in ("colocated", "disaggregated"):
        plan = plan_from_config(RolloutConfig(placement=placement, num_engines=2), "/m", precision=PrecisionConfig())
        flags = [p.argv[p.argv.index("--visible-devices") + 1] if "--visible-devices" in p.argv else None
                 for p in plan.engines]
        assert flags == (["cpu:0", "cpu:1"] if placement == "colocated" else [None, None])


def test_the_poster_never_sends_a_payload_the_engine_cannot_open():
    """SGLang's scheduler exits on such a handle, so the transport refuses first (the URL is never contacted)."""
    from megatron_rl.rollout.sync import TensorWeightSync
    from megatron_rl.rollout.sync.serialization import serialize_named_tensors

    transport = TensorWeightSync(["http://127.0.0.1:9"], timeout_s=5)
    transport._engine_info = [{"tp_size": 2, "cpu": True, "version": "0.5.23", "sessions": True}]
    transport.set_feed(EngineFeed("http://127.0.0.1:9", 0, ("cpu:0", "cpu:1"), (0, 1)))
    assert transport.feeding()
    blob = serialize_named_tensors([("w", torch.ones(2).share_memory_())], "cpu:3")
    with pytest.raises(RuntimeError, match=r"TP rank 1's payload .* names device cpu:3.*Invalid device_uuid=cpu:3"):
        transport.post_feed([("cpu:0", blob), ("cpu:3", blob)], final=True, weight_version=1)
    with pytest.raises(RuntimeError, match="reports tp_size 2, the colocated layout gives it 2 device"):
        transport.post_feed([("cpu:0", blob)], final=True, weight_version=1)
    device, payload = transport.rank_payload([("w", torch.arange(3.0))])
    assert device == "cpu:0" and payload
    transport.set_worker_urls(["http://127.0.0.1:10"])  # the controller dropped this engine: its feeders skip it
    assert not transport.feeding()
