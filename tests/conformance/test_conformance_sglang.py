"""Conformance with the real, pinned SGLang (constraints/conformance.txt), installed without its GPU dependencies into a
cache of its own and imported only by a subprocess (tests/conformance/sglang_probe.py).

(a) every command line the launcher builds (all config combinations the config accepts, and the shipped configs'
    `megatron-rl engines --dry-run --gpus 8`) parses with SGLang's own prepare_server_args and gives the intended fields;
(b) every body the project sends (recorded from its client and transports driving a live embedded engine) matches
    the request class SGLang's HTTP route takes (io_struct, read from source: it cannot be imported on CPU), and
    the sampling params pass SGLang's own SamplingParams (constructed, normalized, verified);
(c) the tensor transport's payloads decode through SGLang's MultiprocessingSerializer (its SafeUnpickler) to the
    sent tensors bit for bit, one payload per engine TP rank;
(d) the weight-update session rule and the /model_info weight version are in the pinned source.

Run: pytest -q tests/conformance   (first run installs the packages; later runs reuse the cache)
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from conformance_cases import (EXPECTED_PATHS, IoStruct, Recorder, dry_run_argv_cases, launcher_argv_cases, record)
from conformance_packages import ConformanceSetupError, pins, sglang_site

pytestmark = pytest.mark.conformance
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIPPED = sorted((ROOT / "examples" / "configs").glob("qwen3_*.yaml"))


@pytest.fixture(scope="module")
def site() -> Path:
    try:
        return sglang_site()
    except ConformanceSetupError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every request the scenarios sent to a live embedded engine (and the objects their payloads need)."""
    from megatron_rl.rollout.launcher import launch_engines
    from megatron_rl.engine.testing import make_tiny_model

    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint

    work = tmp_path_factory.mktemp("conformance")
    make_tiny_model(str(work / "hf"), seed=3)
    # the tensor scenarios' engine serves an FP8 KV cache from a checkpoint whose quant method creates K/V scales
    kv_launch = write_launch_checkpoint(str(work / "hf"), PrecisionConfig(kv_cache_dtype="fp8_e4m3"), str(work / "launch"))
    with pytest.MonkeyPatch.context() as mp:
        # A second engine of 2 TP ranks receives the tensor sync, so one payload per rank is what gets checked.
        with launch_engines(str(work / "hf"), 1, engine_args=["--enable-weights-cpu-backup"],
                            log_dir=str(work / "logs")) as cluster, \
                launch_engines(kv_launch, 1, engine_args=["--enable-weights-cpu-backup", "--tp-size", "2"],
                               log_dir=str(work / "logs_tp2"), kv_cache_dtype="fp8_e4m3") as cluster_tp2:
            rec = record(Recorder(cluster.worker_urls[0], str(work / "hf"), tp2_url=cluster_tp2.worker_urls[0]), mp)
            yield rec


@pytest.fixture(scope="module")
def probe(site, recorded, tmp_path_factory):
    """One subprocess importing the pinned SGLang runs every case that needs its code."""
    argv, refused = launcher_argv_cases()
    cases = {
        "server_args": argv + dry_run_argv_cases(SHIPPED),
        "sampling_params": [{"id": f"generate{i}", "params": r.body["sampling_params"]}
                            for i, r in enumerate(recorded.requests) if r.path == "/generate"],
        "payloads": [{"id": f"tensor{p['body_index']}",
                      "blobs": p["blobs"]}
                     for p in recorded.payloads],
    }
    work = tmp_path_factory.mktemp("probe")
    (work / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(HERE / "sglang_probe.py"), str(site), str(work / "cases.json"),
                           str(work / "results.json")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads((work / "results.json").read_text())
    results["cases"], results["refused"] = cases, refused
    return results


def _same(a, b) -> bool:
    return math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) or isinstance(b, float) else a == b


def test_the_pinned_sglang_is_the_one_imported(probe, site):
    assert probe["sglang_version"] == pins()["sglang"]
    assert Path(probe["sglang_file"]).is_relative_to(site), "the trainer's environment holds no sglang; the cache's is used"


