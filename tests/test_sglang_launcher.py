"""SGLang launcher: command lines checked against SGLang's server arguments, GPU assignment, and real start /
health / failure / teardown code paths through a fake `sglang.launch_server` serving the embedded engine."""
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.launcher import LaunchError
from megatron_rl.rollout.sglang_launcher import (
    check_sglang_python, cuda_visible_devices, engine_gpu_groups, launch_sglang_engines, sglang_command,
)

torch.set_num_threads(1)
FIXTURES = Path(__file__).parent / "fixtures"
SGLANG = json.loads((FIXTURES / "sglang_server_flags.json").read_text())
FAKE_SGLANG = str(FIXTURES / "fake_sglang")


def _literal_values(model, name):
    return typing.get_args(model.model_fields[name].annotation)


def test_fixture_is_sglang_server_args():
    assert "server_args.py" in SGLANG["source"]
    for flag in ("--model-path", "--tp-size", "--dp-size", "--quantization", "--kv-cache-dtype", "--port",
                 "--mem-fraction-static", "--enable-deterministic-inference", "--api-key", "--random-seed"):
        assert flag in SGLANG["flags"]
    assert "--no-such-flag" not in SGLANG["flags"]


@pytest.mark.parametrize("quant", _literal_values(PrecisionConfig, "rollout_quantization"))
@pytest.mark.parametrize("kv", _literal_values(PrecisionConfig, "kv_cache_dtype"))
def test_every_emitted_flag_and_value_exists_in_sglang(quant, kv):
    cfg = RolloutConfig(engine="sglang", num_engines=2, engine_tp_size=2, engine_dp_size=2, mem_fraction_static=0.8,
                        deterministic_inference=True, sglang_python="/opt/sglang/bin/python")
    precision = PrecisionConfig(rollout_quantization=quant, kv_cache_dtype=kv)
    cmd = sglang_command(cfg, precision, "/models/m", 30001, 7)
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    flags = [c for c in cmd if c.startswith("--")]
    assert set(flags) <= set(SGLANG["flags"]), set(flags) - set(SGLANG["flags"])
    value = {f: cmd[cmd.index(f) + 1] for f in flags if cmd.index(f) + 1 < len(cmd) and not cmd[cmd.index(f) + 1].startswith("--")}
    assert value["--model-path"] == "/models/m" and value["--port"] == "30001" and value["--random-seed"] == "7"
    assert value["--tp-size"] == "2" and value["--dp-size"] == "2" and value["--mem-fraction-static"] == "0.8"
    assert "--enable-deterministic-inference" in flags
    expected_q = {"none": None, "fp8-blockwise": "fp8", "fp8-channel": "w8a8_fp8"}[quant]
    assert value.get("--quantization") == expected_q
    if expected_q:
        assert expected_q in SGLANG["choices"]["--quantization"]
    assert value.get("--kv-cache-dtype", "auto") == kv
    assert kv in SGLANG["choices"]["--kv-cache-dtype"]


def test_api_key_and_extra_args():
    import types

    cfg = types.SimpleNamespace(**{**RolloutConfig(engine="sglang", sglang_args=["--log-level", "warning"]).model_dump(),
                                   "api_key": "s3cret"})
    cmd = sglang_command(cfg, PrecisionConfig(), "/m", 1, 0)
    assert cmd[cmd.index("--api-key") + 1] == "s3cret" and cmd[-2:] == ["--log-level", "warning"]


def test_gpu_assignment():
    cfg = RolloutConfig(engine="sglang", num_engines=2, engine_tp_size=2)
    assert engine_gpu_groups(cfg, visible_gpus=8, learner_gpus=4) == [[4, 5], [6, 7]]  # after the learner's ranks
    assert engine_gpu_groups(cfg, visible_gpus=8, learner_gpus=0) == [[0, 1], [2, 3]]  # rollout-only node
    dp = RolloutConfig(engine="sglang", num_engines=1, engine_tp_size=2, engine_dp_size=2)
    assert engine_gpu_groups(dp, visible_gpus=4, learner_gpus=0) == [[0, 1, 2, 3]]
    with pytest.raises(LaunchError, match=r"rollout.num_engines=2 x engine_tp_size=2 .* after the learner's 6"):
        engine_gpu_groups(cfg, visible_gpus=8, learner_gpus=6)
    with pytest.raises(LaunchError, match="needs CUDA GPUs and this node has none"):
        engine_gpu_groups(cfg, visible_gpus=0, learner_gpus=0)
    explicit = RolloutConfig(engine="sglang", num_engines=2, engine_tp_size=2, engine_gpus=[7, 6, 1, 0])
    assert engine_gpu_groups(explicit, visible_gpus=8, learner_gpus=4) == [[7, 6], [1, 0]]
    with pytest.raises(LaunchError, match="rollout.engine_gpus"):
        engine_gpu_groups(explicit, visible_gpus=4, learner_gpus=0)
    # a launcher that sees no CUDA device trusts explicit indices (SGLang reports what is wrong with them)
    assert engine_gpu_groups(explicit, visible_gpus=0, learner_gpus=0) == [[7, 6], [1, 0]]


