"""`megatron-rl plan`: shipped configs pass for their stated allocation, broken layouts fail with named codes,
and the memory/traffic formulas agree with what the code actually builds and writes."""
import json
import shlex
from pathlib import Path

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.config import load_config
from megatron_rl.plan import PlanOptions, make_plan
from megatron_rl.plan import memory
from megatron_rl.plan.checks import CODES

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
SHIPPED = ["qwen3_8b_fp8_grpo.yaml", "qwen3_8b_bf16_learner_fp8_rollout_grpo.yaml", "qwen3_14b_fp8_dapo.yaml",
           "qwen3_32b_fp8_dapo.yaml"]


def stated_allocation(config: Path) -> dict:
    """The `# plan: --nodes N --gpus-per-node G --gpu X` line each shipped GPU config carries."""
    line = next(line for line in config.read_text().splitlines() if line.startswith("# plan:"))
    args = shlex.split(line.split(":", 1)[1])
    return {"nodes": int(args[args.index("--nodes") + 1]), "gpus_per_node": int(args[args.index("--gpus-per-node") + 1]),
            "gpu": args[args.index("--gpu") + 1], "engine_nodes": int(args[args.index("--engine-nodes") + 1])}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_pass_for_their_stated_allocation(name):
    alloc = stated_allocation(CONFIGS / name)
    engine_nodes = alloc.pop("engine_nodes")
    plan = make_plan(load_config(CONFIGS / name), **alloc, options=PlanOptions(engine_nodes=engine_nodes))
    assert plan.ok, plan.findings
    assert plan.codes("warning") == [], plan.findings
    lay = plan.layout
    assert lay.engine_gpus == lay.engine_nodes * lay.gpus_per_node == engine_nodes * 8, "engine nodes are fully used"
    assert lay.learner_gpus + lay.engine_gpus == alloc["nodes"] * alloc["gpus_per_node"]
    assert plan.learner_memory.total() < 80e9 and plan.step_time.total > 0


def _plan(overrides=(), config="qwen3_8b_fp8_grpo.yaml", nodes=2, gpus=8, gpu="h100", engine_nodes=1, engine_gpu=None):
    return make_plan(load_config(CONFIGS / config, list(overrides), check_layout=False, check_device=False), nodes, gpus, gpu,
                     PlanOptions(engine_nodes=engine_nodes, engine_gpu=engine_gpu))


# colocated engines are this host's (the tensor transport's handles open nowhere else)
COLOCATED = ["rollout.placement=colocated", "rollout.weight_sync.transport=tensor", "rollout.urls=[http://127.0.0.1:30008]"]
BROKEN = {
    "heads-not-divisible-by-tp": dict(overrides=["parallel.tensor_model_parallel_size=3", "parallel.sequence_parallel=false"], nodes=4),
    "query-groups-not-divisible-by-tp": dict(overrides=["parallel.tensor_model_parallel_size=16"], nodes=3),
    "ffn-not-divisible-by-tp": dict(overrides=["model.ffn_hidden_size=12289"]),
    "vocab-not-divisible-by-tp": dict(overrides=["parallel.tensor_model_parallel_size=3", "model.num_attention_heads=48",
                                                 "model.num_query_groups=12"], nodes=4),
    "layers-not-divisible-by-pipeline": dict(overrides=["parallel.pipeline_model_parallel_size=5"], nodes=6),
    "too-few-microbatches-for-vpp": dict(overrides=["parallel.pipeline_model_parallel_size=2",
                                                    "parallel.virtual_pipeline_model_parallel_size=2",
                                                    "train.micro_batch_size=256"]),
    "no-gpus-for-learner": dict(nodes=1),
    "learner-gpus-not-divisible": dict(config="qwen3_32b_fp8_dapo.yaml", nodes=5, engine_nodes=2),
    "engines-exceed-allocation": dict(overrides=["rollout.num_engines=100"]),
    "engine-tp-exceeds-node": dict(overrides=["rollout.num_engines=1", "rollout.engine_tp_size=16"], nodes=3),
    "engine-heads-not-divisible": dict(overrides=["rollout.num_engines=2", "rollout.engine_tp_size=3"]),
    "batch-does-not-split": dict(nodes=4),  # DP 12: 2048 samples do not split into 12 x 4 mini-batches x 2
    "sequence-exceeds-max-seq-len": dict(overrides=["rollout.sampling.max_new_tokens=16000"]),
    "fp8-gemm-misaligned": dict(overrides=["model.ffn_hidden_size=12296"]),
    "learner-out-of-memory": dict(config="qwen3_32b_fp8_dapo.yaml", overrides=["parallel.tensor_model_parallel_size=1",
                                                                                "parallel.pipeline_model_parallel_size=1",
                                                                                "parallel.sequence_parallel=false"], nodes=6, engine_nodes=2),
    "engine-weights-exceed-pool": dict(config="qwen3_32b_fp8_dapo.yaml", overrides=["rollout.engine_tp_size=1",
                                                                                     "precision.rollout_quantization=none", "rollout.mem_fraction_static=0.7"], nodes=6,
                                       engine_nodes=2),
    "kv-cache-below-one-sequence": dict(overrides=["rollout.mem_fraction_static=0.12"]),
    "colocated-out-of-memory": dict(overrides=COLOCATED, nodes=1),
    "colocated-multi-node": dict(overrides=[*COLOCATED, "rollout.mem_fraction_static=0.3"], nodes=2),
    "engine-gpu-colocated": dict(overrides=[*COLOCATED, "rollout.mem_fraction_static=0.3"], nodes=1, engine_gpu="b200"),
    "recipe-unsupported-by-gpu": dict(overrides=["precision.recipe=mxfp8"], gpu="h200"),
    "rollout-scales-requantized": dict(overrides=["precision.rollout_scale_fmt=fp32"], gpu="b200"),
}
WARNINGS = {
    "engine-gpus-idle": dict(overrides=["rollout.num_engines=7"]),
    "kv-cache-limits-concurrency": dict(overrides=["rollout.concurrency=128"]),
    "learner-needs-recompute": dict(overrides=["train.micro_batch_size=4"]),
    "calibration-slower-than-bf16": dict(overrides=["algo.calibration.enabled=true", "algo.calibration.strength=decision"]),
}


