"""Runs inside a subprocess with the pinned SGLang first on sys.path (tests/conformance/conformance_packages.py):
the checks that need SGLang's own code, on the cases the test hands it. Never imported by the test process.

    python sglang_probe.py SGLANG_SITE CASES.json RESULTS.json

CASES.json: {"server_args": [{"id", "argv", "expect": {field: value}}], "sampling_params": [{"id", "params"}],
"payloads": [{"id", "blobs": [str, ...], "expect": [[name, dtype, shape, sha256], ...]}]}. RESULTS.json: per case
{"id", "ok", "error", "got"} plus the SGLang version and how long its import took.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback


def _describe(named) -> list:
    out = []
    for name, tensor in named:
        t = tensor.detach().contiguous().cpu()
        data = t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""
        out.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), hashlib.sha256(data).hexdigest()])
    return out


def main(site: str, cases_path: str, results_path: str) -> None:
    sys.path.insert(0, site)
    t0 = time.perf_counter()
    import sglang
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import MultiprocessingSerializer

    import_s = time.perf_counter() - t0
    cases = json.loads(open(cases_path).read())
    results: dict = {"sglang_version": sglang.__version__, "sglang_file": sglang.__file__, "import_s": import_s}

    def run(kind, fn):
        out = []
        for case in cases.get(kind, []):
            try:
                got = fn(case)
                out.append({"id": case["id"], "ok": True, "got": got})
            except BaseException as exc:  # SystemExit from argparse included: a case that fails is reported
                out.append({"id": case["id"], "ok": False,
                            "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"})
        results[kind] = out

    def server_args(case):
        args = prepare_server_args(case["argv"])
        return {field: getattr(args, field) for field in case["expect"]}

    def sampling(case):
        params = SamplingParams(**case["params"])
        params.normalize(None)
        params.verify(case.get("vocab_size", 1 << 20))
        return {"top_k": params.top_k}

    def payload(case):
        got = [_describe(MultiprocessingSerializer.deserialize(blob)) for blob in case["blobs"]]
        return got

    run("server_args", server_args)
    run("sampling_params", sampling)
    run("payloads", payload)
    with open(results_path, "w") as f:
        json.dump(results, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:4])
