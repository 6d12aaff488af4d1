"""Worker of tests/test_loop_variants.py: several tiny 2-step RL runs in one process against one in-process engine.

    python tests/loop_variants_worker.py WARM_DIR OUT_DIR CASE [CASE ...]

CASE is `name:override,override,...` (dotted overrides of the tiny run); a name starting with `nan`
also poisons the RL loss with NaN on step 1's first mini-batch update (a test hook, patched here).
Each case runs `megatron_rl.loop.run` with its run directory at OUT_DIR/<name> and writes
OUT_DIR/<name>.result.json ({"ok": true} or {"error": "..."}). One process and one engine for all
cases keeps the start-up cost (imports, engine model load) to a single time.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

from rl_runs import CONFIG, tiny_overrides  # noqa: E402

FAST = ("precision.recipe=none", "precision.rollout_quantization=none", "algo.calibration.enabled=false",
        "train.steps=2", "checkpoint.save_every=1")


def poison_step_one():
    """Make the RL loss of step 1's first loss call NaN (every other call is untouched); returns the undo function."""
    from megatron_rl import loop
    from megatron_rl.phases import loss

    original_call, original_train = loss.RLLoss.__call__, loop.train_on_batch
    current_step, fired = [], []

    def train_on_batch(session, batch, step, timers):
        current_step[:] = [step]  # the loss does not know its step: the loop's step function does
        return original_train(session, batch, step, timers)

    def call(self, *args, **kwargs):
        value, extra = original_call(self, *args, **kwargs)
        if current_step == [1] and not fired:
            fired.append(True)
            value = value * float("nan")
        return value, extra

    loss.RLLoss.__call__, loop.train_on_batch = call, train_on_batch

    def undo() -> None:
        loss.RLLoss.__call__, loop.train_on_batch = original_call, original_train

    return undo


def main() -> None:
    """Run every case against one ThreadedServer."""
    from megatron_rl.config import load_config
    from megatron_rl.loop import run
    from megatron_rl.engine.testing import ThreadedServer

    warm, out = Path(sys.argv[1]), Path(sys.argv[2])
    with ThreadedServer(str(warm / "sft" / "hf"), str(warm / "sft" / "hf")) as server:
        for case in sys.argv[3:]:
            name, _, extra = case.partition(":")
            undo = poison_step_one() if name.startswith("nan") else (lambda: None)
            overrides = tiny_overrides(warm, *FAST, f"run_dir={out / name}", "rollout.engine=external",
                                       f"rollout.urls=[{server.url}]", *[o for o in extra.split(",") if o])
            try:
                run(load_config(CONFIG, overrides))
                result = {"ok": True}
            except Exception as exc:  # reported to the test, which names the case
                result = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                undo()
            (out / f"{name}.result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
