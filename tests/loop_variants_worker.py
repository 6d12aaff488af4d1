"""Worker of tests/test_loop_variants.py: several tiny 2-step RL runs in one process against one in-process engine.

    python tests/loop_variants_worker.py WARM_DIR OUT_DIR CASE [CASE ...]

CASE is `name:override,override,...` (dotted overrides of the tiny run); a name starting with `nan`
also poisons the RL loss with NaN on step 1's first mini-batch update, and `dropK` scores every sample
1 + 0.1 x its real reward before step K's rollouts and 0 from them on (test hooks, patched here); `A+B` runs
in A's run directory (a resume of A). Each case runs `megatron_rl.loop.run` with its run directory at
OUT_DIR/<name> and writes OUT_DIR/<name>.result.json ({"ok": true} or {"error": "..."}, and the weight
version the engine serves, the checkpoint directories and the logged steps afterwards). One process and one engine for all cases keeps the start-up cost
(imports, engine model load) to a single time.
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


def rewards_drop_at(first_step: int):
    """Score 1 + 0.1 x the real reward before `first_step`'s rollouts (a spread to learn from, never a drop of 0.9) and
    0 from them on; returns the undo function."""
    import threading

    from megatron_rl import loop
    from megatron_rl.phases import reward

    original_rollout, original_score = loop.controller_rollout, reward.score
    current = threading.local()  # under one_step_off the next step's rollout runs in a generation thread

    def controller_rollout(session, step, timers):
        current.step = step
        return original_rollout(session, step, timers)

    def score(batch, reward_fn, algo, max_new_tokens, *args, **kwargs):
        def shifted(text, answer):
            value, correct = reward_fn(text, answer)
            return (1.0 + 0.1 * float(value), correct) if current.step < first_step else (0.0, False)

        return original_score(batch, shifted, algo, max_new_tokens, *args, **kwargs)

    loop.controller_rollout, reward.score = controller_rollout, score

    def undo() -> None:
        loop.controller_rollout, reward.score = original_rollout, original_score

    return undo


def _hook(name: str):
    """The test hook a case name asks for (see the module docstring); returns its undo function."""
    if name.startswith("nan"):
        return poison_step_one()
    if name.startswith("drop"):
        return rewards_drop_at(int("".join(ch for ch in name[4:] if ch.isdigit())))
    return lambda: None


def served_version(url: str) -> str:
    """The weight version the engine at `url` serves (/model_info: where every SGLang version reports the live one)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/model_info", timeout=30) as response:
        return str(json.loads(response.read())["weight_version"])


def main() -> None:
    """Run every case against one ThreadedServer."""
    from megatron_rl.config import load_config
    from megatron_rl.loop import run
    from megatron_rl.engine.testing import ThreadedServer

    warm, out = Path(sys.argv[1]), Path(sys.argv[2])
    # deterministic: each /generate call in a batch of its own, so two runs that must agree bit for bit (a closed gate
    # against no calibration) never differ by which concurrent calls a 5 ms window happened to batch together (it did,
    # at load 10: last-bit rollout log-probs)
    with ThreadedServer(str(warm / "sft" / "hf"), str(warm / "sft" / "hf"), deterministic=True) as server:
        for case in sys.argv[3:]:
            name, _, extra = case.partition(":")
            run_name = name.split("+")[0]
            undo = _hook(name) if "+" not in name else (lambda: None)
            overrides = tiny_overrides(warm, *FAST, f"run_dir={out / run_name}", "rollout.engine=external",
                                       f"rollout.urls=[{server.url}]", *[o for o in extra.split(",") if o])
            try:
                run(load_config(CONFIG, overrides))
                result = {"ok": True}
            except Exception as exc:  # reported to the test, which names the case
                result = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                undo()
            # what the case left, before a later case (a resume) changes the run directory
            result["served_version"] = served_version(server.url)
            ckpts = out / run_name / "checkpoints"
            result["checkpoints"] = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
            metrics = out / run_name / "metrics.jsonl"
            result["steps"] = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
            (out / f"{name}.result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
