"""Which ATen ops of the first SFT steps give different bits under which CPU kernel setting.

    python tools/op_digest.py sweep OUT_DIR [--steps 2] [--settings native,aten=default,...]   # everything, then the table
    python tools/op_digest.py report OUT_DIR                                                  # the table again

`sweep` first captures the pinned run (`megatron_rl.cpu_kernels`: ATen AVX2 kernels, MKL_CBWR=AVX2,STRICT, one
thread): every op of `--steps` SFT steps of the main job's model (forward, backward, Adam) with digests of its inputs
and outputs (megatron_rl/tracking/op_digest.py), and the inputs of the first call of each op signature. Then, for
each setting, a fresh process (the libraries read these variables once, at start) with that environment
1. repeats the capture: where its record first differs from the pinned one is where training diverges, and
   whether the weights after each step are equal says if the setting changes the run at all;
2. replays the pinned run's saved calls on their exact inputs: an op whose output differs is sensitive to the
   setting (this finds every such op, also those after the first divergence).
Settings are environment variables (`SETTINGS` below) and one in-process switch, `torch.backends.mkldnn`
(`mkldnn=off`). Each child run is `python tools/op_digest.py run OUT_DIR NAME` under that environment. Results go to
OUT_DIR (records, saved calls, per-setting JSON) and the table to stdout and OUT_DIR/report.md. Takes a few
minutes on an idle 2-core box; run it under `nice` on a shared one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
               "OMP_NUM_THREADS", "MKL_NUM_THREADS")
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "OMP_NUM_THREADS": "1"}
SETTINGS: dict[str, dict[str, str]] = {
    "pinned": PINNED,
    "native": {"OMP_NUM_THREADS": "1"},
    "aten=avx512": {**PINNED, "ATEN_CPU_CAPABILITY": "avx512"},
    "aten=default": {**PINNED, "ATEN_CPU_CAPABILITY": "default"},
    "mkl=AVX2": {**PINNED, "MKL_CBWR": "AVX2"},
    "mkl=AVX512": {**PINNED, "MKL_CBWR": "AVX512"},
    "mkl=AVX": {**PINNED, "MKL_CBWR": "AVX"},
    "mkl=SSE4_2": {**PINNED, "MKL_CBWR": "SSE4_2"},
    "mkl=COMPATIBLE": {**PINNED, "MKL_CBWR": "COMPATIBLE"},
    "mkl=AUTO": {**PINNED, "MKL_CBWR": "AUTO"},
    "mkl=unset": {k: v for k, v in PINNED.items() if k != "MKL_CBWR"},
    "onednn=AVX2": {**PINNED, "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "onednn=SSE41": {**PINNED, "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "mkldnn=off": PINNED,
    "threads=2": {**PINNED, "OMP_NUM_THREADS": "2"},
}
"""Name -> the kernel environment of that run (everything in KERNEL_VARS not named is unset)."""
IN_PROCESS = {"mkldnn=off": lambda torch: setattr(torch.backends.mkldnn, "enabled", False)}
"""Settings with no environment variable: applied in the child before any op runs."""
SKIP = ("aten.detach.default", "aten.alias.default", "profiler._record_function_enter_new.default",
        "profiler._record_function_exit._RecordFunction")  # no arithmetic; they only bloat the record


def _sft_steps(steps: int, keep: int):
    """Capture `steps` SFT steps of the main job's model from a fixed init and batch order; returns (mode, weight digests)."""
    import tempfile

    from megatron_rl.config import load_config
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.data.tasks import generate
    from megatron_rl.data.tokenizer import build_char_tokenizer, load_tokenizer
    from megatron_rl.sft import nll_loss, sft_batch
    from megatron_rl.tracking.op_digest import OpDigestMode, digest
    from megatron_rl.trainer.learner import Learner

    cfg = load_config(REPO / "examples" / "configs" / "tiny_fp8_grpo.yaml", [])
    with tempfile.TemporaryDirectory() as tmp:
        build_char_tokenizer(Path(tmp))
        tokenizer = load_tokenizer(tmp)
    rows = generate("addition", steps * cfg.sft.global_batch_size, seed=cfg.data.seed, min_digits=1, max_digits=2)
    optim = cfg.optim.model_copy(update={"lr": cfg.sft.lr, "clip_grad": cfg.sft.clip_grad, "lr_warmup_steps": 0,
                                         "lr_decay_style": "constant"})  # as megatron_rl.sft.run_sft
    learner = Learner(cfg.model, cfg.parallel, optim, PrecisionConfig(), vocab_size=len(tokenizer), seed=cfg.train.seed)
    batches = [sft_batch(tokenizer, rows[i * cfg.sft.global_batch_size:(i + 1) * cfg.sft.global_batch_size])
               for i in range(steps)]
    weights, ends = [], []
    mode = OpDigestMode(keep=keep, skip=SKIP)
    for batch in batches:
        with mode:
            learner.train_step(batch, nll_loss, cfg.sft.micro_batch_size)
        ends.append(len(mode.records))
        weights.append(digest(sorted(learner.gather_full_state_dict().items())))
    return mode, weights, ends


