"""What the project sends to SGLang, built by the project's own code: launcher command lines for every config
combination, and the HTTP bodies its client and weight transports really send (recorded from a live sync). Plus
SGLang's request classes read from its source (io_struct cannot be imported on CPU, see `IoStruct`).

Adding a body to the conformance check is one entry in `SCENARIOS` (a function that drives project code against an
engine; every request it sends is recorded and checked against the class SGLang's HTTP route for that path takes)
and, when it is a new endpoint, its path in `EXPECTED_PATHS`.
"""
from __future__ import annotations

import ast
import itertools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.rollout import RolloutConfig

# ------------------------------------------------------------------------------------------------ (a) launcher argv
ARGV_FIELDS = {"--model-path": "model_path", "--host": "host", "--port": "port", "--tp-size": "tp_size",
               "--dp-size": "dp_size", "--random-seed": "random_seed", "--quantization": "quantization",
               "--kv-cache-dtype": "kv_cache_dtype", "--mem-fraction-static": "mem_fraction_static",
               "--api-key": "api_key"}
"""Flags with a value -> the ServerArgs field they set."""
SWITCH_FIELDS = {"--skip-tokenizer-init": "skip_tokenizer_init", "--enable-deterministic-inference":
                 "enable_deterministic_inference", "--enable-memory-saver": "enable_memory_saver",
                 "--enable-weights-cpu-backup": "enable_weights_cpu_backup"}
"""Switches -> the ServerArgs field they turn on (off when absent)."""
INT_FIELDS = {"port", "tp_size", "dp_size", "random_seed"}


def expected_fields(argv: list[str]) -> dict[str, Any]:
    """The ServerArgs values the launcher means with `argv` (flags after `-m sglang.launch_server`)."""
    expect: dict[str, Any] = {f: (flag in argv) for flag, f in SWITCH_FIELDS.items()}
    for flag, f in ARGV_FIELDS.items():
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            expect[f] = int(value) if f in INT_FIELDS else float(value) if f == "mem_fraction_static" else value
    unknown = [a for a in argv if a.startswith("--") and a not in ARGV_FIELDS and a not in SWITCH_FIELDS]
    assert not unknown, f"the launcher emits flags this check does not map to ServerArgs fields: {unknown}"
    return expect


def launcher_argv_cases() -> tuple[list[dict], int]:
    """Every SGLang command line the launcher builds over the config combinations the config accepts
    (quantization x KV dtype x TP/DP x placement x deterministic x API key), with the fields each should give;
    and how many combinations the config itself refused (so they are never launched)."""
    from pydantic import ValidationError

    from megatron_rl.rollout.sglang_launcher import sglang_command

    quants = typing.get_args(PrecisionConfig.model_fields["rollout_quantization"].annotation)
    kvs = typing.get_args(PrecisionConfig.model_fields["kv_cache_dtype"].annotation)
    cases, refused = [], 0
    for quant, kv, (tp, dp), placement, det, key in itertools.product(
            quants, kvs, [(1, 1), (2, 1), (4, 1), (1, 2)], ["disaggregated", "colocated"], [True, False], [None, "k3y"]):
        try:
            cfg = RolloutConfig(engine="sglang", num_engines=2, engine_tp_size=tp, engine_dp_size=dp, placement=placement,
                                deterministic_inference=det, api_key=key, seed=7, sglang_python="/opt/sglang/bin/python",
                                mem_fraction_static=0.3 if placement == "colocated" else (0.85 if det else None))
        except ValidationError:
            refused += 1
            continue
        precision = PrecisionConfig(rollout_quantization=quant, kv_cache_dtype=kv)
        for i in range(cfg.num_engines):
            argv = sglang_command(cfg, precision, f"/models/{quant}", 30000 + i, cfg.seed + i)
            assert argv[:3] == [cfg.sglang_python, "-m", "sglang.launch_server"]
            cases.append({"id": f"{quant}/{kv}/tp{tp}dp{dp}/{placement}/det{int(det)}/key{int(bool(key))}/engine{i}",
                          "argv": argv[3:], "expect": expected_fields(argv[3:])})
    return cases, refused


