"""Every accepted value of the rollout topology and rollout-precision fields runs a 1-step job on CPU or is refused
before any work with a message naming the field (values are combined into few runs to keep CI short)."""
import importlib.util
import subprocess
import sys
import typing

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from rl_runs import CONFIG, cli_env, tiny_overrides, train, warm_start

needs_router = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="needs sglang-router")

# value -> the run below that exercises it (a new Literal value fails this test until a run covers it)
COVERED = {
    ("rollout", "engine"): {"embedded": "fp8_channel_router", "external": "external_router",
                            "sglang": "sglang_on_cpu_refused"},
    ("rollout", "router_policy"): {"round_robin": "fp8_channel_router", "cache_aware": "external_router",
                                   "random": "router_policies", "power_of_two": "router_policies"},
    ("precision", "rollout_quantization"): {"none": "external_router", "fp8-blockwise": "tests/test_loop.py main job",
                                            "fp8-channel": "fp8_channel_router"},
    ("precision", "rollout_scale_fmt"): {"auto": "tests/test_loop.py main job (auto is fp32 on CPU engines)",
                                         "fp32": "tests/test_rollout_scale_fmt.py (what auto resolves to on CPU)",
                                         "ue8m0": "fp8_channel_router"},
    ("precision", "kv_cache_dtype"): {"auto": "external_router", "fp8_e4m3": "fp8_channel_router"},
    ("rollout", "placement"): {"disaggregated": "tests/test_loop.py main job",
                               "colocated": "tests/test_overlap_placement.py colocated run (2 steps)"},
    ("rollout", "overlap"): {"none": "tests/test_loop.py main job",
                             "one_step_off": "tests/test_overlap_placement.py one_step_off run (3 steps + resume)"},
}


def test_every_literal_value_is_covered():
    sections = {"rollout": RolloutConfig, "precision": PrecisionConfig}
    for (section, name), runs in COVERED.items():
        values = set(typing.get_args(sections[section].model_fields[name].annotation))
        assert values == set(runs), f"{section}.{name}: values {values} vs covered {set(runs)}"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    return warm_start(tmp_path_factory)


def _one_step(warm, run_dir, *extra):
    rows = train(run_dir, tiny_overrides(warm, "train.steps=1", "train.eval_every=0", *extra))
    assert len(rows) == 1 and rows[0]["rollout/weight_version"] == 0.0
    return rows[0]


@pytest.mark.slow
@needs_router
def test_fp8_channel_router(warm, tmp_path):
    """engine=embedded x2 behind the router (round_robin), fp8-channel weights (power-of-two scales), FP8 KV cache."""
    _one_step(warm, tmp_path / "run", "rollout.num_engines=2", "rollout.use_router=true",
              "rollout.router_policy=round_robin", "precision.rollout_quantization=fp8-channel",
              "precision.rollout_scale_fmt=ue8m0", "precision.kv_cache_dtype=fp8_e4m3")
    from safetensors.torch import load_file

    ckpt = sorted((tmp_path / "run" / "weights").glob("weights_*"))[-1]
    assert '"w8a8_fp8"' in (ckpt / "config.json").read_text()
    scale = load_file(str(ckpt / "model.safetensors"))["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.shape[1] == 1 and bool((torch.frexp(scale)[0] == 0.5).all())  # one power-of-two scale per row
    logs = [p.read_text() for p in (tmp_path / "run" / "logs").glob("engine_*.log")]
    assert len(logs) == 2 and all("kv cache fp8_e4m3" in log for log in logs)


@pytest.mark.slow
@needs_router
def test_external_router(warm, tmp_path):
    """engine=external: urls = a router (cache_aware) started outside the job; weights go to its discovered worker."""
    from megatron_rl.rollout.launcher import launch_engines

    with launch_engines(str(warm / "sft" / "hf"), 1, tokenizer_path=str(warm / "data" / "tokenizer"), use_router=True,
                        router_policy="cache_aware", deterministic=True, log_dir=str(tmp_path / "logs")) as cluster:
        _one_step(warm, tmp_path / "run", "rollout.engine=external", f"rollout.urls=[{cluster.router.url}]",
                  "rollout.num_engines=1", "precision.rollout_quantization=none", "precision.kv_cache_dtype=auto")
        from megatron_rl.rollout.client import RolloutClient

        assert RolloutClient(cluster.worker_urls).weight_versions_sync() == ["1"]


@needs_router
def test_router_policies(tmp_path):
    """The policies the 1-step jobs do not use route generation too (power_of_two needs two workers: checked at load)."""
    from pydantic import ValidationError

    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.launcher import start_router
    from megatron_rl.engine.testing import ThreadedServer, make_tiny_model

    make_tiny_model(str(tmp_path / "m"))
    with ThreadedServer(str(tmp_path / "m")) as a, ThreadedServer(str(tmp_path / "m")) as b:
        for policy in ("random", "power_of_two"):
            router = start_router([a.url, b.url], policy=policy, log_dir=str(tmp_path), startup_timeout_s=60,
                                  name=policy)
            try:
                groups = RolloutClient(router.url).generate_batch_sync([[3, 4]] * 2, {"n": 2, "max_new_tokens": 2})
                assert [len(g) for g in groups] == [2, 2]
            finally:
                router.stop()
    with pytest.raises(ValidationError, match="rollout.router_policy=power_of_two needs rollout.num_engines >= 2"):
        RolloutConfig(use_router=True, router_policy="power_of_two")


def test_sglang_on_cpu_refused(tmp_path):
    """engine=sglang on a machine without CUDA/SGLang: refused before the warm start, naming the field."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(CONFIG), f"run_dir={run_dir}",
                           "rollout.engine=sglang"], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: rollout.engine=sglang" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_dir / "sft").exists()
