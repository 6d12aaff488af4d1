"""/health latency of an embedded rollout server while large /generate bodies arrive (/health
must answer within 1 s under a large upload).

Starts one engine (tiny random Qwen3, its own process, as the launcher runs it), then for each body
polls /health from a separate thread every 20 ms while the body is sent and answered, and prints the
median and worst /health latency next to the idle median measured in the same run.

    PYTHONPATH=. python benchmarks/bench_server_health.py [--sizes-mb 1 4 15 --nested-mb 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request


def post(url: str, body: bytes) -> int:
    """Status of a POST /generate."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body), timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def health_latencies(url: str, action) -> tuple[list[float], object]:
    """Run `action()` while polling /health; returns (latencies in s, action's result)."""
    done, lat = threading.Event(), []

    def poll() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(url + "/health", timeout=60) as r:
                r.read()
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = action()
        time.sleep(0.1)
    finally:
        done.set()
        poller.join()
    return lat, result


def main() -> None:
    """Measure and print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 15], help="bodies of flat token ids")
    ap.add_argument("--nested-mb", type=float, default=8, help="a body of many small lists in an unknown field (0: skip)")
    ap.add_argument("--over-limit-mb", type=float, default=200, help="a body over the server's limit (0: skip)")
    args = ap.parse_args()

    from megatron_rl.rollout.launcher import launch_engines
    from megatron_rl.engine.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp + "/m")
        with launch_engines(tmp + "/m", 1, log_dir=tmp) as cluster:
            url = cluster.worker_urls[0]
            idle, _ = health_latencies(url, lambda: time.sleep(1.0))
            idle_p50 = statistics.median(idle)
            print(f"idle /health: median {idle_p50 * 1e3:.1f} ms over {len(idle)} polls")
            bodies = [(f"{mb:g} MB flat token ids", json.dumps({"input_ids": [5] * int(mb * 1e6 / 3)}).encode())
                      for mb in args.sizes_mb]
            if args.nested_mb:
                n = int(args.nested_mb * 1e6 / 10)
                bodies.append((f"{args.nested_mb:g} MB of small lists",
                               json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1},
                                           "x": [[[1, 2]]] * n}).encode()))
            if args.over_limit_mb:
                bodies.append((f"{args.over_limit_mb:g} MB over the limit", b"{" + b" " * int(args.over_limit_mb * 1e6) + b"}"))
            for name, body in bodies:
                t0 = time.perf_counter()
                lat, status = health_latencies(url, lambda: post(url, body))
                took = time.perf_counter() - t0
                print(f"{name:28s} -> HTTP {status} in {took:5.2f} s; /health median {statistics.median(lat) * 1e3:6.1f} ms "
                      f"({statistics.median(lat) / idle_p50:5.1f}x idle), worst {max(lat) * 1e3:7.1f} ms "
                      f"({max(lat) / idle_p50:6.1f}x idle), {len(lat)} polls")


if __name__ == "__main__":
    main()
