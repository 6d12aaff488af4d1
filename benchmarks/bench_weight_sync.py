"""Weight-sync throughput per transport, streaming-export memory, and a projection to 8B/32B models.

Part 1 (side by side, one run): for each model (the tiny preset and a ~0.5B model built in memory:
qwen3-0.6b's shape with a 32768-token vocabulary, 0.44B parameters), one embedded engine subprocess
serves it and the same tensors are pushed through each transport (disk, distributed over gloo, tensor
over shared memory), bucketed as the learner's export buckets them; seconds and GB/s are end to end
(from the first byte until the engine answered the last bucket, weights swapped). Beside each, the
seconds the engine spent inside those same syncs on refusing non-finite weights (its NaN/inf check of
every received tensor, /server_info "weight_finite_check_s") and their share of the sync.

Part 2: peak extra RSS of exporting a learner's weights in the FP8-blockwise rollout format, in a fresh
process per case: the streaming export (trainer/weight_export.py, buckets dropped as a transport would)
vs the whole-model path (gather_full_state_dict + to_hf + quantize), for two model sizes 4x apart.
Streaming stays near a bucket (plus one parameter's quantization temporaries).

Part 3: a projection for qwen3-8b / qwen3-32b FP8 rollout payloads: t = buckets * c + bytes / bandwidth,
with c (per-bucket overhead: HTTP round trip, request parsing, swap) and the CPU bandwidth fitted to the
distributed/gloo measurements of part 1, and bandwidth replaced by NVLink / InfiniBand link rates. A
model, not a measurement.

Run: python benchmarks/bench_weight_sync.py [--sizes tiny 0.5b] [--bucket-mb 64] [--reps 2] [--skip-rss]
(~4 minutes on 2 cores with the defaults; needs ~6 GB of free memory for the 0.5B model).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# glibc keeps freed heap pages of varied-size allocations, so RSS would also count memory already
# released; serving every allocation >= 64 KB by mmap makes RSS track live tensors instead.
RSS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
LINKS = {"NVLink (H100/H200, ~450 GB/s per direction)": 450e9, "InfiniBand NDR 400 Gb/s (~50 GB/s)": 50e9}


def bench_arch(size: str):
    """The megatron Architecture of a benchmark size."""
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.models.presets import resolve_architecture

    if size == "tiny":
        return resolve_architecture(ModelConfig(preset="tiny"), 256)
    if size == "0.5b":
        return dataclasses.replace(resolve_architecture(ModelConfig(preset="qwen3-0.6b"), 32768), tie_word_embeddings=False)
    raise ValueError(f"unknown size {size!r} (tiny | 0.5b)")


def buckets_of(items: list, bucket_bytes: int) -> list[list]:
    """Consecutive tensors grouped as the exporter groups them (a larger tensor travels alone)."""
    out, cur, size = [], [], 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        out.append(cur)
    return out


def push(transport, buckets: list[list], version: str) -> None:
    """One sync: pause, every bucket (the last names the version), continue."""
    transport.begin(version)
    transport.begin_stage(0, 1, version)
    for k, b in enumerate(buckets):
        transport.send_bucket(b, final=k == len(buckets) - 1)
    transport.end_stage()
    transport.commit(version, {})
    transport.finish()


def measure_transports(size: str, bucket_mb: float, reps: int, work: Path) -> dict:
    """Seconds and GB/s of each transport for one model size."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.presets import hf_config
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.launcher import launch_engines
    from megatron_rl.rollout.sync import DiskWeightSync, DistributedWeightSync, TensorWeightSync

    arch = bench_arch(size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    model_dir = work / f"{size}_model"
    model.save_pretrained(str(model_dir))
    items = [(n, t.detach()) for n, t in model.state_dict().items() if not (arch.tie_word_embeddings and n == "lm_head.weight")]
    del model
    total = sum(t.numel() * t.element_size() for _, t in items)
    buckets = buckets_of(items, int(bucket_mb * 1024 * 1024))
    cluster = launch_engines(str(model_dir), 1, log_dir=str(work / "logs"), startup_timeout_s=600,
                             engine_args=["--weight-update-timeout-s", "600"])
    url = cluster.worker_urls
    results = {"params": sum(t.numel() for _, t in items), "bytes": total, "buckets": len(buckets)}
    try:
        transports = {
            "disk": DiskWeightSync(str(work / f"{size}_sync"), str(model_dir), url, keep_last=1, bucket_mb=bucket_mb,
                                   request_timeout_s=600),
            "distributed/gloo": DistributedWeightSync(url, bucket_mb=bucket_mb, timeout_s=600),
            "tensor/shm": TensorWeightSync(url, bucket_mb=bucket_mb, timeout_s=600),
        }
        times = {name: [] for name in transports}
        checks = {name: [] for name in transports}
        engine = RolloutClient(url)

        def check_seconds() -> float:
            return float(engine.server_info_sync()[0]["weight_finite_check_s"])

        for rep in range(reps):  # round-robin, so load drift hits every transport alike
            for name, tr in transports.items():
                c0 = check_seconds()
                t0 = time.perf_counter()
                push(tr, buckets, f"{rep}")
                times[name].append(time.perf_counter() - t0)
                checks[name].append(check_seconds() - c0)
        for name, tr in transports.items():
            tr.close()
            k = min(range(reps), key=lambda i: times[name][i])
            best = times[name][k]
            results[name] = {"seconds": best, "gb_per_s": total / best / 1e9, "check_s": checks[name][k]}
    finally:
        cluster.stop()
    return results


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(layers: int, method: str, bucket_mb: float) -> None:
    """(child process) Build a learner, export its weights one way, print the peak extra RSS as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.models import hf_mapping
    from megatron_rl.phases.weights import export_format, rollout_payload
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.trainer.weight_export import StreamingExporter

    torch.set_num_threads(1)
    cfg = ModelConfig(preset="tiny", num_layers=layers, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
                      num_query_groups=4, head_dim=64)
    learner = Learner(cfg, ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=4096, seed=0)
    model_bytes = sum(p.numel() * 4 for c in learner.model for p in c.parameters())
    base, peak, stop = rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sent = 0
    precision = PrecisionConfig(rollout_quantization="fp8-blockwise")
    if method == "streaming":
        fmt = export_format(precision)
        for bucket in StreamingExporter(learner).buckets(int(bucket_mb * 1024 * 1024), fmt.convert):
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            del bucket
    else:
        hf, _ = rollout_payload(hf_mapping.to_hf(learner.gather_full_state_dict(), learner.arch), precision)
        sent = sum(t.numel() * t.element_size() for t in hf.values())
        del hf
    stop.set()
    sampler.join()
    print(json.dumps({"model_bytes": model_bytes, "extra_peak": max(0, peak[0] - base), "sent": sent}))


def measure_rss(bucket_mb: float) -> dict:
    """Peak extra RSS of streaming vs whole-model export for two learner sizes (fresh process each)."""
    out = {}
    for layers in (8, 32):
        for method in ("streaming", "whole-model"):
            proc = subprocess.run([sys.executable, __file__, "--rss-child", str(layers), method, "--bucket-mb", str(bucket_mb)],
                                  capture_output=True, text=True, env=RSS_ENV, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            out[(layers, method)] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def rollout_payload_bytes(arch, bucket_mb: float) -> tuple[int, int]:
    """(bytes, buckets) of one FP8-blockwise sync of `arch` as the exporter sends it from a bf16 GPU learner (quantized
    linears 1 B + fp32 block scales; embeddings, norms and lm_head in the learner's bf16)."""
    import math

    from megatron_rl.models import hf_mapping
    from megatron_rl.models.presets import megatron_param_shapes
    from megatron_rl.precision.hf_fp8 import is_quantized_weight

    sizes = []
    for name, shape in megatron_param_shapes(arch).items():
        b = 0
        for hf_name, t in hf_mapping.megatron_to_hf(name, torch.empty(shape, device="meta"), arch):
            if is_quantized_weight(hf_name):
                b += t.numel() + math.ceil(t.shape[0] / 128) * math.ceil(t.shape[1] / 128) * 4
            else:
                b += t.numel() * 2
        sizes.append(b)
    cap, n, cur = bucket_mb * 1024 * 1024, 0, 0
    for b in sizes:
        if cur and cur + b > cap:
            n, cur = n + 1, 0
        cur += b
    return sum(sizes), n + 1


def main() -> None:
    """Parse flags, run the parts, print the tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "0.5b"], help="model sizes (tiny | 0.5b)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of the transport runs")
    p.add_argument("--rss-bucket-mb", type=float, default=8.0, help="bucket size of the RSS runs")
    p.add_argument("--reps", type=int, default=2, help="syncs per transport (best is reported)")
    p.add_argument("--projection-bucket-mb", type=float, default=512.0, help="bucket size of the 8B/32B projection")
    p.add_argument("--skip-rss", action="store_true", help="skip part 2")
    p.add_argument("--rss-child", nargs=2, metavar=("LAYERS", "METHOD"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rss_child:
        rss_child(int(a.rss_child[0]), a.rss_child[1], a.rss_bucket_mb)
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        results = {s: measure_transports(s, a.bucket_mb, a.reps, Path(tmp)) for s in a.sizes}
    names = ["disk", "distributed/gloo", "tensor/shm"]
    print(f"\n== transports, end to end into one embedded engine (bucket {a.bucket_mb:g} MB, best of {a.reps}) ==")
    print(f"{'model':>8} {'params':>8} {'MB':>8} {'buckets':>7} | " + " | ".join(f"{n:>22}" for n in names))
    for s, r in results.items():
        cells = " | ".join(f"{r[n]['seconds']:8.3f} s {r[n]['gb_per_s']:7.3f} GB/s" for n in names)
        print(f"{s:>8} {r['params'] / 1e6:7.1f}M {r['bytes'] / 2**20:8.1f} {r['buckets']:7d} | {cells}")
    for s, r in results.items():
        base = r["disk"]["seconds"]
        print(f"{s:>8}: time relative to disk: " + ", ".join(f"{n} {r[n]['seconds'] / base:.2f}x" for n in names[1:]))
    print("\n== the engine's NaN/inf check inside those syncs (seconds of the same sync, share of it) ==")
    for s, r in results.items():
        print(f"{s:>8}: " + ", ".join(f"{n} {r[n]['check_s']:.3f} s of {r[n]['seconds']:.3f} s "
                                     f"({100 * r[n]['check_s'] / r[n]['seconds']:.1f}%)" for n in names))

    if not a.skip_rss:
        rss = measure_rss(a.rss_bucket_mb)
        print(f"\n== peak extra RSS of exporting a learner's weights as FP8 blockwise (bucket {a.rss_bucket_mb:g} MB, fresh process each) ==")
        for layers in (8, 32):
            s, w = rss[(layers, "streaming")], rss[(layers, "whole-model")]
            print(f"{layers:2d} layers, model {s['model_bytes'] / 2**20:7.1f} MB: streaming {s['extra_peak'] / 2**20:7.1f} MB, "
                  f"whole-model {w['extra_peak'] / 2**20:7.1f} MB (streaming/whole = {s['extra_peak'] / max(1, w['extra_peak']):.3f})")
        grow_s = rss[(32, "streaming")]["extra_peak"] / max(1, rss[(8, "streaming")]["extra_peak"])
        grow_w = rss[(32, "whole-model")]["extra_peak"] / max(1, rss[(8, "whole-model")]["extra_peak"])
        print(f"32 vs 8 layers (4x the model): streaming extra RSS x{grow_s:.2f}, whole-model x{grow_w:.2f}")

    if {"tiny", "0.5b"} <= set(results):
        small, big = results["tiny"]["distributed/gloo"], results["0.5b"]["distributed/gloo"]
        nb_s, nb_b = results["tiny"]["buckets"], results["0.5b"]["buckets"]
        by_s, by_b = results["tiny"]["bytes"], results["0.5b"]["bytes"]
        # t = n_buckets * c + bytes / bw, solved from the two measured points
        bw_inv = (big["seconds"] - small["seconds"] * nb_b / nb_s) / (by_b - by_s * nb_b / nb_s)
        c = max(0.0, (small["seconds"] - by_s * bw_inv) / nb_s)
        bw = 1 / bw_inv if bw_inv > 0 else float("inf")
        print(f"\n== projection (a model, not a measurement): t = buckets x {c * 1e3:.1f} ms + bytes / bandwidth ==")
        print(f"fitted on distributed/gloo: per-bucket overhead {c * 1e3:.1f} ms, CPU gloo bandwidth {bw / 1e9:.2f} GB/s; "
              f"FP8-blockwise payload, {a.projection_bucket_mb:g} MB buckets")
        from megatron_rl.config.model import ModelConfig
        from megatron_rl.models.presets import resolve_architecture

        for preset in ("qwen3-8b", "qwen3-32b"):
            nbytes, nb = rollout_payload_bytes(resolve_architecture(ModelConfig(preset=preset)), a.projection_bucket_mb)
            cells = ", ".join(f"{link}: {nb * c + nbytes / rate:.2f} s" for link, rate in LINKS.items())
            print(f"{preset}: {nbytes / 1e9:.1f} GB in {nb} buckets -> {cells}; at the measured CPU rate {nb * c + nbytes / bw:.0f} s")


if __name__ == "__main__":
    main()