@pytest.mark.parametrize("code", sorted(BROKEN))
def test_each_broken_layout_is_named(code):
    plan = _plan(**BROKEN[code])
    assert code in plan.codes("error"), [f"{f.level}:{f.code}" for f in plan.findings]
    assert not plan.ok


@pytest.mark.parametrize("code", sorted(WARNINGS))
def test_wasteful_layouts_warn(code):
    plan = _plan(**WARNINGS[code])
    assert plan.ok and code in plan.codes("warning"), plan.findings


def test_every_code_is_exercised():
    assert set(BROKEN) | set(WARNINGS) | {"embedded-engines", "distributed-optimizer-off", "sequence-padding",
                                            "calibration-cost"} == set(CODES)


def test_cli_exit_status_json_and_report(capsys):
    config = str(CONFIGS / "qwen3_8b_fp8_grpo.yaml")
    assert main(["plan", config, "--nodes", "1"]) == 2
    assert "no-gpus-for-learner" in capsys.readouterr().out
    assert main(["plan", config, "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["layout"]["dp"] == 4 and data["step_time"]["total"] > 0
    assert main(["plan", config, "--nodes", "2", "--gpu", "b200"]) == 0
    assert main(["plan", config, "--nodes", "2", "--engine-nodes", "2"]) == 2  # both nodes to engines: none left
    out = capsys.readouterr().out
    assert "Korthikanti" in out and "Kaplan" in out and "result: OK" in out


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"])
def test_recipe_against_each_gpus_compute_capability(recipe):
    """plan --gpu knows H100/H200 are compute capability 9.0 and B200 10.0, and applies TE's rules to precision.recipe."""
    from megatron_rl.plan.hardware import DEVICES

    assert {g: DEVICES[g].compute_capability for g in ("h100", "h200", "b200")} == {"h100": (9, 0), "h200": (9, 0),
                                                                                    "b200": (10, 0)}
    for gpu in ("h100", "h200", "b200"):
        plan = _plan([f"precision.recipe={recipe}"], gpu=gpu)
        blackwell_only = recipe in ("mxfp8", "nvfp4")
        refused = recipe == "mxfp4" or (blackwell_only and gpu != "b200")
        assert ("recipe-unsupported-by-gpu" in plan.codes("error")) == refused, (gpu, plan.findings)
        if refused:
            message = next(f.message for f in plan.findings if f.code == "recipe-unsupported-by-gpu")
            assert f"precision.recipe={recipe}" in message and gpu in message
            cc = "9.0" if gpu != "b200" else "10.0"
            assert f"has {cc}" in message or f"compute capability {cc}" in message, message
            if blackwell_only:
                assert "10.0" in message and "9.0" in message


def test_cli_refuses_mxfp8_on_hopper_and_names_the_field(capsys):
    config = str(CONFIGS / "qwen3_8b_fp8_grpo.yaml")
    assert main(["plan", config, "precision.recipe=mxfp8", "--nodes", "2", "--gpu", "h200"]) == 2
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "recipe-unsupported-by-gpu" in ln)
    assert "precision.recipe=mxfp8" in line and "compute capability 10.0" in line and "9.0" in line
    assert "h200 (compute capability 9.0)" in out and "FAILED: recipe-unsupported-by-gpu" in out
    assert main(["plan", config, "precision.recipe=mxfp8", "--nodes", "2", "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert "recipe-unsupported-by-gpu" not in out and "b200 (compute capability 10.0)" in out and "result: OK" in out


def test_parameter_counts_match_the_architecture_formula():
    from megatron_rl.models.presets import PRESETS

    for arch in PRESETS.values():
        first, last = memory.stage_params(arch, tp=1, pp=1)
        assert first == last and first.total == arch.num_parameters(), arch.name


def test_weights_gradients_optimizer_follow_megatrons_table():
    """bf16 params + fp32 grads: 18 bytes/param, distributed 6 + 12/d (megatron dist_optimizer.md)."""
    from megatron_rl.models.presets import PRESETS

    arch = PRESETS["qwen3-8b"]
    kw = dict(tp=1, pp=1, vpp=None, cp=1, sp=False, params_dtype="bf16", recipe="none", fp8_params=False, seq_len=1024,
              micro_batch_size=1, num_microbatches=1, logprob_chunk=1024, kl_reference=False, overhead_bytes=0)
    n = arch.num_parameters()
    plain = memory.learner_memory(arch, dp=4, distributed_optimizer=False, **kw)
    dist = memory.learner_memory(arch, dp=4, distributed_optimizer=True, **kw)
    assert plain.weights + plain.gradients + plain.optimizer == 18 * n
    assert dist.weights + dist.gradients + dist.optimizer == 6 * n + 12 * n // 4


def test_activation_formula_scales_as_expected():
    from megatron_rl.models.presets import PRESETS

    arch = PRESETS["qwen3-8b"]
    one = memory.layer_activation_bytes(arch, 4096, 1, tp=1, sp=False, fp8=False)
    assert memory.layer_activation_bytes(arch, 4096, 2, tp=1, sp=False, fp8=False) == 2 * one
    assert memory.layer_activation_bytes(arch, 2048, 2, tp=1, sp=False, fp8=False) == one
    assert memory.layer_activation_bytes(arch, 4096, 1, tp=2, sp=True, fp8=False) == one // 2
    assert memory.layer_activation_bytes(arch, 4096, 1, tp=1, sp=False, fp8=True) < one
    assert memory.inflight_factor(4, None, 16) == 4 and memory.inflight_factor(4, 2, 16) == 4 * (1 + 3 / 8)


def test_weight_sync_bytes_equal_the_checkpoints_actually_written(tmp_path):
    """The plan's served-checkpoint size is the byte count hf-to-fp8 writes (dims multiples of 128) and of the BF16 export."""
    from convert_models import make_hf_model
    from megatron_rl.convert.safetensors_io import iter_hf_tensors
    from megatron_rl.models.hf_arch import architecture_from_hf, read_hf_config
    from megatron_rl.plan.throughput import weight_sync_bytes

    make_hf_model("qwen3", tmp_path / "hf", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256)
    assert main(["convert", "hf-to-fp8", str(tmp_path / "hf"), str(tmp_path / "fp8")]) == 0
    arch = architecture_from_hf(read_hf_config(tmp_path / "hf"))
    size = lambda d: sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(d))  # noqa: E731
    assert weight_sync_bytes(arch, fp8=True) == size(tmp_path / "fp8")
    assert weight_sync_bytes(arch, fp8=False) == size(tmp_path / "hf")


def test_options_change_the_estimate_as_stated():
    cfg = load_config(CONFIGS / "qwen3_8b_fp8_grpo.yaml")
    base = make_plan(cfg, 2, 8, "h100")
    faster = make_plan(cfg, 2, 8, "h100", PlanOptions(mfu=0.8))
    assert faster.step_time.learner == pytest.approx(base.step_time.learner / 2)
    stated = make_plan(cfg, 2, 8, "h100", PlanOptions(decode_tokens_per_s=1000.0))
    assert stated.decode_tokens_per_s == 1000.0
    assert make_plan(cfg, 2, 8, "h200").engine_memory.kv_capacity_tokens > base.engine_memory.kv_capacity_tokens


def test_sglang_default_memory_fraction_follows_its_heuristic():
    """ServerArgs (sglang 0.5.8): H100 80 GB, TP1 -> (M - max(512 + 1.5*8192 + 2*256 + 128, 10240)) / M MiB."""
    m = 80 * 10**9 / 2**20
    assert memory.sglang_default_mem_fraction(80 * 10**9, 1) == round((m - (512 + 12288 + 512 + 128)) / m, 3)
    assert memory.sglang_default_mem_fraction(180 * 10**9, 8) < memory.sglang_default_mem_fraction(180 * 10**9, 1)
    plan = _plan(["rollout.mem_fraction_static=null"])
    assert plan.engine_memory.pool == int(memory.sglang_default_mem_fraction(80 * 10**9, 1) * 80 * 10**9)


def test_colocated_plan_counts_what_stays_beside_the_engines(capsys):
    """Beside colocated engines a learner keeps weights, FP8 copies, reference and overhead, plus gradients and
    optimizer states unless rollout.colocate_offload moves them to host: a pool that fits only with offload says so."""
    overrides = [*COLOCATED, "rollout.mem_fraction_static=0.5"]
    kept = _plan([*overrides, "rollout.colocate_offload=false"], nodes=1)
    offloaded = _plan([*overrides, "rollout.colocate_offload=true"], nodes=1)
    lm = kept.learner_memory
    assert lm.beside_engines(True) == lm.weights + lm.fp8_copies + lm.reference + lm.overhead
    assert lm.beside_engines(False) == lm.beside_engines(True) + lm.gradients + lm.optimizer == lm.resident()
    assert kept.learner_beside_engines == lm.resident() and offloaded.learner_beside_engines == lm.beside_engines(True)
    assert kept.codes() == ["colocated-out-of-memory"] and offloaded.ok
    assert "rollout.colocate_offload=true" in next(f.message for f in kept.findings if f.code == "colocated-out-of-memory")
    assert _plan(COLOCATED + ["rollout.mem_fraction_static=0.3"], nodes=1).learner_beside_engines == lm.resident()
    assert _plan().learner_beside_engines == 0
    from megatron_rl.plan.report import render

    assert "beside the engines" in render(offloaded) and "(rollout.colocate_offload=true)" in render(offloaded)


def test_plan_shows_kv_memory_and_the_concurrency_fp8_kv_buys():
    """With an FP8 cache each token takes half the bytes: the same KV memory holds twice the sequences (floor division
    aside), the report names both counts and the scales the engines get (unit for Qwen3 on SGLang, which drops them)."""
    from megatron_rl.plan.report import render

    bf16 = make_plan(load_config(CONFIGS / "qwen3_8b_fp8_grpo.yaml"), 2, 8, "h100")
    fp8 = make_plan(load_config(CONFIGS / "qwen3_8b_fp8_grpo.yaml", ["precision.kv_cache_dtype=fp8_e4m3"]), 2, 8, "h100")
    a, b = bf16.engine_memory, fp8.engine_memory
    assert a.kv_bytes == b.kv_bytes > 0 and b.kv_bytes_per_token * 2 == a.kv_bytes_per_token
    assert b.sequences == a.sequences_other_dtype and a.sequences == b.sequences_other_dtype
    assert 2 * a.sequences <= b.sequences <= 2 * a.sequences + 1 and a.sequences > 0
    text = render(fp8)
    assert f"{b.sequences:8d} sequences per replica at once; {a.sequences} with BF16 KV" in text
    assert "FP8 E4M3 K/V (scales: unit)" in text and fp8.kv_cache_scales == "unit"
    llama = load_config(CONFIGS / "qwen3_8b_fp8_grpo.yaml", ["precision.kv_cache_dtype=fp8_e4m3", "model.preset=llama3-8b"],
                        check_layout=False)
    assert make_plan(llama, 2, 8, "h100").kv_cache_scales == "recalibrate"


def test_the_high_precision_forwards_follow_the_calibration_rule():
    """The learner estimate counts the high-precision forwards each step runs: under strength=decision pi_old on the
    off-policy rows and each off-policy update's rows, every step (1 step batch at 2 mini-batches and 1 epoch); under
    the default strength=targeted the same for its targeted_fraction of the rows; the shadow of strength=full only on
    its events (/ calibrate_every, x shadow_fraction); none without calibration, and only the events' shadow in high
    precision (nothing to decide); so the decision's learner time is the highest of them."""
    from megatron_rl.plan.throughput import high_precision_forwards

    assert high_precision_forwards(2, 1) == 1.0 and high_precision_forwards(4, 1) == 0.75 + 0.75
    assert high_precision_forwards(2, 2) == 1.0 + 1.5  # with a second epoch every row is trained off-policy
    grpo = ["train.num_minibatches=2", "train.ppo_epochs=1", "algo.calibration.enabled=true"]
    paper = [*grpo, "algo.calibration.strength=full", "algo.calibration.calibrate_every=20"]
    decision, full = _plan([*grpo, "algo.calibration.strength=decision"]), _plan(paper)
    targeted = _plan(grpo)  # the default
    assert targeted.calibration_bytes_per_step == 0 == targeted.calibration_bytes_per_calibration_step  # no solve
    assert decision.calibration_bytes_per_step > 0
    assert targeted.flops.shadow == pytest.approx(0.1 * decision.flops.shadow)
    assert full.step_time.learner < targeted.step_time.learner < decision.step_time.learner
    off, hp = _plan([*grpo, "algo.calibration.enabled=false"]), _plan([*paper, "precision.recipe=none"])
    forward = decision.flops.forward_only  # one forward of the step's tokens (no KL reference in this config)
    assert decision.flops.shadow == pytest.approx(forward)
    assert full.flops.shadow == pytest.approx(forward / 20)  # calibrate_every 20, shadow on every row
    assert off.flops.shadow == 0
    assert hp.flops.shadow == pytest.approx(full.flops.shadow)  # high precision: its events' shadow only, no decision
    assert off.step_time.learner < full.step_time.learner < decision.step_time.learner
    option = _plan([*grpo, "algo.calibration.enabled=false", "algo.policy_loss.clip_decision=high_precision"])
    assert option.flops.shadow == decision.flops.shadow


def test_plan_reports_the_calibration_cost_and_warns_when_it_outruns_bf16():
    """Every plan with high-precision forwards says their seconds and share of the step; the decision rule's forwards
    (at FP8 blockwise's 1.2x) make the learner slower than BF16's, which is a warning naming the cheaper choices; the
    paper's rule every 20 steps costs ~1% and does not warn; vanilla bounds report no cost at all."""
    codes = lambda plan: {f.code: f for f in plan.findings}  # noqa: E731
    decision = codes(_plan(["algo.calibration.enabled=true", "algo.calibration.strength=decision"]))
    assert decision["calibration-cost"].level == "info" and "% of the" in decision["calibration-cost"].message
    warning = decision["calibration-slower-than-bf16"]
    assert warning.level == "warning" and "algo.calibration.enabled=false" in warning.message
    full = codes(_plan(["algo.calibration.enabled=true", "algo.calibration.strength=full", "algo.calibration.calibrate_every=20"]))
    assert "calibration-cost" in full and "calibration-slower-than-bf16" not in full
    targeted = codes(_plan())  # the shipped config: the default rule, +4.5% of the learner, no warning
    assert "calibration-cost" in targeted and "calibration-slower-than-bf16" not in targeted
    assert not {"calibration-cost", "calibration-slower-than-bf16"} & set(codes(_plan(["algo.calibration.enabled=false"])))
    # the split's BF16 learner runs no high-precision forward beyond its own: nothing to report
    split = codes(_plan(config="qwen3_8b_bf16_learner_fp8_rollout_grpo.yaml"))
    assert "calibration-slower-than-bf16" not in split


def test_plan_reports_host_memory_of_the_warm_start_and_of_checkpoint_saves(capsys):
    """Per learner node: the sliced HF warm start holds one parameter slice per rank (halving with TP, far below a
    model per rank), a torch_dist save stages every rank's weights + optimizer shard; `plan` prints both."""
    plan = _plan()
    hm, lm = plan.host_memory, plan.learner_memory
    assert hm.ranks_per_node == 8
    assert hm.checkpoint_save == 8 * (lm.weights + lm.optimizer)
    assert hm.warm_start_whole_model == 8 * memory.served_weight_bytes(_arch(), fp8=False)
    assert hm.warm_start * 8 < hm.warm_start_whole_model  # not even an eighth of a model per rank
    tp4 = _plan(["parallel.tensor_model_parallel_size=4"]).host_memory
    assert tp4.warm_start * 2 == hm.warm_start  # the largest slice (the embedding's rows) halves with TP
    fp32 = _plan(["optim.params_dtype=fp32"]).host_memory
    assert fp32.warm_start == 2 * hm.warm_start  # the read BF16 slice and its merged copy, plus the fp32 cast
    assert main(["plan", str(CONFIGS / "qwen3_8b_fp8_grpo.yaml"), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "learner host memory per node (8 rank(s) a node" in out
    assert f"HF warm start       {hm.warm_start / 2**30:8.2f} GiB" in out
    assert f"checkpoint save     {hm.checkpoint_save / 2**30:8.2f} GiB" in out


def _arch():
    from megatron_rl.models.presets import resolve_architecture

    return resolve_architecture(load_config(CONFIGS / "qwen3_8b_fp8_grpo.yaml").model)