def dry_run_argv_cases(configs: list[Path], gpus: int = 8) -> list[dict]:
    """The engine command lines `megatron-rl engines CONFIG --dry-run --gpus 8` prints for the shipped configs."""
    from megatron_rl.config import load_config
    from megatron_rl.rollout.node import dry_run

    cases = []
    for config in configs:
        for k, line in enumerate(dry_run(load_config(config), gpus=gpus)):
            argv = line["argv"]
            if "sglang.launch_server" in argv:
                rest = argv[argv.index("sglang.launch_server") + 1:]
                cases.append({"id": f"{config.stem}/engine{k}", "argv": rest, "expect": expected_fields(rest)})
    return cases


# ------------------------------------------------------------------------------------------------ (b) bodies
@dataclass
class Recorded:
    """One request the project sent."""

    url: str
    method: str
    path: str
    body: Any


@dataclass
class Recorder:
    """Everything the scenarios need: a live engine, its tiny model, and the requests sent to it."""

    engine_url: str
    model_dir: str
    tp2_url: Optional[str] = None
    """An engine of 2 TP ranks (the tensor scenario's target: one payload per rank); the main engine when None."""
    requests: list[Recorded] = field(default_factory=list)
    keep: list = field(default_factory=list)
    """Objects that must outlive the scenarios (the tensor transport's shared memory, read by the probe later)."""
    payloads: list[dict] = field(default_factory=list)
    """Tensor payloads: {"body_index" (the recorded request), "blobs" (unconsumed payloads built the same way),
    "expect": [[name, dtype, shape, sha256], ...]}."""