def cmd_run(out: Path, name: str, steps: int) -> None:
    """Child: capture under this process's environment (saving calls when it is the pinned run), replay the pinned calls."""
    import torch

    from megatron_rl.tracking.op_digest import load_calls, replay_calls, save_calls

    warnings.filterwarnings("ignore")
    if name in IN_PROCESS:
        IN_PROCESS[name](torch)
    baseline = name == "pinned"
    mode, weights, ends = _sft_steps(steps, keep=1 if baseline else 0)
    result = {"name": name, "env": {k: os.environ[k] for k in KERNEL_VARS if k in os.environ},
              "aten_capability": torch.backends.cpu.get_cpu_capability(), "mkldnn": torch.backends.mkldnn.enabled,
              "records": [list(r) for r in mode.records], "step_ends": ends, "weights": weights}
    if baseline:
        result["not_replayable"] = save_calls(mode.calls, str(out / "pinned.calls.pt"))
    replayed = replay_calls(load_calls(str(out / "pinned.calls.pt")))
    result["replay"] = [[call.op, same] for call, same in replayed]
    (out / f"{name}.json").write_text(json.dumps(result))


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def report(out: Path, names: list[str]) -> str:
    """Markdown: per setting, where training first diverges from the pinned run and which ops are sensitive."""
    base = _load(out, "pinned")
    # ops whose replay differs even in the process that captured them draw random numbers or read uninitialized memory
    noisy = sorted({op for op, same in base["replay"] if not same})
    lines = ["| setting | ATen kernels in use | weights after each step | first op whose output differs | "
             "ops that differ on the same inputs (calls differing / replayed) |", "|---|---|---|---|---|"]
    sensitive: dict[str, dict[str, str]] = defaultdict(dict)
    for name in names:
        res = _load(out, name)
        same_w = ["=" if a == b else "differ" for a, b in zip(res["weights"], base["weights"])]
        first = "none"
        for a, b in zip(res["records"], base["records"]):
            if a[1] != b[1] or a[3] != b[3]:
                step = next(k for k, end in enumerate(base["step_ends"]) if a[0] < end) + 1
                first = f"#{a[0]} `{a[1]}` (step {step}{', inputs equal' if a[2] == b[2] else ''})"
                break
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for op, same in res["replay"]:
            if op in noisy:
                continue
            counts[op][1] += 1
            counts[op][0] += 0 if same else 1
        diff = {op: f"{d}/{n}" for op, (d, n) in sorted(counts.items()) if d}
        for op, frac in diff.items():
            sensitive[op][name] = frac
        shown = ", ".join(f"`{op}` {frac}" for op, frac in diff.items()) or "none"
        env = " ".join(f"{k}={v}" for k, v in res["env"].items())
        lines.append(f"| {name} ({env}{', mkldnn off' if not res['mkldnn'] else ''}) | {res['aten_capability']} | "
                     f"{' '.join(same_w)} | {first} | {shown} |")
    total = len(base["replay"])
    lines += ["", f"Replayed: {total} calls ({len({op for op, _ in base['replay']})} ops), the first of each op signature "
                  f"in the pinned run's {len(base['records'])} calls; not replayable (unpicklable arguments): "
                  f"{', '.join(sorted(set(base.get('not_replayable', [])))) or 'none'}; left out as not a function of "
                  f"their inputs (their replay differs in the capturing process too): {', '.join(noisy) or 'none'}.", ""]
    if sensitive:
        cols = [n for n in names if any(n in v for v in sensitive.values())]
        lines += ["| op | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for op, per in sorted(sensitive.items()):
            lines.append(f"| `{op}` | " + " | ".join(per.get(c, "=") for c in cols) + " |")
    return "\n".join(lines)


def cmd_sweep(out: Path, names: list[str], steps: int) -> None:
    """The pinned capture, then one child per setting; writes and prints the report."""
    out.mkdir(parents=True, exist_ok=True)
    order = ["pinned"] + [n for n in names if n != "pinned"]
    for name in order:
        env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
        env.update(SETTINGS[name])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        print(f"op_digest: {name} ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "run", str(out), name, "--steps", str(steps)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: setting {name} failed:\n{proc.stderr[-3000:]}")
    text = report(out, order)
    (out / "report.md").write_text(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="capture + replay under every setting, then the table")
    s.add_argument("out", type=Path)
    s.add_argument("--steps", type=int, default=2, help="SFT steps captured (default 2)")
    s.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of: {', '.join(SETTINGS)}")
    r = sub.add_parser("run", help="(internal) one setting's capture and replay, in this process's environment")
    r.add_argument("out", type=Path)
    r.add_argument("name", choices=sorted(SETTINGS))
    r.add_argument("--steps", type=int, default=2)
    rep = sub.add_parser("report", help="print the table of a finished sweep")
    rep.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "sweep":
        names = [n.strip() for n in a.settings.split(",") if n.strip()]
        bad = [n for n in names if n not in SETTINGS]
        if bad:
            print(f"error: --settings: unknown {bad}; valid: {', '.join(SETTINGS)}", file=sys.stderr)
            return 2
        cmd_sweep(a.out, names, a.steps)
    elif a.cmd == "run":
        cmd_run(a.out, a.name, a.steps)
    else:
        names = [json.loads(f.read_text())["name"] for f in sorted(a.out.glob("*.json"))]
        names = ["pinned"] + sorted(n for n in names if n != "pinned")
        print(report(a.out, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
