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

import pytest

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

    work = tmp_path_factory.mktemp("conformance")
    make_tiny_model(str(work / "hf"), seed=3)
    with pytest.MonkeyPatch.context() as mp:
        # A second engine of 2 TP ranks receives the tensor sync, so one payload per rank is what gets checked.
        with launch_engines(str(work / "hf"), 1, engine_args=["--enable-weights-cpu-backup"],
                            log_dir=str(work / "logs")) as cluster, \
                launch_engines(str(work / "hf"), 1, engine_args=["--enable-weights-cpu-backup", "--tp-size", "2"],
                               log_dir=str(work / "logs_tp2")) as cluster_tp2:
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
