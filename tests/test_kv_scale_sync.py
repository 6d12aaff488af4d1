"""Recalibrated FP8 KV cache scales travel with every weight sync (disk, tensor, distributed) into an embedded engine,
which reports them on /get_weights_by_name and stores its cache entries with them; the launch checkpoint declares the
quant method that creates them; an engine whose checkpoint creates none refuses them, as SGLang cannot load them.

Run: pytest -q tests/test_kv_scale_sync.py
"""
from __future__ import annotations

import json
import urllib.request
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.parallel import state
from megatron_rl.precision import kv_scales
from megatron_rl.precision.kv_cache import fake_quantize_kv

warnings.filterwarnings("ignore", category=UserWarning)
VOCAB = 40
RECAL = PrecisionConfig(kv_cache_dtype="fp8_e4m3")
RECAL_FP8 = PrecisionConfig(kv_cache_dtype="fp8_e4m3", rollout_quantization="fp8-blockwise")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A world-1 tiny learner and an HF directory of its weights (the engines' warm start)."""
    from megatron_rl.models.presets import hf_config
    from megatron_rl.phases.weights import export_hf_state_dict
    from megatron_rl.rollout.sync.disk import write_hf_checkpoint
    from megatron_rl.trainer.learner import Learner

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("kvsync")
    lrn = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=VOCAB, seed=9)
    hf_config(lrn.arch).save_pretrained(str(root / "cfg"))
    (root / "hf").mkdir()
    write_hf_checkpoint(export_hf_state_dict(lrn), str(root / "cfg"), str(root / "hf"))
    yield lrn, root
    state.destroy_distributed()


def _post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def scales_for(num_layers: int, shift: float) -> torch.Tensor:
    """Distinct per-layer (k, v) scales."""
    i = torch.arange(num_layers, dtype=torch.float32)[:, None]
    return torch.cat([0.01 * (i + 1), 0.003 * (i + 2)], dim=1) * shift


def _transport(kind: str, url: str, root, hf_dir: str):
    from megatron_rl.rollout.sync import DiskWeightSync, DistributedWeightSync, TensorWeightSync

    if kind == "disk":
        return DiskWeightSync(str(root / f"sync_{kind}"), hf_dir, [url], request_timeout_s=60)
    if kind == "distributed":
        return DistributedWeightSync([url], timeout_s=60)
    return TensorWeightSync([url], timeout_s=60)


def check_engine_serves(srv, lrn, scales: torch.Tensor) -> None:
    """GET /get_weights_by_name answers every layer's scales (also under SGLang's parameter name), and the engine's own
    cache (in-process engines) stores K/V as fake_quantize_kv(x, that layer's scale)."""
    for i in range(lrn.arch.num_layers):
        k_name, v_name = kv_scales.kv_scale_names(lrn.arch.family, i)
        assert _post(srv.url, "/get_weights_by_name", {"name": k_name}) == pytest.approx(float(scales[i, 0]), rel=1e-7)
        assert _post(srv.url, "/get_weights_by_name", {"name": v_name}) == pytest.approx(float(scales[i, 1]), rel=1e-7)
        alias = k_name.replace(".self_attn.", ".self_attn.attn.")
        assert _post(srv.url, "/get_weights_by_name", {"name": alias}) == pytest.approx(float(scales[i, 0]), rel=1e-7)
    if not hasattr(srv, "server"):
        return
    engine = srv.server.engine
    cache = engine._new_cache()
    assert [(l.k_scale, l.v_scale) for l in cache.layers] == [tuple(float(x) for x in s) for s in scales]
    from megatron_rl.precision.kv_cache import new_kv_cache

    ids = torch.tensor([[3, 7, 11, 5, 9, 2]])
    with torch.no_grad():
        plain = engine.model(ids, cache=new_kv_cache(engine.model.config, "auto"), use_cache=True).cache
        engine.model(ids, cache=cache, use_cache=True)
    assert torch.equal(cache.layers[0].values, fake_quantize_kv(plain.layers[0].values, float(scales[0, 1])))
    assert torch.equal(cache.layers[0].keys, fake_quantize_kv(plain.layers[0].keys, float(scales[0, 0])))


@contextmanager
def serving(kind: str, path: str, tmp_path):
    """An engine with an FP8 KV cache: in this process, or (distributed: its process group would share this process's
    registry of group names with the sender's) in a process of its own."""
    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.rollout.launcher import launch_engines

    if kind != "distributed":
        with ThreadedServer(path, kv_cache_dtype="fp8_e4m3", weight_update_timeout_s=60) as srv:
            yield srv
        return
    with launch_engines(path, 1, kv_cache_dtype="fp8_e4m3", log_dir=str(tmp_path / "logs"),
                        engine_args=["--weight-update-timeout-s", "60"]) as cluster:
        yield SimpleNamespace(url=cluster.worker_urls[0])


