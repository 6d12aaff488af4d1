"""precision.rollout_scale_fmt=auto: UE8M0 block scales for Blackwell (sm100) engines, whose SGLang requantizes
fp32 block scales to UE8M0 for DeepGEMM; fp32 elsewhere (CPU numbers unchanged); explicit fp32 there is refused."""
import json

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.device import CPU, gpu_facts
from megatron_rl.precision.rollout_formats import rollout_format

B200, H200 = gpu_facts((10, 0)), gpu_facts((9, 0))
BLOCKWISE = ["precision.rollout_quantization=fp8-blockwise", "rollout.engine=external", "rollout.urls=[http://h:1]"]


def _fmt(overrides, facts):
    return load_config(None, overrides, device_facts=facts).precision.rollout_scale_fmt


def test_auto_resolves_for_the_engines_gpu():
    assert PrecisionConfig().rollout_scale_fmt == "auto"
    assert _fmt(BLOCKWISE, B200) == "ue8m0"
    assert _fmt(BLOCKWISE, H200) == "fp32"
    assert _fmt(BLOCKWISE, CPU) == "fp32"
    # embedded engines run on CPU whatever the learner's GPU; per-channel FP8 (w8a8_fp8) is not requantized
    assert _fmt(["precision.rollout_quantization=fp8-blockwise"], B200) == "fp32"
    assert _fmt(["precision.rollout_quantization=fp8-channel", "rollout.engine=external", "rollout.urls=[http://h:1]"],
                B200) == "fp32"
    # explicit values are kept where they serve the same bits
    assert _fmt([*BLOCKWISE, "precision.rollout_scale_fmt=ue8m0"], H200) == "ue8m0"
    assert _fmt([*BLOCKWISE, "precision.rollout_scale_fmt=fp32"], H200) == "fp32"


def test_explicit_fp32_for_blackwell_engines_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"precision\.rollout_scale_fmt=fp32 .*compute capability 10\.0"):
        load_config(None, [*BLOCKWISE, "precision.rollout_scale_fmt=fp32"], device_facts=B200)


def test_cpu_runs_quantize_exactly_as_before():
    """On CPU auto is fp32: the same quantization_config and the same bits as an explicit fp32."""
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    auto = rollout_format(load_config(None, ["precision.rollout_quantization=fp8-blockwise"], device_facts=CPU).precision)
    fp32 = rollout_format(PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt="fp32"))
    assert auto.quantization_config == fp32.quantization_config and "scale_fmt" not in auto.quantization_config
    name = "model.layers.0.mlp.down_proj.weight"
    a, b = auto.quantize(name, w), fp32.quantize(name, w)
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]) for k in a)


