"""Streaming weight export (single process): the same tensors as the whole-model path, bucketed, FP8 bit-equal,
non-finite weights refused before any transport call, a streamed checkpoint engines load, and a bf16 learner's
exports in bf16 (half the bytes).

Run: pytest -q tests/test_weight_export.py
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.models import hf_mapping
from megatron_rl.parallel import state
from megatron_rl.phases import weights
from megatron_rl.precision.hf_fp8 import quantize_state_dict
from megatron_rl.trainer.weight_export import NonFiniteWeightsError, StreamingExporter, nbytes, with_last

torch.set_num_threads(1)
VOCAB = 50


@pytest.fixture(scope="module")
def learner():
    from megatron_rl.trainer.learner import Learner

    lrn = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=VOCAB, seed=5)
    yield lrn
    state.destroy_distributed()


class Recorder:
    """A transport that keeps what it is given."""

    def __init__(self, bucket_bytes: int = 1 << 30):
        self.bucket_bytes = bucket_bytes
        self.calls: list = []
        self.buckets: list = []

    def begin(self, v):
        self.calls.append(("begin", v))

    def begin_stage(self, stage, num_stages, v):
        self.calls.append(("begin_stage", stage, num_stages, v))

    def send_bucket(self, bucket, final):
        self.buckets.append(([(n, t.clone()) for n, t in bucket], final))

    def end_stage(self):
        self.calls.append(("end_stage",))

    def commit(self, v, updates):
        self.calls.append(("commit", v, updates))

    def finish(self):
        self.calls.append(("finish",))


def test_buckets_hold_exactly_the_hf_state_dict(learner):
    reference = hf_mapping.to_hf(learner.gather_full_state_dict(), learner.arch)
    cap = 40_000  # bytes: the tiny model (vocab 64 x 64 embedding = 16 KB) splits into several buckets
    buckets = list(StreamingExporter(learner).buckets(cap))
    assert len(buckets) > 3
    owner = {n: mg for mg, tensors in StreamingExporter(learner).hf_tensors() for n, _ in tensors}
    got = {}
    for b in buckets:
        # a bucket only exceeds the cap when one parameter's tensors alone do
        assert nbytes(b) <= cap or len({owner[n] for n, _ in b}) == 1
        for n, t in b:
            assert n not in got
            got[n] = t
    assert got.keys() == reference.keys()
    for n, t in reference.items():
        assert got[n].dtype == torch.float32 and torch.equal(got[n], t), n
    assert [last for _, last in with_last(iter(buckets))] == [False] * (len(buckets) - 1) + [True]


def test_fp8_format_is_bit_equal_to_whole_model_quantization(learner):
    precision = PrecisionConfig(rollout_quantization="fp8-blockwise")
    fmt = weights.export_format(precision)
    reference = quantize_state_dict(hf_mapping.to_hf(learner.gather_full_state_dict(), learner.arch))
    got = {n: t for b in StreamingExporter(learner).buckets(1 << 20, fmt.convert) for n, t in b}
    assert got.keys() == reference.keys()
    assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
    for n, t in reference.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
    assert fmt.config_updates["quantization_config"]["weight_block_size"] == [128, 128]


def test_sync_calls_the_transport_in_protocol_order(learner):
    rec = Recorder(bucket_bytes=30_000)
    metrics = weights.sync_weights(learner, rec, PrecisionConfig(), weight_version=7)
    assert rec.calls[0] == ("begin", 7) and rec.calls[1] == ("begin_stage", 0, 1, 7)
    assert [c[0] for c in rec.calls[2:]] == ["end_stage", "commit", "finish"]
    finals = [f for _, f in rec.buckets]
    assert finals == [False] * (len(finals) - 1) + [True]
    assert metrics["sync/bytes"] == sum(nbytes(b) for b, _ in rec.buckets) and metrics["sync/buckets"] == len(finals)


def test_non_finite_weights_are_refused_before_any_transport_call(learner):
    from megatron_rl.trainer.model import unwrap

    param = dict(unwrap(learner.model[0]).named_parameters())["decoder.layers.1.mlp.linear_fc1.weight"]
    saved = param.detach().clone()
    try:
        with torch.no_grad():
            param[3, 2] = math.nan
        rec = Recorder()
        with pytest.raises(NonFiniteWeightsError, match=r"decoder\.layers\.1\.mlp\.linear_fc1\.weight.*gate_proj.*up_proj"):
            weights.sync_weights(learner, rec, PrecisionConfig(), weight_version=1)
        assert rec.calls == [] and rec.buckets == []
        with torch.no_grad():
            param[3, 2] = math.inf
        with pytest.raises(NonFiniteWeightsError):
            weights.sync_weights(learner, rec, PrecisionConfig(), weight_version=1)
    finally:
        with torch.no_grad():
            param.copy_(saved)


def test_failed_send_still_finishes_and_reports(learner):
    class Failing(Recorder):
        def send_bucket(self, bucket, final):
            raise ConnectionError("engine went away")

    rec = Failing(bucket_bytes=30_000)
    with pytest.raises(RuntimeError, match="rank 0: ConnectionError: engine went away"):
        weights.sync_weights(learner, rec, PrecisionConfig(), weight_version=2)
    assert rec.calls[-1] == ("finish",) and not any(c[0] == "commit" for c in rec.calls)


def test_streamed_checkpoint_loads_as_the_learner_model(learner, tmp_path):
    from megatron_rl.models.presets import hf_config
    from megatron_rl.engine.generation import load_hf_model

    def prepare(staging):
        hf_config(learner.arch).save_pretrained(staging)

    out = weights.export_rollout_checkpoint(learner, PrecisionConfig(), str(tmp_path / "ckpt"), bucket_mb=0.03,
                                            prepare=prepare)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    reference = hf_mapping.to_hf(learner.gather_full_state_dict(), learner.arch)
    assert set(index["weight_map"]) == set(reference)
    model = load_hf_model(out)
    for n, t in reference.items():
        assert torch.equal(model.state_dict()[n], t), n


def test_a_bf16_learner_sends_bf16_half_the_bytes_and_engines_take_it(learner, tmp_path):
    """Unquantized exports keep the parameter dtype (bf16 on GPU): half the bytes of float32; FP8 weights are the
    same bits as quantizing the float32 values; the embedded engine serves what a bf16 learner sends (tensor and disk)."""
    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.models.presets import hf_config
    from megatron_rl.rollout.sync import DiskWeightSync, TensorWeightSync
    from megatron_rl.trainer.learner import Learner

    bf16 = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(params_dtype="bf16"), PrecisionConfig(),
                   vocab_size=VOCAB, seed=5)
    sent = {}
    for name, lrn in (("fp32", learner), ("bf16", bf16)):
        rec = Recorder(bucket_bytes=30_000)
        sent[name] = (weights.sync_weights(lrn, rec, PrecisionConfig(), weight_version=1)["sync/bytes"], rec.buckets)
    assert sent["bf16"][0] * 2 == sent["fp32"][0]
    assert all(t.dtype == torch.bfloat16 for b, _ in sent["bf16"][1] for _, t in b)
    reference = hf_mapping.to_hf(bf16.gather_full_state_dict(), bf16.arch)
    fp8 = {n: t for b in StreamingExporter(bf16).buckets(1 << 20, weights.export_format(
        PrecisionConfig(rollout_quantization="fp8-blockwise")).convert) for n, t in b}
    expected = quantize_state_dict({n: t.float() for n, t in reference.items()})
    for n, t in expected.items():  # quantized from the exact bf16 values; the rest stays bf16
        want = t if t.dtype != torch.float32 or n.endswith("_scale_inv") else t.to(torch.bfloat16)
        assert fp8[n].dtype == want.dtype and torch.equal(fp8[n].view(torch.uint8), want.view(torch.uint8)), n
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config(bf16.arch)).save_pretrained(str(tmp_path / "hf"))
    buckets = [b for b, _ in sent["bf16"][1]]
    with ThreadedServer(str(tmp_path / "hf")) as srv:
        for transport in (TensorWeightSync([srv.url], timeout_s=30),
                          DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "hf"), [srv.url])):
            transport.begin("b")
            transport.begin_stage(0, 1, "b")
            for k, b in enumerate(buckets):
                transport.send_bucket(b, final=k == len(buckets) - 1)
            transport.end_stage()
            transport.commit("b", {})
            transport.finish()
            transport.close()
            served = srv.server.engine.model.state_dict()
            for n, t in reference.items():
                assert torch.equal(served[n], t.float()), (transport.name, n)
            srv.server.engine.load_weights(str(tmp_path / "hf"))  # back to the other weights for the next transport
