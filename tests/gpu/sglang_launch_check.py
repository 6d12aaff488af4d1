"""One-shot GPU check of the SGLang launcher: real `sglang.launch_server` engines started from our command lines.

    python tests/gpu/sglang_launch_check.py [--sglang-python PATH]     # needs CUDA and an SGLang environment
    python tests/gpu/sglang_launch_check.py --cpu    # the same code path on CPU: tests/fixtures/fake_sglang's
                                                     # `sglang.launch_server` (the embedded engine), one case

For every rollout format (none, fp8-blockwise, fp8-channel) x KV-cache dtype (auto, fp8_e4m3): start one
engine on GPU 0 from a random small Qwen3 checkpoint, greedy-generate with log-probs, compare with the
CPU embedded engine serving the same checkpoint (same quantized bits, emulated), push new weights with
/update_weights_from_disk and check the weight version it reports (GET /model_info in SGLang 0.5.23, the pinned
version; /server_info in 0.5.8); then tear down and check no process is left.
Prints one [PASS] / [FAIL] line per case (tests/gpu/checks_lib.sh relays them) and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

# A model SGLang's kernels accept: head_dim 128, dims multiples of 128 (FP8 block and CUTLASS shapes).
MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, max_position_embeddings=512, initializer_range=0.05)


def served_weight_version(url: str):
    """The weight version an engine reports: /model_info (SGLang 0.5.23), else /server_info (0.5.8 keeps it there)."""
    import json
    import urllib.error
    import urllib.request

    for path in ("/model_info", "/server_info", "/get_server_info"):
        try:
            with urllib.request.urlopen(url + path, timeout=30) as resp:
                info = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("weight_version") is not None:
            return info["weight_version"]
    return None


def main() -> int:
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.precision.rollout_formats import rollout_format
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.engine.generation import Engine, GenerationRequest, SamplingParams
    from megatron_rl.rollout.sglang_launcher import launch_sglang_engines
    from megatron_rl.rollout.sync import DiskWeightSync
    from megatron_rl.engine.testing import make_tiny_model

    p = argparse.ArgumentParser()
    p.add_argument("--sglang-python", default=sys.executable)
    p.add_argument("--cpu", action="store_true", help="fake SGLang (tests/fixtures/fake_sglang) on CPU, one case")
    args = p.parse_args()
    if args.cpu:
        os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests", "fixtures", "fake_sglang"),
                                                    os.environ.get("PYTHONPATH", "")])
    cases = [("fp8-blockwise", "fp8_e4m3")] if args.cpu else [(q, kv) for q in ("none", "fp8-blockwise", "fp8-channel")
                                                              for kv in ("auto", "fp8_e4m3")]
    work = tempfile.mkdtemp(prefix="sglang_check_")
    make_tiny_model(f"{work}/hf", seed=0, **MODEL)
    new = make_tiny_model(f"{work}/hf_new", seed=1, **MODEL)
    prompt = [5, 17, 99, 250, 3]
    failures = 0
    for quant, kv in cases:
        name = f"{quant}/{kv}"
        precision = PrecisionConfig(rollout_quantization=quant, kv_cache_dtype=kv)
        cfg = RolloutConfig(engine="sglang", sglang_python=args.sglang_python, startup_timeout_s=600,
                            mem_fraction_static=0.3, deterministic_inference=True)
        t0 = time.perf_counter()
        try:
            cluster = launch_sglang_engines(cfg, precision, f"{work}/hf", log_dir=f"{work}/logs_{quant}_{kv}",
                                            launch_dir=f"{work}/launch", learner_gpus=0,
                                            visible_gpus=1 if args.cpu else None)
        except Exception as exc:  # report and go on with the other cases
            print(f"[FAIL] {name} start: {exc}", flush=True)
            failures += 1
            continue
        try:
            client = RolloutClient(cluster.worker_urls)
            params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
            gpu = client.generate_sync(prompt, params)[0]
            launch_path = cluster.engines[0].cmd[cluster.engines[0].cmd.index("--model-path") + 1]
            cpu = Engine(launch_path, kv_cache_dtype=kv).generate(
                [GenerationRequest(prompt, SamplingParams(**params))])[0][0]
            same = sum(a == b for a, b in zip(gpu.output_ids, cpu.output_ids))
            n = min(len(gpu.logprobs), len(cpu.logprobs))
            diff = max(abs(a - b) for a, b in zip(gpu.logprobs[:n], cpu.logprobs[:n])) if n else float("nan")
            fmt = rollout_format(precision)
            sync = DiskWeightSync(f"{work}/sync_{quant}_{kv}", f"{work}/hf", cluster.worker_urls)
            sync.push(fmt.quantize_state_dict(new.state_dict()), 1, fmt.config_updates())
            version = served_weight_version(cluster.worker_urls[0])
            ok = gpu.output_ids[:1] == cpu.output_ids[:1] and version == "1"
            print(f"[{'PASS' if ok else 'FAIL'}] {name} start {time.perf_counter() - t0:.0f}s, greedy tokens equal to the "
                  f"CPU emulation {same}/{len(gpu.output_ids)}, max |logprob diff| on the first {n} {diff:.4f}, "
                  f"weight_version after sync {version!r}", flush=True)
            failures += not ok
        except Exception as exc:
            print(f"[FAIL] {name} {type(exc).__name__}: {exc}", flush=True)
            failures += 1
        finally:
            pids = [e.proc.pid for e in cluster.engines]
            cluster.stop()
            left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
            if left:
                print(f"[FAIL] {name} processes left after stop: {left}", flush=True)
                failures += 1
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    torch.set_num_threads(4)
    sys.exit(main())
