"""One-shot weight-sync device check (one GPU, a few minutes): the GPU paths the CPU tests mirror.

1. FP8 blockwise rollout quantization on the GPU is bit-identical to the CPU path (trainer and engines
   must quantize from identical bits).
2. The tensor transport's payload for CUDA tensors is SGLang's: CUDA-IPC handles that another process
   opens with torch's reductions and reads the same values from; the embedded (CPU) engine refuses them
   with a clear message.
3. CUDA tensors pushed into an embedded CPU engine (distributed over gloo, tensor over shared memory)
   arrive bit-identical: the transports copy to host memory when a receiver reports a CPU device.
4. A world-1 GPU Learner's streaming export equals its whole-model export (gather_full_state_dict + to_hf).

5. With two or more GPUs: an NCCL weight-update group broadcasts fp32, bf16 and float8 tensors (one
   device cannot host both ends of an NCCL group, so a one-GPU machine reports this check as [SKIP] with the reason).

Run:  python tests/gpu/weight_sync_device_check.py   (one line per check, a JSON summary; exit 1 on failure)
      python tests/gpu/weight_sync_device_check.py --device cpu   (the same code paths with CPU tensors, in CI via
      tests/gpu/run_all.sh --cpu; the CUDA-only check 2b does not run there, 5 is a SKIP)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

RESULTS: list[dict] = []
DEVICE = "cuda"


def check(name: str, ok: bool, **detail) -> None:
    """Record and print one check."""
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {json.dumps(detail, default=str)}", flush=True)


def skip(name: str, reason: str) -> None:
    """Record and print a check that cannot run here, with why (never a PASS)."""
    RESULTS.append({"check": name, "ok": True, "skipped": reason})
    print(f"[SKIP] {name} {reason}", flush=True)


def guarded(fn):
    """Run one section; an exception is a failed check, not an aborted script."""
    try:
        fn()
    except Exception as e:  # reported, then the next section runs
        traceback.print_exc()
        check(fn.__name__, False, error=repr(e))


def fp8_quantization_matches_cpu() -> None:
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.phases.weights import export_format

    for scale_fmt in ("fp32", "ue8m0"):
        convert = export_format(PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt=scale_fmt)).convert
        g = torch.Generator().manual_seed(0)
        w = torch.randn(1000, 700, generator=g) * torch.logspace(-4, 2, 1000).unsqueeze(1)
        cpu = convert("model.layers.0.mlp.up_proj.weight", w)
        gpu = convert("model.layers.0.mlp.up_proj.weight", w.to(DEVICE))
        same = all(a[0] == b[0] and b[1].device.type == DEVICE and torch.equal(a[1].view(torch.uint8) if a[1].element_size() == 1 else a[1],
                                                                 (b[1].view(torch.uint8) if b[1].element_size() == 1 else b[1]).cpu())
                   for a, b in zip(cpu, gpu))
        check(f"fp8_blockwise_gpu_equals_cpu[{scale_fmt}]", same and len(cpu) == 2)


def cuda_ipc_payload_opens_in_another_process() -> None:
    from megatron_rl.engine.tensor_payload import deserialize_named_tensors
    from megatron_rl.rollout.sync.serialization import serialize_named_tensors

    t = torch.arange(12, dtype=torch.float32, device=DEVICE).reshape(3, 4) * 0.5
    blob = serialize_named_tensors([("w", t)])
    # the payload names the GPU by UUID: the reader maps it to its own index first, as every SGLang engine does
    # (SGLang's monkey_patch_torch_reductions, or the project's equivalent where sglang does not import)
    reader = textwrap.dedent("""
        import base64, io, sys, torch
        from multiprocessing.reduction import ForkingPickler
        import torch.multiprocessing.reductions
        from megatron_rl.rollout.sync.serialization import patch_torch_reductions
        patched_by = patch_torch_reductions()
        named = ForkingPickler.loads(base64.b64decode(sys.stdin.read()))
        name, t = named[0]
        print(name, t.device.type, patched_by, t.cpu().flatten().tolist())
    """)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", reader], input=blob, capture_output=True, text=True, timeout=300,
                          env=env)
    out = proc.stdout.split(maxsplit=3)
    ok = proc.returncode == 0 and out[:2] == ["w", DEVICE] and json.loads(out[3]) == t.cpu().flatten().tolist()
    check(f"{'cuda_ipc' if DEVICE == 'cuda' else 'shared_memory'}_handle_read_by_other_process", ok,
          patched_by=out[2] if len(out) > 2 else None, stderr=proc.stderr[-500:])
    if DEVICE != "cuda":
        return
    try:
        deserialize_named_tensors(blob)
        check("embedded_engine_refuses_cuda_ipc", False)
    except ValueError as exc:
        check("embedded_engine_refuses_cuda_ipc", "CUDA" in str(exc), message=str(exc))


def cuda_tensors_into_cpu_engine() -> None:
    import urllib.request

    from megatron_rl.rollout.launcher import launch_engines
    from megatron_rl.rollout.sync import DistributedWeightSync, TensorWeightSync
    from megatron_rl.engine.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(f"{tmp}/base", seed=0)
        target = make_tiny_model(f"{tmp}/target", seed=4)
        items = [(n, t.to(DEVICE)) for n, t in target.state_dict().items() if n != "lm_head.weight"]
        cluster = launch_engines(f"{tmp}/base", 1, log_dir=f"{tmp}/logs")
        try:
            for cls in (DistributedWeightSync, TensorWeightSync):
                tr = cls(cluster.worker_urls, bucket_mb=0.02, timeout_s=60)
                tr.begin("g")
                tr.begin_stage(0, 1, "g")
                for k in range(0, len(items), 5):
                    tr.send_bucket(items[k:k + 5], final=k + 5 >= len(items))
                tr.finish()
                ok = True
                for n, t in items:
                    req = urllib.request.Request(cluster.worker_urls[0] + "/get_weights_by_name",
                                                 data=json.dumps({"name": n, "truncate_size": 1 << 20}).encode(),
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        ok &= torch.equal(torch.tensor(json.loads(resp.read())), t.cpu())
                tr.close()
                check(f"{DEVICE}_tensors_into_cpu_engine[{cls.name}]", ok)
        finally:
            cluster.stop()


def gpu_learner_streaming_export() -> None:
    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.models import hf_mapping
    from megatron_rl.parallel import state
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.trainer.weight_export import StreamingExporter

    learner = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=64, seed=1)
    reference = hf_mapping.to_hf(learner.gather_full_state_dict(), learner.arch)
    got = {n: t for b in StreamingExporter(learner).buckets(1 << 16) for n, t in b}
    devices = {t.device.type for t in got.values()}
    ok = got.keys() == reference.keys() and all(torch.equal(got[n].cpu(), reference[n]) for n in reference)
    check(f"{DEVICE}_learner_streaming_export_equals_whole_model", ok and devices <= {DEVICE}, devices=sorted(devices))
    state.destroy_distributed()


def nccl_broadcast_two_gpus() -> None:
    if DEVICE != "cuda":
        skip("nccl_broadcast_two_gpus", "--device cpu: an NCCL group needs two CUDA devices")
        return
    if torch.cuda.device_count() < 2:
        skip("nccl_broadcast_two_gpus", f"an NCCL group needs two devices; {torch.cuda.device_count()} visible")
        return
    code = textwrap.dedent("""
        import sys, torch
        from megatron_rl.parallel.weight_group import init_weight_update_group, broadcast_from_rank0
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        torch.cuda.set_device(rank)
        pg = init_weight_update_group("nccl", "127.0.0.1", port, rank, 2, "gpu_check", 120)
        ts = [torch.arange(10, dtype=dt, device="cuda") * (rank == 0) for dt in (torch.float32, torch.bfloat16)]
        ts.append((torch.arange(10, device="cuda", dtype=torch.float32) * (rank == 0)).to(torch.float8_e4m3fn))
        broadcast_from_rank0(ts, pg)
        torch.cuda.synchronize()
        print(all(torch.equal(t.float().cpu(), torch.arange(10.).to(t.dtype).float()) for t in ts))
    """)
    from megatron_rl.parallel.weight_group import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port)], stdout=subprocess.PIPE, text=True, env=env)
             for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    check("nccl_broadcast_two_gpus", all(o.endswith("True") for o in outs), outputs=outs)


def main(argv: list[str]) -> int:
    """Run every section, print a JSON summary, exit 1 on any failure."""
    global DEVICE
    if argv[:2] == ["--device", "cpu"]:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("needs CUDA (or --device cpu)")
        return 1
    sections = [fp8_quantization_matches_cpu, cuda_ipc_payload_opens_in_another_process, cuda_tensors_into_cpu_engine,
                gpu_learner_streaming_export, nccl_broadcast_two_gpus]
    for fn in sections:
        guarded(fn)
    print(json.dumps({"passed": sum(r["ok"] and "skipped" not in r for r in RESULTS),
                      "failed": sum(not r["ok"] for r in RESULTS), "skipped": [r["check"] for r in RESULTS if "skipped" in r]}))
    return 0 if all(r["ok"] for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
