"""Helpers of the end-to-end RL tests: one tiny warm start per test session and `megatron-rl` subprocess runs.

    warm = warm_start(tmp_path_factory)          # SFT once (~15 s), reused by every test of the session
    rows = train(tmp_path / "run", tiny_overrides(warm, "train.steps=2"))

Runs go through the real CLI (`python -m megatron_rl.cli train ...`), each in processes of their own with a fresh
torch.distributed state and their own embedded engine subprocess, forked from a server that has the trainer's modules
imported (tests/cli_forkserver.py: ~5 CPU-s of imports saved per process); several-process runs get torchrun's
worker variables, or torchrun itself (`train(..., torchrun=True)`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from filelock import FileLock

from cli_forkserver import run_cli, run_ranks

from megatron_rl.rollout.processes import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml"

# Metrics that measure wall or CPU time (or depend on it), never compared between runs.
TIMING_PREFIXES = ("time/", "cpu/", "rollout/time_s", "rollout/tokens_per_s", "sync/time_s", "sync/gb_per_s")


def cli_env() -> dict[str, str]:
    """Environment of a CLI subprocess: one CPU thread per process (the box has 2 cores, runs stay comparable)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def warm_start(tmp_path_factory) -> Path:
    """Directory holding data/ (train, eval, tokenizer) and sft/hf of a short SFT warm start; built once per session."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: one warm start for all workers, built by the first
        base = base.parent
    warm = base / "tiny_warm_start"
    with FileLock(str(base / "tiny_warm_start.lock")):
        _build_warm_start(warm)
    return warm


def _build_warm_start(warm: Path) -> None:
    if not (warm / "sft" / "hf" / "model.safetensors").exists():
        # 200 SFT steps on 200 prompts leave the model right on some of them (greedy 26-38% on the kernel paths
        # of scripts/test_kernel_paths.sh: this regime has no sudden jump), so GRPO groups have reward spread from
        # the first step. A fixed step count, without the main job's accuracy checks: nothing here needs them;
        # true sums at lr 3e-3 (the main job's imperfect teacher at 1e-3 leaves 200 steps nearly all wrong).
        argv = ["sft", str(CONFIG), f"run_dir={warm}", "sft.steps=200", "sft.eval_every=0", "sft.stop_accuracy=null",
                "sft.lr=3e-3", "sft.teacher_carry_drop=0", "data.num_train_prompts=200", "data.num_eval_prompts=8"]
        with tempfile.TemporaryDirectory() as logs:
            err = Path(logs) / "stderr"
            returncode = run_cli(argv, cli_env(), Path(logs) / "stdout", err, timeout=600).returncode
            assert returncode == 0, f"warm start failed:\n{err.read_text()[-4000:] if err.exists() else ''}"


def tiny_overrides(warm: Path, *extra: str) -> list[str]:
    """Overrides of a tiny RL run from the shared warm start (4 prompts x 4 samples, calibration every step)."""
    return [
        f"model.init_checkpoint={warm / 'sft' / 'hf'}",
        f"data.train_file={warm / 'data' / 'train.jsonl'}",
        f"data.eval_file={warm / 'data' / 'eval.jsonl'}",
        f"data.tokenizer_dir={warm / 'data' / 'tokenizer'}",
        "data.num_train_prompts=200", "data.num_eval_prompts=8", "train.eval_max_prompts=8",
        "train.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=4",
        # no plots: drawing them costs a few CPU-seconds a run; tests/test_loop.py draws them from a real run
        # the full solve: these tests check what calibration does to the bounds, which strength=targeted or decision
        # never moves (tests/test_dose_instrument_run.py runs it; tests/test_loop_variants.py runs a closed gate)
        "algo.calibration.calibrate_every=1", "algo.calibration.strength=full",
        "tracking.progress_bar=false", "tracking.plots=false", *extra,
    ]


def train_command(run_dir: Path, overrides: Sequence[str], nproc: int = 1) -> list[str]:
    """argv of `megatron-rl train` (under torchrun when nproc > 1)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    return [*launcher, "-m", "megatron_rl.cli", "train", str(CONFIG), f"run_dir={run_dir}", *overrides]


def train(run_dir: Path, overrides: Sequence[str], nproc: int = 1, timeout: float = 600, torchrun: bool = False) -> list[dict]:
    """Run training to the end and return its metrics.jsonl rows. Its processes are forked from the preloaded server of
    tests/cli_forkserver.py (several: with torchrun's worker variables, as torchrun starts them); with `torchrun`,
    `python -m torch.distributed.run --standalone` starts them as fresh interpreters."""
    argv = train_command(run_dir, overrides)
    argv = argv[argv.index("megatron_rl.cli") + 1:]
    fresh_dir = not Path(run_dir).exists()
    # files, not pipes: a helper the run leaves behind (torch's shared-memory manager under the tensor transport)
    # would hold a pipe open and block the read long after the trainer exited
    with tempfile.TemporaryDirectory() as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        for attempt in range(3):
            if torchrun:
                with open(out, "w") as fo, open(err, "w") as fe:
                    returncode = subprocess.run(train_command(run_dir, overrides, nproc), env=cli_env(), stdout=fo,
                                                stderr=fe, timeout=timeout).returncode
            elif nproc == 1:
                returncode = run_cli(argv, cli_env(), out, err, timeout).returncode
            else:
                returncode = run_ranks(nproc, argv, cli_env(), out, err, timeout, port=free_port(), module="megatron_rl.cli")
            stdout, stderr = (p.read_text() if p.exists() else "" for p in (out, err))
            # rank 0's rendezvous store found its probed-free port taken by then: the run never started, start it again
            if returncode == 0 or nproc == 1 or torchrun or "address already in use" not in stderr.lower() or not fresh_dir:
                break
            shutil.rmtree(run_dir, ignore_errors=True)
    assert returncode == 0, f"train failed (rc={returncode}):\n{stdout[-2000:]}\n{stderr[-6000:]}"
    return read_rows(run_dir)


def read_rows(run_dir: Path) -> list[dict]:
    """Rows of <run_dir>/metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(row: dict) -> dict:
    """A metrics row without its timing-dependent entries."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
