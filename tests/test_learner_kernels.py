"""GPU settings on GPU, CPU settings on CPU: the LearnerKernels decided once from the device facts (injected here)
set megatron's fusions, gradient-accumulation fusion and DDP overlap as megatron's own recipes do on a GPU with
Transformer Engine, and leave all of it off on CPU; overlap on gloo trains bit for bit like no overlap."""
from pathlib import Path

import pytest

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.device import CPU, DeviceFacts, gpu_facts
from megatron_rl.trainer.model import FUSIONS, LearnerKernels, build_transformer_config, learner_kernels

DISTOPT = ParallelConfig(use_distributed_optimizer=True)
H200_IMAGE = gpu_facts((9, 0), te=True, apex_wgrad=True)


def test_gpu_with_te_gets_megatrons_recipe_settings():
    k = learner_kernels(H200_IMAGE, DISTOPT)
    assert k.te_spec and k.fusions and k.gradient_accumulation_fusion and k.overlap_grad_reduce and k.overlap_param_gather
    tc = k.transformer_config_kwargs()
    assert set(tc) == {*FUSIONS, "gradient_accumulation_fusion"} and all(tc.values())
    assert k.ddp_config_kwargs() == {"overlap_grad_reduce": True, "overlap_param_gather": True}


def test_what_each_setting_needs():
    # param-gather overlap needs the distributed optimizer (megatron asserts it)
    assert learner_kernels(H200_IMAGE, ParallelConfig()).ddp_config_kwargs() == {"overlap_grad_reduce": True,
                                                                               "overlap_param_gather": False}
    # megatron's own output layer (ColumnParallelLinear) raises without apex's fused_weight_gradient_mlp_cuda
    assert not learner_kernels(gpu_facts((9, 0), te=True, apex_wgrad=False), DISTOPT).gradient_accumulation_fusion
    # a GPU without TE runs the local spec with the CPU settings; so does the CPU
    for facts in (DeviceFacts(cuda=True, capability=(9, 0), te=False, apex_wgrad=True), CPU):
        k = learner_kernels(facts, DISTOPT)
        assert k == LearnerKernels()
        assert not any(k.transformer_config_kwargs().values()) and not any(k.ddp_config_kwargs().values())


def test_build_transformer_config_passes_the_flags(monkeypatch):
    """The real builder hands the kernels' flags to TransformerConfig (captured: the fused RoPE needs TE to import)."""
    import megatron.core.transformer as mt

    from megatron_rl.models.presets import resolve_architecture

    seen = {}

    class Capture:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(mt, "TransformerConfig", Capture)
    arch = resolve_architecture(ModelConfig(preset="tiny"), 64)
    build_transformer_config(arch, DISTOPT, OptimConfig(), PrecisionConfig(), on_gpu=True,
                             kernels=learner_kernels(H200_IMAGE, DISTOPT))
    assert all(seen[f] for f in (*FUSIONS, "gradient_accumulation_fusion"))
    seen.clear()
    build_transformer_config(arch, DISTOPT, OptimConfig(), PrecisionConfig(), on_gpu=False,
                             kernels=learner_kernels(CPU, DISTOPT))
    assert not any(seen[f] for f in (*FUSIONS, "gradient_accumulation_fusion"))


def test_cpu_learner_keeps_everything_off():
    from megatron_rl.trainer.learner import Learner

    learner = Learner(ModelConfig(preset="tiny"), DISTOPT, OptimConfig(), PrecisionConfig(), vocab_size=64, seed=1)
    assert learner.kernels == LearnerKernels()
    assert not any(getattr(learner.config, f) for f in (*FUSIONS, "gradient_accumulation_fusion"))
    ddp = learner.model[0].ddp_config
    assert not ddp.overlap_grad_reduce and not ddp.overlap_param_gather
    assert learner.config.no_sync_func is None and learner.config.grad_sync_func is None


def test_plan_states_which_apply(capsys):
    from megatron_rl.cli import main

    config = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen3_8b_fp8_grpo.yaml")
    assert main(["plan", config, "--nodes", "2", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "learner kernels on h200 with Transformer Engine" in out
    assert f"fusions ({', '.join(FUSIONS)}): on" in out and "overlap_grad_reduce: on; overlap_param_gather: on" in out
    assert "gradient_accumulation_fusion: on where apex's fused_weight_gradient_mlp_cuda imports" in out
    assert "cross-entropy loss fusion: not applicable" in out
    main(["plan", config, "parallel.use_distributed_optimizer=false", "--nodes", "2", "--gpu", "h200"])
    assert "overlap_grad_reduce: on; overlap_param_gather: off" in capsys.readouterr().out


@pytest.mark.distributed
def test_overlap_trains_exactly_like_no_overlap_on_gloo():
    """DP=2 with the distributed optimizer: megatron's reduce/gather overlap (the GPU setting, forced on here) gives the
    same steps, weights, reference and policy log-probs as no overlap; weights read after a step are the new ones."""
    from conftest import run_distributed

    worker = Path(__file__).with_name("distributed") / "overlap_worker.py"
    on, off = run_distributed(worker, 2, ["--overlap"]), run_distributed(worker, 2)
    assert [r["overlap"] for r in on] == [[True, True]] * 2 and [r["overlap"] for r in off] == [[False, False]] * 2
    assert [r["sync_funcs"] for r in on] == [[True, True]] * 2
    # the optimizer step left the gather to a forward, and reading the weights completed it on every rank
    assert all(r["pending"] == [True, True] and r["raw_changed"] for r in on)
    assert all(r["pending"] == [False, False] and not r["raw_changed"] for r in off)
    for a, b in zip(on, off):
        assert a["steps"] == b["steps"]
        assert a["reference_sum"] == b["reference_sum"] and a["logprobs_sum"] == b["logprobs_sum"]
    assert on[0]["sums"] == off[0]["sums"] and on[0]["sums"] is not None
    # a forward completes the gather: the export after it repeats no full all-gather, and still reads the new weights
    assert all(r["after_forward"] is False and r["forced_syncs"] == 0 for r in on + off)
    assert on[0]["sums3"] == off[0]["sums3"] and on[0]["sums3"] != on[0]["sums"]