def test_every_launcher_command_line_parses_with_the_intended_fields(probe):
    cases = {c["id"]: c for c in probe["cases"]["server_args"]}
    results = probe["server_args"]
    assert len(results) == len(cases) >= 2 * (192 - probe["refused"]) and probe["refused"] > 0
    bad = [(r["id"], r["error"]) for r in results if not r["ok"]]
    assert not bad, bad[:3]
    wrong = [(r["id"], f, r["got"][f], v) for r in results for f, v in cases[r["id"]]["expect"].items()
             if not _same(r["got"][f], v)]
    assert not wrong, wrong[:5]
    assert {r["id"].split("/")[0] for r in results} >= {p.stem for p in SHIPPED}, "the shipped configs' dry runs parse too"


def test_every_body_matches_sglangs_request_class(recorded, site):
    io = IoStruct(site)
    sent = {r.path for r in recorded.requests}
    assert EXPECTED_PATHS <= sent, f"scenarios sent nothing to {sorted(EXPECTED_PATHS - sent)}"
    problems = [p for r in recorded.requests for p in io.validate(r.path, r.body)]
    assert not problems, problems


def test_the_source_check_can_fail(site):
    """The body check refuses what SGLang refuses: unknown keys, a missing required field, a wrong type."""
    io = IoStruct(site)
    assert io.validate("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]],
                                                            "group_name": "g"}) == []
    assert any("no field 'bogus'" in p for p in io.validate("/pause_generation", {"mode": "abort", "bogus": 1}))
    assert any("needs 'names'" in p for p in io.validate("/update_weights_from_distributed", {"dtypes": []}))
    assert any("rank_offset" in p for p in io.validate("/init_weights_update_group", {
        "master_address": "h", "master_port": 1, "rank_offset": "one", "world_size": 2}))
    assert io.validate("/no_such_endpoint", {}) != []


def test_sampling_params_pass_sglangs_own_checks(probe):
    results = probe["sampling_params"]
    assert len(results) >= 3 and all(r["ok"] for r in results), [r for r in results if not r["ok"]][:2]


def test_tensor_payloads_decode_through_sglangs_deserializer(probe, recorded):
    """Each engine TP rank's payload, opened by SGLang's MultiprocessingSerializer, holds the sent tensors bit for bit."""
    assert probe["payloads"], "the tensor scenario sent no payload"
    expected = {f"tensor{p['body_index']}": p["expect"] for p in recorded.payloads}
    for r in probe["payloads"]:
        assert r["ok"], r.get("error")
        assert r["got"] and all(rank == expected[r["id"]] for rank in r["got"])
        sent = recorded.requests[int(r["id"].removeprefix("tensor"))].body["serialized_named_tensors"]
        assert len(r["got"]) == len(sent) == 2, "the 2-rank engine gets one payload per TP rank"


def test_session_rule_and_model_info_version_are_in_the_pinned_source(site):
    srt = site / "sglang" / "srt"
    updater = (srt / "managers" / "scheduler_components" / "weight_updater.py").read_text()
    for kind in ("update_weights_from_distributed", "update_weights_from_tensor"):
        assert f"{kind} must run between " in updater and "begin_weight_update() and end_weight_update()" in updater, kind
    io = IoStruct(site)
    assert {"/begin_weight_update", "/end_weight_update"} <= set(io.routes)
    assert "selector" in io.classes[io.routes["/begin_weight_update"]].fields
    import ast

    server = ast.parse((srt / "entrypoints" / "http_server.py").read_text())
    model_info = next(n for n in ast.walk(server) if isinstance(n, ast.AsyncFunctionDef) and n.name == "model_info")
    keys = {k.value for d in ast.walk(model_info) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}
    assert "weight_version" in keys, "GET /model_info reports the weight version in the pinned SGLang"


def test_updates_are_sent_inside_weight_update_sessions(recorded):
    """SGLang 0.5.23 refuses both updates outside /begin_weight_update ... /end_weight_update (checked above)."""
    for i, r in enumerate(recorded.requests):
        if r.path in ("/update_weights_from_distributed", "/update_weights_from_tensor"):
            before = [q.path for q in recorded.requests[:i] if q.url == r.url]
            after = [q.path for q in recorded.requests[i + 1:] if q.url == r.url]
            assert "/begin_weight_update" in before and "/end_weight_update" in after, r.path
            assert before[::-1].index("/begin_weight_update") < (before[::-1] + ["/end_weight_update"]).index(
                "/end_weight_update"), "the session opened before this update is still open"