def _served_after_deepgemm_requant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The weight values SGLang serves on sm100 after its UE8M0 requant of a 128x128 block-FP8 weight (an independent
    restatement of sglang 0.5.23 fp8_utils.requant_weight_ue8m0: dequantize to bf16, per-block amax clamped at 1e-4,
    scale = amax / 448 rounded up to a power of two, re-cast to E4M3)."""
    n, k = q.shape
    deq = (q.float().view(n // 128, 128, k // 128, 128) * s[:, None, :, None]).to(torch.bfloat16).float()
    amax = deq.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q2 = (deq / scale).to(torch.float8_e4m3fn)
    return (q2.float() * scale).view(n, k)


def test_ue8m0_scales_survive_the_engines_requant_and_fp32_scales_do_not():
    torch.manual_seed(1)
    w = torch.randn(256, 512) * torch.logspace(-3, 1, 256)[:, None]
    name = "model.layers.0.self_attn.o_proj.weight"
    for fmt, survives in (("ue8m0", True), ("fp32", False)):
        out = rollout_format(PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt=fmt)).quantize(name, w)
        q, s = out[name], out[name + "_scale_inv"]
        sent = (q.float().view(2, 128, 4, 128) * s[:, None, :, None]).view(256, 512)
        assert torch.equal(_served_after_deepgemm_requant(q, s), sent) == survives, fmt


def test_plan_prints_the_choice_and_refuses_fp32_on_b200(capsys):
    from pathlib import Path

    from megatron_rl.cli import main

    config = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen3_8b_fp8_grpo.yaml")
    assert main(["plan", config, "--nodes", "2", "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert "rollout weights fp8-blockwise, ue8m0 scales (precision.rollout_scale_fmt=auto -> ue8m0" in out
    assert main(["plan", config, "--nodes", "2", "--gpu", "h200"]) == 0
    assert "fp8-blockwise, fp32 scales (precision.rollout_scale_fmt=auto -> fp32" in capsys.readouterr().out
    assert main(["plan", config, "precision.rollout_scale_fmt=fp32", "--nodes", "2", "--gpu", "b200"]) == 2
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "rollout-scales-requantized" in ln and "[error" in ln)
    assert "precision.rollout_scale_fmt=fp32" in line and "UE8M0" in line
    assert main(["plan", config, "precision.rollout_scale_fmt=ue8m0", "--nodes", "2", "--gpu", "b200"]) == 0
    capsys.readouterr()


def test_sglang_engines_on_blackwell_refuse_fp32_scales_before_starting(tmp_path):
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.launcher import LaunchError
    from megatron_rl.rollout.sglang_launcher import launch_sglang_engines

    cfg = RolloutConfig(engine="sglang", num_engines=1, sglang_python="/nonexistent/python")
    for fmt in ("fp32", "auto"):  # auto never resolved (built in code) quantizes with fp32 scales
        precision = PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt=fmt)
        with pytest.raises(LaunchError, match=f"precision.rollout_scale_fmt={fmt}"):
            launch_sglang_engines(cfg, precision, str(tmp_path), log_dir=str(tmp_path), engine_capability=(10, 0),
                                  visible_gpus=1, learner_gpus=0)
    # the same engines on Hopper get past this check (and stop at the missing SGLang python)
    with pytest.raises(LaunchError, match="rollout.sglang_python"):
        launch_sglang_engines(cfg, PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt="fp32"),
                              str(tmp_path), log_dir=str(tmp_path), engine_capability=(9, 0), visible_gpus=1, learner_gpus=0)
    assert list(tmp_path.iterdir()) == []


def test_engines_of_another_gpu_model_choose_the_scale_format():
    """Mixed clusters: rollout.engine_gpu, not the learner's GPU, decides auto; it is refused where it cannot differ."""
    assert _fmt([*BLOCKWISE, "rollout.engine_gpu=b200"], H200) == "ue8m0"  # H200 learner, B200 engines
    assert _fmt([*BLOCKWISE, "rollout.engine_gpu=h100"], B200) == "fp32"  # and the other way round
    assert _fmt([*BLOCKWISE, "rollout.engine_gpu=b200"], CPU) == "ue8m0"  # stated: nothing detected
    with pytest.raises(ConfigError, match=r"precision\.rollout_scale_fmt=fp32 .*compute capability 10\.0"):
        load_config(None, [*BLOCKWISE, "rollout.engine_gpu=b200", "precision.rollout_scale_fmt=fp32"], device_facts=H200)
    for bad, why in ((["rollout.engine_gpu=a100"], "no known GPU model"),
                     (["rollout.engine_gpu=b200"], "embedded engines run on CPU"),
                     (["rollout.engine_gpu=b200", "rollout.placement=colocated", "rollout.engine=sglang",
                       "rollout.mem_fraction_static=0.3"], "colocated engines share the learner's GPUs")):
        with pytest.raises(ConfigError, match=r"rollout\.engine_gpu.*" + why):
            load_config(None, bad, device_facts=CPU)


def test_plan_with_engines_of_another_gpu_model(capsys):
    from pathlib import Path

    from megatron_rl.cli import main
    from megatron_rl.plan.hardware import DEVICES

    config = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen3_8b_fp8_grpo.yaml")
    for how in (["--engine-gpu", "b200"], ["rollout.engine_gpu=b200"]):
        assert main(["plan", config, *how, "--nodes", "2", "--gpu", "h100", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["layout"]["device"] == "h100" and plan["layout"]["engine_device"] == "b200"
        assert plan["rollout_scale_fmt"] == "ue8m0"  # chosen for the engines' sm100, not the learner's sm90
        assert plan["engine_memory"]["pool"] == int(0.85 * DEVICES["b200"].memory_bytes)  # the engines' own memory
    assert main(["plan", config, "--engine-gpu", "b200", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 replica(s), on b200 (compute capability 10.0)" in out and "ue8m0 scales" in out
    assert main(["plan", config, "precision.rollout_scale_fmt=fp32", "--engine-gpu", "b200", "--nodes", "2"]) == 2
    assert "rollout-scales-requantized" in capsys.readouterr().out
    # B200 learners with H100 engines keep fp32 scales
    assert main(["plan", config, "--gpu", "b200", "--engine-gpu", "h100", "--nodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rollout_scale_fmt"] == "fp32"


def test_sglang_engines_refuse_a_stated_gpu_model_they_do_not_run_on(tmp_path):
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.launcher import LaunchError
    from megatron_rl.rollout.sglang_launcher import launch_sglang_engines

    cfg = RolloutConfig(engine="sglang", num_engines=1, sglang_python="/nonexistent/python", engine_gpu="b200")
    precision = PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt="ue8m0")
    with pytest.raises(LaunchError, match=r"rollout\.engine_gpu=b200 .*compute capability 9\.0"):
        launch_sglang_engines(cfg, precision, str(tmp_path), log_dir=str(tmp_path), engine_capability=(9, 0),
                              visible_gpus=1, learner_gpus=0)
    with pytest.raises(LaunchError, match="rollout.sglang_python"):  # on the stated GPU it gets past the check
        launch_sglang_engines(cfg, precision, str(tmp_path), log_dir=str(tmp_path), engine_capability=(10, 0),
                              visible_gpus=1, learner_gpus=0)