def test_colocated_engines_share_the_learner_gpus_and_release_memory():
    """placement=colocated: SGLang's memory saver + weights CPU backup flags (real server args), the learner's devices."""
    cfg = RolloutConfig(engine="sglang", placement="colocated", num_engines=2, engine_tp_size=4, mem_fraction_static=0.3)
    cmd = sglang_command(cfg, PrecisionConfig(), "/models/m", 30001, 0)
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd
    assert set(c for c in cmd if c.startswith("--")) <= set(SGLANG["flags"])
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.3"
    assert "--enable-memory-saver" not in sglang_command(RolloutConfig(engine="sglang"), PrecisionConfig(), "/m", 1, 0)
    # the engines sit on the devices the learner's 8 local ranks use
    assert engine_gpu_groups(cfg, visible_gpus=8, learner_gpus=8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(LaunchError, match="rollout.placement=colocated: the engines need 8 GPU"):
        engine_gpu_groups(cfg, visible_gpus=4, learner_gpus=4)


def test_cuda_visible_devices_maps_through_an_outer_list(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_visible_devices([2, 3]) == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert cuda_visible_devices([1, 3]) == "5,7"


def test_config_rejects_inconsistent_topology():
    from pydantic import ValidationError

    RolloutConfig(engine="sglang", num_engines=2, engine_tp_size=2, engine_gpus=[3, 2, 1, 0])
    for kwargs, field in [({"engine": "embedded", "engine_tp_size": 2}, "engine_tp_size"),
                          ({"engine": "embedded", "engine_gpus": [0]}, "engine_gpus"),
                          ({"engine": "sglang", "num_engines": 2, "engine_gpus": [0, 0]}, "engine_gpus"),
                          ({"engine": "sglang", "num_engines": 2, "engine_gpus": [0]}, "engine_gpus"),
                          ({"engine": "embedded", "urls": ["http://x:1"]}, "rollout.urls"),
                          ({"engine": "external", "urls": ["http://x:1"], "weight_update_urls": ["x:2"]}, "weight_update_urls"),
                          ({"engine": "sglang", "mem_fraction_static": 1.5}, "mem_fraction_static"),
                          ({"engine": "embedded", "mem_fraction_static": 0.5}, "mem_fraction_static"),
                          ({"engine": "embedded", "sglang_args": ["--x"]}, "sglang_args")]:
        with pytest.raises(ValidationError, match=field):
            RolloutConfig(**kwargs)


def test_sglang_python_must_import_sglang(tmp_path):
    with pytest.raises(LaunchError, match="rollout.sglang_python='/no/such/python'"):
        check_sglang_python("/no/such/python")
    if subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode != 0:
        with pytest.raises(LaunchError, match="cannot import sglang"):
            check_sglang_python(sys.executable)


@pytest.fixture
def fake_sglang_env(monkeypatch):
    """The fake `sglang` package importable by child processes of this test."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKE_SGLANG, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_fake_sglang_start_generate_teardown(tmp_path, fake_sglang_env):
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.engine.testing import make_tiny_model
    from megatron_rl.precision.rollout_formats import load_quantized_model

    make_tiny_model(str(tmp_path / "hf"), seed=5)
    cfg = RolloutConfig(engine="sglang", num_engines=2, sglang_python=sys.executable, startup_timeout_s=120,
                        engine_gpus=[1, 0])
    precision = PrecisionConfig(rollout_quantization="fp8-channel", kv_cache_dtype="fp8_e4m3")
    cluster = launch_sglang_engines(cfg, precision, str(tmp_path / "hf"), log_dir=str(tmp_path / "logs"),
                                    launch_dir=str(tmp_path / "weights"), visible_gpus=2, learner_gpus=0)
    try:
        logs = [Path(e.log_path).read_text() for e in cluster.engines]
        assert "CUDA_VISIBLE_DEVICES=1 " in logs[0] and "CUDA_VISIBLE_DEVICES=0 " in logs[1]
        assert all("quantization=w8a8_fp8 kv_cache_dtype=fp8_e4m3" in log for log in logs)
        assert "--model-path" in cluster.engines[0].cmd
        launch_path = cluster.engines[0].cmd[cluster.engines[0].cmd.index("--model-path") + 1]
        assert launch_path == str(tmp_path / "weights" / "launch_fp8-channel")
        client = RolloutClient(cluster.worker_urls)
        info = client.server_info_sync()
        assert [i["kv_cache_dtype"] for i in info] == ["fp8_e4m3", "fp8_e4m3"]
        # the engines serve the trainer-quantized FP8 weights through an FP8 KV cache
        from megatron_rl.precision.kv_cache import new_kv_cache

        served = load_quantized_model(launch_path)
        out = client.generate_sync([3, 4, 5], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})[0]
        with torch.no_grad():
            logits = served(torch.tensor([[3, 4, 5] + out.output_ids]),
                            cache=new_kv_cache(served.config, "fp8_e4m3"), use_cache=True).logits[0]
        # compared through log-probs of the engine's own tokens: greedy argmax is fragile on a random tiny model,
        # where an FP8 rounding flip (prefill vs one-shot forward) can swap near-tied logits
        reference = torch.log_softmax(logits[2:-1].float(), -1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), reference, atol=0.02), (out.logprobs, reference.tolist())
        # and the comparison is sensitive: the same weights without the FP8 KV cache give other log-probs
        with torch.no_grad():
            plain_logits = served(torch.tensor([[3, 4, 5] + out.output_ids])).logits[0]
        plain_ref = torch.log_softmax(plain_logits[2:-1].float(), -1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert not torch.allclose(plain_ref, reference, atol=1e-4)
        pids = [e.proc.pid for e in cluster.engines]
    finally:
        cluster.stop()
    assert not any(_alive(p) for p in pids)


def test_fake_sglang_failure_to_start_reports_log_tail(tmp_path, fake_sglang_env):
    from megatron_rl.engine.testing import make_tiny_model

    make_tiny_model(str(tmp_path / "hf"), seed=5)
    cfg = RolloutConfig(engine="sglang", sglang_python=sys.executable, startup_timeout_s=60,
                        sglang_args=["--no-such-flag"], engine_gpus=[0])
    with pytest.raises(LaunchError) as info:
        launch_sglang_engines(cfg, PrecisionConfig(), str(tmp_path / "hf"), log_dir=str(tmp_path / "logs"), visible_gpus=1)
    msg = str(info.value)
    assert "engine 0" in msg and "exited with code 2" in msg and "unrecognized arguments: --no-such-flag" in msg


@pytest.mark.slow
def test_engines_cli_prints_urls_and_its_engines_die_with_it(tmp_path, fake_sglang_env):
    """`megatron-rl engines CONFIG` (the interface the Slurm script uses); SIGKILL of it takes the SGLang engine along."""
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.engine.testing import make_tiny_model

    make_tiny_model(str(tmp_path / "hf"), seed=5)
    urls_file = tmp_path / "urls.json"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "engines", str(Path(__file__).parents[1] / "examples/configs/tiny_grpo.yaml"),
           f"run_dir={tmp_path / 'run'}", "rollout.engine=sglang", f"rollout.sglang_python={sys.executable}",
           "rollout.engine_gpus=[0]", f"model.init_checkpoint={tmp_path / 'hf'}", "--urls-file", str(urls_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "ready":
            line = proc.stdout.readline()
            assert line, f"engines exited early: {proc.stderr.read()[-3000:]}"
            lines.append(line.strip())
        engine_url = lines[0].split()[1]
        assert lines[0].startswith("engine http://127.0.0.1:")
        assert json.loads(urls_file.read_text()) == {"generate": [engine_url], "workers": [engine_url]}
        assert RolloutClient(engine_url).health_sync() == {engine_url: True}
        log = next((tmp_path / "run" / "logs").glob("engines_*/engine_0.log")).read_text()
        assert "fake sglang: CUDA_VISIBLE_DEVICES=0 " in log
        proc.kill()  # no cleanup code runs: PR_SET_PDEATHSIG must take the engine down
        proc.wait(10)
        deadline = time.monotonic() + 20
        while RolloutClient(engine_url, max_retries=0).health_sync()[engine_url] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert RolloutClient(engine_url, max_retries=0).health_sync() == {engine_url: False}
    finally:
        if proc.poll() is None:
            proc.kill()