def test_the_flag_fixture_is_the_pinned_sglangs(site):
    """tests/fixtures/sglang_server_flags.json (what the CPU launcher tests check argv against) is what the extractor
    reads from the pinned SGLang."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from extract_sglang_flags import extract, read_sources

    fixture = json.loads((ROOT / "tests" / "fixtures" / "sglang_server_flags.json").read_text())
    assert extract(read_sources(str(site))) == {"flags": fixture["flags"], "choices": fixture["choices"]}
    assert fixture["source"].startswith(f"sglang-{pins()['sglang']}-")


# ------------------------------------------------------------------------------------------------ FP8 KV cache scales
def _source_function(path: Path, name: str, namespace: dict, cls: Optional[str] = None):
    """Function `name` (of class `cls`) of a pinned SGLang file, compiled alone into `namespace` (its module cannot be
    imported on CPU); returns it."""
    import ast

    tree = ast.parse(path.read_text())
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    import __future__

    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace[name]


def _calls(path: Path, cls: str, method: str) -> set[str]:
    """Names of the functions `cls.method` calls in a pinned SGLang file."""
    import ast

    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return {c.func.id if isinstance(c.func, ast.Name) else ast.unparse(c.func)
            for c in ast.walk(fn) if isinstance(c, ast.Call)}


def _radix_attention_kwargs(path: Path) -> set[str]:
    """Keyword arguments of the `RadixAttention(...)` call building a model file's attention."""
    import ast

    calls = [c for c in ast.walk(ast.parse(path.read_text())) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Name) and c.func.id == "RadixAttention"]
    assert len(calls) == 1, path
    return {k.arg for k in calls[0].keywords}


def test_kv_scale_names_are_the_ones_the_pinned_sglang_loads(site):
    """Run the pinned maybe_remap_kv_scale_name on the names we send: Qwen3/Llama remap `self_attn.k_scale` to the
    RadixAttention parameter (and would drop the parameter's own name); Qwen2's default loader remaps nothing and loads
    the parameter name; Qwen2 and Llama hand their attention a quant_config, Qwen3 does not (its scales are dropped:
    precision/kv_scales.py SGLANG_KV_SCALE_FAMILIES, refused by config/run.py kv_scale_errors)."""
    from megatron_rl.precision.kv_scales import SGLANG_KV_SCALE_FAMILIES, kv_scale_names

    srt = site / "sglang" / "srt"
    remap = _source_function(srt / "model_loader" / "weight_utils.py", "maybe_remap_kv_scale_name",
                             {"Optional": Optional, "print_warning_once": lambda *a, **k: None})
    params = {f"model.layers.{i}.self_attn.attn.{kv}_scale": None for i in range(3) for kv in "kv"}
    models = srt / "models"
    for family, cls, loader in (("qwen3", "Qwen3ForCausalLM", "load_weights"),
                                ("llama", "LlamaForCausalLM", "_legacy_load_weights"),
                                ("qwen2", "Qwen2ForCausalLM", "_legacy_load_weights")):
        remaps = "maybe_remap_kv_scale_name" in _calls(models / f"{family}.py", cls, loader)
        assert remaps == (family != "qwen2"), family
        for i in range(3):
            for name in kv_scale_names(family, i):
                loaded = remap(name, params) if remaps else name
                assert loaded in params, (family, name, loaded)
        quant = "quant_config" in _radix_attention_kwargs(models / f"{family}.py")
        assert quant == (family in SGLANG_KV_SCALE_FAMILIES), f"{family}: RadixAttention quant_config given: {quant}"
    assert remap("model.layers.0.self_attn.attn.k_scale", params) is None, "the parameter's own name is dropped"
    fill = _source_function(srt / "model_loader" / "weight_utils.py", "default_weight_loader", {"torch": torch})
    param = torch.nn.Parameter(torch.tensor(-1.0), requires_grad=False)
    fill(param, torch.tensor(0.125))  # a 0-d float32 tensor fills the 0-d parameter
    assert float(param) == 0.125