@pytest.mark.parametrize("precision", [RECAL, RECAL_FP8], ids=["bf16-weights", "fp8-blockwise"])
@pytest.mark.parametrize("kind", ["disk", "tensor", "distributed"])
def test_every_transport_carries_the_scales_to_the_engine(setup, tmp_path, kind, precision):
    from megatron_rl.phases.weights import sync_weights
    from megatron_rl.precision.rollout_formats import read_config, write_launch_checkpoint

    lrn, root = setup
    launch = write_launch_checkpoint(str(root / "hf"), precision, str(tmp_path / "launch"))
    assert kv_scales.creates_kv_scales(read_config(launch))
    with serving(kind, launch, tmp_path) as srv:
        check_engine_serves(srv, lrn, torch.ones(lrn.arch.num_layers, 2))  # before any sync: SGLang's 1.0
        transport = _transport(kind, srv.url, tmp_path, str(root / "cfg"))
        try:
            for version, shift in ((1, 1.0), (2, 0.5)):  # every sync refreshes them
                scales = scales_for(lrn.arch.num_layers, shift)
                sync_weights(lrn, transport, precision, weight_version=version, kv_scales=scales)
                check_engine_serves(srv, lrn, scales)
        finally:
            transport.close()


def test_scales_alone_update_inside_a_session_and_not_outside(setup, tmp_path):
    """A tensor update holding only the scales is accepted inside a weight-update session (the transport opens one);
    the same update outside a session is refused as SGLang 0.5.23 refuses it."""
    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint
    from megatron_rl.rollout.client import RolloutServerError
    from megatron_rl.rollout.sync import TensorWeightSync

    lrn, root = setup
    launch = write_launch_checkpoint(str(root / "hf"), RECAL, str(tmp_path / "launch"))
    scales = scales_for(lrn.arch.num_layers, 2.0)
    named = kv_scales.scale_tensors(scales, lrn.arch.family, range(lrn.arch.num_layers))
    with ThreadedServer(launch, kv_cache_dtype="fp8_e4m3", weight_update_timeout_s=60) as srv:
        outside = TensorWeightSync([srv.url], timeout_s=60)
        outside.begin_stage(0, 1, "x")  # no begin(): no session is opened
        with pytest.raises(RolloutServerError, match=r"begin_weight_update\(\) and end_weight_update\(\)"):
            outside.send_bucket(named, final=True)
        outside.close()
        check_engine_serves(srv, lrn, torch.ones(lrn.arch.num_layers, 2))
        transport = TensorWeightSync([srv.url], timeout_s=60)
        transport.begin("s")
        try:
            transport.begin_stage(0, 1, "s")
            transport.send_bucket(named, final=True)
            transport.end_stage()
            transport.commit("s")
        finally:
            transport.finish()
            transport.close()
        check_engine_serves(srv, lrn, scales)


def test_an_engine_whose_quant_method_creates_no_scales_refuses_them(setup, tmp_path):
    """Served from the plain warm start (no quantization_config: SGLang has no k_scale parameters), the scales are
    refused by name instead of being silently dropped, and the engine keeps serving 1.0."""
    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.phases.weights import sync_weights
    from megatron_rl.rollout.sync import TensorWeightSync

    lrn, root = setup
    with ThreadedServer(str(root / "hf"), kv_cache_dtype="fp8_e4m3", weight_update_timeout_s=60) as srv:
        transport = TensorWeightSync([srv.url], timeout_s=60)
        try:
            with pytest.raises(RuntimeError, match="self_attn.k_scale: the served model has no such tensor"):
                sync_weights(lrn, transport, RECAL, weight_version=1, kv_scales=scales_for(lrn.arch.num_layers, 1.0))
        finally:
            transport.close()
        assert srv.server.engine._new_cache().layers[0].k_scale == 1.0


def test_disk_loaded_checkpoints_carry_scales_and_names_must_fit(setup, tmp_path):
    """A rollout checkpoint exported with scales loads them (rollout_payload, both formats); a Qwen2-style name on a Qwen3
    model is refused by the strict loader."""
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.phases.weights import export_rollout_checkpoint
    from megatron_rl.precision.kv_scales import served_kv_scales

    lrn, root = setup
    scales = scales_for(lrn.arch.num_layers, 3.0)
    for precision in (RECAL, RECAL_FP8):
        out = tmp_path / precision.rollout_quantization
        export_rollout_checkpoint(lrn, precision, str(out), hf_config_dir=str(root / "cfg"), kv_scales=scales)
        assert served_kv_scales(load_hf_model(str(out))) == [tuple(float(x) for x in s) for s in scales]
    from megatron_rl.rollout.sync.disk import write_hf_checkpoint
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "none" / "model.safetensors"))
    tensors["model.layers.0.self_attn.attn.k_scale"] = tensors.pop("model.layers.0.self_attn.k_scale")
    (tmp_path / "renamed").mkdir()
    write_hf_checkpoint(tensors, str(tmp_path / "none"), str(tmp_path / "renamed"))
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.0\.self_attn\.attn\.k_scale"):
        load_hf_model(str(tmp_path / "renamed"))