def _bucket(model_dir: str, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return [(n, t.to(dtype)) for n, t in sorted(tensors.items())]


def _sync(transport, bucket, version) -> None:
    """One sync in the order phases/weights.py drives a transport (rollout/sync/base.py)."""
    transport.begin(version)
    try:
        transport.begin_stage(0, 1, version)
        transport.send_bucket(bucket, final=True)
        transport.end_stage()
        transport.commit(version)
    finally:
        transport.finish()


def scenario_generate(rec: Recorder) -> None:
    """The rollout phase's sampled and greedy requests (phases/rollout.py's own sampling_params)."""
    from megatron_rl.phases.rollout import sampling_params
    from megatron_rl.rollout.client import RolloutClient

    cfg = RolloutConfig(n_samples_per_prompt=2, sampling={"max_new_tokens": 3, "stop_token_ids": [5]})
    client = RolloutClient(rec.engine_url)
    client.generate_batch_sync([[3, 4, 5], [6, 7]], [sampling_params(cfg, 11, 2, 2), sampling_params(cfg, 12, 2, 2)])
    client.generate_batch_sync([[3, 4]], {"n": 1, "temperature": 0.0, "max_new_tokens": 3, "stop_token_ids": [2]},
                               return_logprob=False)


def scenario_disk(rec: Recorder) -> None:
    """transport=disk: pause, update_weights_from_disk, continue."""
    from megatron_rl.rollout.sync import DiskWeightSync

    transport = DiskWeightSync(str(Path(rec.model_dir).parent / "sync"), rec.model_dir, [rec.engine_url])
    _sync(transport, _bucket(rec.model_dir), 1)


def scenario_distributed(rec: Recorder) -> None:
    """transport=distributed: pause, init group, update_weights_from_distributed (+ broadcast), continue, destroy."""
    from megatron_rl.rollout.sync import DistributedWeightSync

    transport = DistributedWeightSync([rec.engine_url], timeout_s=60)
    try:
        _sync(transport, _bucket(rec.model_dir), 2)
    finally:
        transport.close()


def scenario_tensor(rec: Recorder) -> None:
    """transport=tensor: pause, update_weights_from_tensor (shared-memory handles), continue; release / resume."""
    from megatron_rl.rollout.sync import TensorWeightSync

    transport = TensorWeightSync([rec.tp2_url or rec.engine_url], timeout_s=60)
    bucket = _bucket(rec.model_dir)
    start = len(rec.requests)
    _sync(transport, bucket, 3)
    index = next(i for i in range(start, len(rec.requests)) if rec.requests[i].path == "/update_weights_from_tensor")
    from sglang_probe import _describe

    from megatron_rl.rollout.sync.tensor import update_tensor_body

    # A shared-memory handle is consumed once: pickling increments the segment's refcount and each unpickling
    # decrements it (torch's file_system strategy), so the engine's copy cannot be opened again by the probe.
    # The probe gets a body of its own, built by the same builder from the same shared buffer.
    tp = len(rec.requests[index].body["serialized_named_tensors"])
    fresh = update_tensor_body(transport.arena.place(bucket), tp, True, 3)["serialized_named_tensors"]
    rec.payloads.append({"body_index": index, "blobs": fresh, "expect": _describe(bucket)})
    rec.keep.append(transport)  # its shared memory must outlive the probe that opens the handles again
    transport.release_memory(None)
    transport.resume_memory(None)


def scenario_kv_scales(rec: Recorder) -> None:
    """transport=tensor with only the FP8 KV cache's per-layer k/v scales (0-d float32), in a session of its own."""
    from sglang_probe import _describe

    from megatron_rl.precision.kv_scales import scale_tensors
    from megatron_rl.rollout.sync import TensorWeightSync
    from megatron_rl.rollout.sync.tensor import update_tensor_body

    layers = sum(1 for n, _ in _bucket(rec.model_dir) if n.endswith("self_attn.o_proj.weight"))
    bucket = scale_tensors(torch.rand(layers, 2) / 100 + 1e-3, "qwen3", range(layers))
    transport = TensorWeightSync([rec.tp2_url or rec.engine_url], timeout_s=60)
    start = len(rec.requests)
    _sync(transport, bucket, 4)
    index = next(i for i in range(start, len(rec.requests)) if rec.requests[i].path == "/update_weights_from_tensor")
    tp = len(rec.requests[index].body["serialized_named_tensors"])
    fresh = update_tensor_body(transport.arena.place(bucket), tp, True, 4)["serialized_named_tensors"]
    rec.payloads.append({"body_index": index, "blobs": fresh, "expect": _describe(bucket), "scenario": "kv_scales"})
    rec.keep.append(transport)


SCENARIOS: dict[str, Callable[[Recorder], None]] = {
    "generate": scenario_generate,
    "disk": scenario_disk,
    "distributed": scenario_distributed,
    "tensor": scenario_tensor,
    "kv_scales": scenario_kv_scales,
}
"""Project code paths whose requests are recorded and checked (name -> function driving them against the engine)."""
EXPECTED_PATHS = {"/generate", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
                  "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                  "/update_weights_from_tensor", "/release_memory_occupation", "/resume_memory_occupation",
                  "/begin_weight_update", "/end_weight_update"}
"""Every endpoint the scenarios must have sent a body to (a body that silently disappears fails the check)."""


def record(rec: Recorder, monkeypatch) -> Recorder:
    """Run every scenario with a spy on the client's one request method (the real request still goes out)."""
    from megatron_rl.rollout.client import RolloutClient

    real = RolloutClient._request

    async def spy(self, session, url, method, path, body=None, *args, **kwargs):
        if method == "POST":
            rec.requests.append(Recorded(url, method, path, body))
        return await real(self, session, url, method, path, body, *args, **kwargs)

    monkeypatch.setattr(RolloutClient, "_request", spy)
    for name, scenario in SCENARIOS.items():
        scenario(rec)
    return rec


# ------------------------------------------------------------------------------------------------ SGLang source
class _AnyNames(dict):
    """Names for evaluating io_struct annotations: typing's, builtins, everything else Any (its own helper types)."""

    def __missing__(self, key):
        return Any


@dataclass
class RequestClass:
    """One io_struct dataclass: its fields (name -> annotation text) and which must be given."""

    name: str
    fields: dict[str, str]
    required: set[str]


class IoStruct:
    """SGLang's request classes read from managers/io_struct.py (importing it needs torchvision and SGLang's GPU
    stack: schedule_batch -> configs -> multimodal), and the class each HTTP route takes from
    entrypoints/http_server.py (its `obj: Annotated[Cls, Body()]` parameter). FastAPI validates such a body as
    pydantic validates the dataclass: `validate` does the same from the source (unknown names -> Any) and also
    refuses keys the class does not have (SGLang would drop them silently)."""

    def __init__(self, site: Path) -> None:
        srt = site / "sglang" / "srt"
        self.classes = self._classes(ast.parse((srt / "managers" / "io_struct.py").read_text()))
        self.routes = self._routes(ast.parse((srt / "entrypoints" / "http_server.py").read_text()))

    @staticmethod
    def _classes(tree: ast.Module) -> dict[str, RequestClass]:
        defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        out: dict[str, RequestClass] = {}

        def build(name: str) -> Optional[RequestClass]:
            if name in out or name not in defs:
                return out.get(name)
            node = defs[name]
            fields: dict[str, str] = {}
            required: set[str] = set()
            for base in node.bases:
                parent = build(ast.unparse(base))
                if parent:
                    fields.update(parent.fields)
                    required |= parent.required
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    ann = ast.unparse(stmt.annotation)
                    if ann.startswith(("ClassVar", "typing.ClassVar")):
                        continue
                    fields[stmt.target.id] = ann
                    has_default = stmt.value is not None
                    (required.discard if has_default else required.add)(stmt.target.id)
            out[name] = RequestClass(name, fields, required)
            return out[name]

        for name in defs:
            build(name)
        return out

    @staticmethod
    def _routes(tree: ast.Module) -> dict[str, str]:
        routes = {}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            paths = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call) and d.args
                     and isinstance(d.args[0], ast.Constant) and getattr(d.func, "attr", "") in ("post", "api_route")]
            for arg in node.args.args:
                if arg.arg == "obj" and arg.annotation is not None:
                    text = ast.unparse(arg.annotation)
                    cls = text.split("[", 1)[1].split(",", 1)[0] if text.startswith("Annotated[") else text
                    cls = cls.removeprefix("Optional[").rstrip("]")
                    for p in paths:
                        routes[p] = cls
        return routes

    def validate(self, path: str, body: Any) -> list[str]:
        """Problems SGLang's route for `path` has with `body` (empty: accepted)."""
        import pydantic

        if path not in self.routes:
            return [f"SGLang has no POST route {path} taking a request body"]
        cls = self.classes.get(self.routes[path])
        if cls is None:
            return [f"{path}: class {self.routes[path]} not found in io_struct.py"]
        if not isinstance(body, dict):
            return [f"{path}: body is {type(body).__name__}, {cls.name} needs an object"]
        problems = [f"{path}: {cls.name} has no field {k!r} (SGLang would ignore it)" for k in body if k not in cls.fields]
        problems += [f"{path}: {cls.name} needs {k!r}" for k in sorted(cls.required - set(body))]
        names = _AnyNames(vars(typing))
        names.update({"list": list, "dict": dict, "int": int, "float": float, "str": str, "bool": bool, "bytes": bytes,
                      "tuple": tuple, "None": None})
        for key, value in body.items():
            if key not in cls.fields:
                continue
            try:
                annotation = eval(cls.fields[key], {}, names)  # noqa: S307 (annotation text of SGLang's own source)
            except Exception:
                annotation = Any
            try:
                pydantic.TypeAdapter(annotation).validate_python(value)
            except pydantic.ValidationError as exc:
                problems.append(f"{path}: {cls.name}.{key}: {str(exc).splitlines()[0]} ({cls.fields[key]}; got {value!r:.80})")
        return problems