def test_the_kv_scales_only_config_creates_scales_and_quantizes_no_linear(site):
    """KV_SCALES_ONLY_CONFIG under the pinned Fp8Config: from_config's required keys are there, every projection
    (fused qkv_proj / gate_up_proj through their shards) is skipped by is_layer_skipped, RadixAttention gets
    Fp8KVCacheMethod (w8a8_fp8 gives it none), and BaseKVCacheMethod's after-load rule is effective_kv_scales."""
    import ast
    from types import MappingProxyType

    from megatron_rl.precision.kv_scales import KV_SCALES_ONLY_CONFIG, effective_kv_scales

    q = site / "sglang" / "srt" / "layers" / "quantization"
    fp8 = ast.parse((q / "fp8.py").read_text())
    fp8_config = next(n for n in fp8.body if isinstance(n, ast.ClassDef) and n.name == "Fp8Config")
    from_config = next(n for n in fp8_config.body if isinstance(n, ast.FunctionDef) and n.name == "from_config")
    required = {ast.literal_eval(c.args[1]).__getitem__(0) for c in ast.walk(from_config) if isinstance(c, ast.Call)
                and ast.unparse(c.func) == "cls.get_from_keys"}
    assert required == {"quant_method", "activation_scheme"} and required <= set(KV_SCALES_ONLY_CONFIG)
    get_quant = next(n for n in fp8_config.body if isinstance(n, ast.FunctionDef) and n.name == "get_quant_method")
    assert "isinstance(layer, RadixAttention)" in ast.unparse(get_quant) and "Fp8KVCacheMethod(self)" in ast.unparse(get_quant)
    w8a8 = ast.unparse(next(n for n in ast.walk(ast.parse((q / "w8a8_fp8.py").read_text()))
                            if isinstance(n, ast.FunctionDef) and n.name == "get_quant_method"))
    assert "RadixAttention" not in w8a8, "w8a8_fp8 now creates KV scales: fp8-channel could recalibrate"
    ns: dict = {"MappingProxyType": MappingProxyType, "Mapping": dict, "List": list}
    _source_function(q / "utils.py", "_module_path_match", ns)
    ns["_FALLBACK_FUSED_SHARDS"] = ast.literal_eval(next(
        n.value for n in ast.parse((q / "utils.py").read_text()).body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_FALLBACK_FUSED_SHARDS"))
    skipped = _source_function(q / "utils.py", "is_layer_skipped", ns)
    ignored = KV_SCALES_ONLY_CONFIG["ignored_layers"]
    for prefix in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert skipped(f"model.layers.7.{prefix}", ignored, {}), prefix
    kv = q / "kv_cache.py"
    assert "layer.k_scale = torch.nn.Parameter(" in kv.read_text() and "layer.k_scale_float = k_scale" in kv.read_text()
    process = _source_function(kv, "process_weights_after_loading", {"is_fp8_fnuz": lambda: False}, cls="BaseKVCacheMethod")
    for k, v in ((0.5, 0.25), (-1.0, -1.0), (0.5, -1.0)):
        layer = SimpleNamespace(k_scale=torch.tensor(k), v_scale=torch.tensor(v))
        process(None, layer)
        assert (layer.k_scale_float, layer.v_scale_float) == effective_kv_scales(k, v), (k, v)
    with pytest.raises(AssertionError):
        process(None, SimpleNamespace(k_scale=torch.tensor(-1.0), v_scale=torch.tensor(2.0)))
    with pytest.raises(ValueError, match="k_scale > 0"):
        effective_kv_scales(-1.0, 2.0)


def test_scale_updates_take_effect_at_the_end_of_a_session(site):
    """A tensor or distributed update loads whatever names it holds (the runner's load_weights: no completeness check),
    and end_weight_update re-runs every quant method's process_weights_after_loading (DefaultModelLoader.postprocess_
    weights), so an update of the scales alone, inside a session, reaches k_scale_float; the scheduler's session rule
    is the only gate (checked above)."""
    srt = site / "sglang" / "srt"
    runner = (srt / "model_executor" / "model_runner_components" / "weight_updater.py").read_text()
    assert "self.get_model().load_weights(named_tensors)" in runner
    assert "DefaultModelLoader.postprocess_weights(" in runner
    calls = _calls(srt / "model_loader" / "loader.py", "DefaultModelLoader", "postprocess_weights")
    assert "quant_method.process_weights_after_loading" in calls


def test_a_scale_only_update_was_sent_in_a_session_and_decodes(recorded, probe):
    """The kv_scales scenario's tensor payload held only 0-d float32 scales; it went out inside a session (checked for
    every update above) and SGLang's deserializer gives them back bit for bit."""
    from megatron_rl.precision.kv_scales import is_kv_scale_name

    kv = [p for p in recorded.payloads if p.get("scenario") == "kv_scales"]
    assert kv and all(is_kv_scale_name(name) and shape == [] and dtype == "float32"
                      for name, dtype, shape, _ in kv[0]["expect"])
    got = {r["id"]: r for r in probe["payloads"]}[f"tensor{kv[0]['body_index']}"]
    assert got["ok"] and all(rank == kv[0]["expect"] for rank in got["got"])
