"""The supervised warm start's greedy-accuracy checks and stop rule (megatron_rl/sft.py), and the one-way import
between megatron_rl.warm_start and megatron_rl.sft.

The accuracy check is teacher-forced (one forward over prompt + answer); here it must agree with real greedy
decoding of the exported HF model. Which prompts a short warm start gets right depends on the machine's kernels,
so the rows are built from the model's own greedy output: half keep it as their answer (right by construction),
half get an answer greedy decoding cannot produce (wrong by construction).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from rl_runs import CONFIG, REPO_ROOT

from megatron_rl.config import load_config
from megatron_rl.config.run import ConfigError
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.data.tasks import generate, teacher_drops_units_carry
from megatron_rl.data.tokenizer import build_char_tokenizer, load_tokenizer

MARGIN = 1e-3  # rows whose greedy path has a near-tie are left out: the learner and HF model round differently


def _setup(tmp_path: Path, *overrides: str):
    build_char_tokenizer(tmp_path / "tok")
    cfg = load_config(CONFIG, [f"run_dir={tmp_path / 'run'}", "tracking.progress_bar=false", *overrides])
    rows = generate("addition", 64, seed=5, min_digits=1, max_digits=2)
    return cfg, load_tokenizer(str(tmp_path / "tok")), rows


def _greedy_decode(model, tokenizer, prompts: list[str], max_new_tokens: int = 6) -> list[tuple[str, bool, float]]:
    """Per prompt (all of one token length): (completion text, ended with EOS, smallest top-1 minus top-2 logit gap
    up to the EOS) of plain greedy decoding with the HF model."""
    ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts])
    chosen, gaps = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids).logits[:, -1]
            top = torch.topk(logits, 2).values
            gaps.append(top[:, 0] - top[:, 1])
            chosen.append(logits.argmax(-1))
            ids = torch.cat([ids, chosen[-1][:, None]], dim=1)
    out = []
    for toks, gap in zip(torch.stack(chosen, 1).tolist(), torch.stack(gaps, 1).tolist()):
        eos = tokenizer.eos_token_id in toks
        end = toks.index(tokenizer.eos_token_id) if eos else len(toks) - 1
        out.append((tokenizer.decode(toks[:end]) if eos else "", eos, min(gap[: end + 1])))
    return out


def test_greedy_accuracy_is_what_greedy_decoding_scores(tmp_path):
    from megatron_rl.parallel import state
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.sft import greedy_accuracy, run_sft
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import load_initial_weights

    cfg, tokenizer, rows = _setup(tmp_path, "sft.steps=30", "sft.micro_batch_size=16", "sft.eval_every=0",
                                  "sft.stop_accuracy=null")
    run_sft(cfg, tokenizer, rows, tmp_path / "sft")
    model = load_hf_model(str(tmp_path / "sft" / "hf"))
    right, wrong = [], []
    for length in sorted({len(r.prompt) for r in rows}):
        prompts = [r.prompt for r in rows if len(r.prompt) == length]  # one character per token
        for prompt, (text, eos, gap) in zip(prompts, _greedy_decode(model, tokenizer, prompts)):
            if not eos or not text or gap < MARGIN:
                continue
            # alternate: the model's own completion is right; it plus one more digit never is (greedy stops first)
            if len(right) <= len(wrong):
                right.append(PromptRow(prompt, text))
            else:
                wrong.append(PromptRow(prompt, text + "7"))
    assert len(right) >= 4 and len(wrong) >= 4, f"too few clean greedy rows ({len(right)}, {len(wrong)}) to test with"
    learner = Learner(cfg.model, cfg.parallel, cfg.optim, cfg.precision, vocab_size=len(tokenizer), seed=cfg.train.seed,
                      total_steps=cfg.train.optimizer_steps)
    load_initial_weights(learner, str(tmp_path / "sft" / "hf"))
    mixed = right + wrong
    # micro-batch 16 pads the rows with copies, which must not count
    assert greedy_accuracy(learner, tokenizer, mixed, 1, 16) == len(right) / len(mixed)
    assert greedy_accuracy(learner, tokenizer, right, 1, 16) == 1.0
    assert greedy_accuracy(learner, tokenizer, wrong[:3], 1, 16) == 0.0
    state.destroy_distributed()


def test_stop_accuracy_needs_two_of_three_checks_on_prompts_the_warm_start_never_trains_on(tmp_path, monkeypatch):
    import megatron_rl.sft as sft
    from megatron_rl.parallel import state
    from megatron_rl.trainer.checkpoint import checkpoint_meta, latest_checkpoint

    script = iter([0.10, 0.60, 0.20, 0.30, 0.55, 0.52, 0.90])  # check 2 is a lucky swing: it must not stop the warm start
    scored, trained = [], []
    monkeypatch.setattr(sft, "greedy_accuracy", lambda learner, tok, rows, *a: scored.append(rows) or next(script))
    real_batch = sft.sft_batch
    monkeypatch.setattr(sft, "sft_batch", lambda tok, rows, *a: trained.extend(r.prompt for r in rows) or real_batch(tok, rows, *a))
    cfg, tokenizer, rows = _setup(tmp_path, "sft.steps=40", "sft.eval_every=5", "sft.stop_accuracy=0.5", "sft.eval_prompts=8",
                                  "sft.settle_steps=0", "sft.micro_batch_size=16", "sft.global_batch_size=16")
    result = sft.run_sft(cfg, tokenizer, rows, tmp_path / "sft")
    assert result["sft/steps"] == 30.0  # checks 4-6: 0.30, 0.55, 0.52 -> median 0.52
    logged = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["greedy_accuracy"]) for r in logged] == [(5, 0.10), (10, 0.60), (15, 0.20), (20, 0.30), (25, 0.55),
                                                                  (30, 0.52)]
    checked = {r.prompt for r in scored[0]}
    assert checked == {r.prompt for r in rows[:8]} and len(trained) == 30 * 16 and not checked & set(trained)
    record = sft.warm_start_record(tmp_path / "sft")
    assert (record["steps"], record["stopped_by"], record["greedy_accuracy"]) == (30, "stop_accuracy", 0.52)
    assert checkpoint_meta(latest_checkpoint(str(tmp_path / "sft" / "checkpoints")))["step"] == 30
    assert (tmp_path / "sft" / "hf" / "model.safetensors").exists()
    state.destroy_distributed()


def test_settle_steps_keep_training_after_stop_accuracy_is_reached(tmp_path, monkeypatch):
    import megatron_rl.sft as sft
    from megatron_rl.parallel import state
    from megatron_rl.warm_start import warm_start_summary

    script = iter([0.10, 0.55, 0.60, 0.30, 0.20, 0.10, 0.10, 0.10])  # reached at check 3 (step 15), whatever follows
    monkeypatch.setattr(sft, "greedy_accuracy", lambda *a: next(script))
    cfg, tokenizer, rows = _setup(tmp_path, "sft.steps=40", "sft.eval_every=5", "sft.stop_accuracy=0.5", "sft.eval_prompts=8",
                                  "sft.settle_steps=12", "sft.micro_batch_size=16", "sft.global_batch_size=16",
                                  f"sft.output_dir={tmp_path / 'run' / 'sft'}")
    assert sft.run_sft(cfg, tokenizer, rows, tmp_path / "run" / "sft")["sft/steps"] == 27.0
    record = sft.warm_start_record(tmp_path / "run" / "sft")
    assert (record["steps"], record["reached_at"], record["greedy_accuracy"]) == (27, 15, 0.20)  # last check: step 25
    assert warm_start_summary(cfg, tmp_path / "run").startswith(
        "SFT 27 steps (reached sft.stop_accuracy=0.5 at step 15, then 12 settle steps)")
    state.destroy_distributed()


def _carries(prompt: str) -> bool:
    a, b = prompt.rstrip("=").split("+")
    return int(a) % 10 + int(b) % 10 >= 10


def test_teacher_drops_the_units_carry_of_a_fixed_share_of_carrying_sums():
    rows = [PromptRow(f"{a}+{b}=", str(a + b)) for a in range(100) for b in range(100)]
    for p in (0.0, 0.3, 0.6):
        taught = [teacher_drops_units_carry(r, p, seed=7) for r in rows]
        changed = [(r, t) for r, t in zip(rows, taught) if t.answer != r.answer]
        assert all(_carries(r.prompt) and int(t.answer) == int(r.answer) - 10 for r, t in changed)
        carrying = sum(_carries(r.prompt) for r in rows)  # 4500 of the 10000 sums
        assert abs(len(changed) / carrying - p) < 0.03  # binomial sd 0.0073 at p = 0.6
    # the same demonstrations for the same seed (every epoch, every rank), other ones for another seed
    again = [teacher_drops_units_carry(r, 0.6, seed=7).answer for r in rows]
    assert again == [t.answer for t in taught]
    assert again != [teacher_drops_units_carry(r, 0.6, seed=8).answer for r in rows]
    with pytest.raises(ValueError, match="train.jsonl:4: sft.teacher_carry_drop needs addition rows.*'12-3='"):
        teacher_drops_units_carry(PromptRow("12-3=", "9", source="train.jsonl:4"), 0.6, seed=7)
    with pytest.raises(ValueError, match="'12\\+3='"):
        teacher_drops_units_carry(PromptRow("12+3=", "16"), 0.6, seed=7)


def test_warm_start_learns_the_teachers_answers_and_is_checked_on_true_ones(tmp_path, monkeypatch):
    import megatron_rl.sft as sft
    from megatron_rl.parallel import state

    scored, trained = [], []
    monkeypatch.setattr(sft, "greedy_accuracy", lambda learner, tok, rows, *a: scored.extend(rows) or 0.0)
    real_batch = sft.sft_batch
    monkeypatch.setattr(sft, "sft_batch", lambda tok, rows, *a: trained.extend(rows) or real_batch(tok, rows, *a))
    cfg, tokenizer, rows = _setup(tmp_path, "sft.steps=8", "sft.eval_every=4", "sft.eval_prompts=8", "sft.stop_accuracy=null",
                                  "sft.micro_batch_size=16", "sft.global_batch_size=16", "sft.teacher_carry_drop=0.6")
    sft.run_sft(cfg, tokenizer, rows, tmp_path / "sft")
    truth = {r.prompt: r.answer for r in rows}
    assert scored and all(r.answer == truth[r.prompt] for r in scored)
    wrong = {r.prompt for r in trained if r.answer != truth[r.prompt]}
    assert wrong and all(_carries(p) for p in wrong)
    assert all(r.answer == teacher_drops_units_carry(PromptRow(r.prompt, truth[r.prompt]), 0.6, cfg.data.seed).answer
               for r in trained)
    state.destroy_distributed()


def test_teacher_carry_drop_needs_addition_rows():
    assert load_config(CONFIG, ["sft.teacher_carry_drop=0.6"]).sft.teacher_carry_drop == 0.6
    assert load_config(CONFIG, ["sft.teacher_carry_drop=0.6", "data.task=subtraction", "data.train_file=rows.jsonl"])
    with pytest.raises(ConfigError, match="sft.teacher_carry_drop.*data.task=addition \\(got subtraction\\)"):
        load_config(CONFIG, ["sft.teacher_carry_drop=0.6", "data.task=subtraction"])
    with pytest.raises(ConfigError, match="sft.teacher_carry_drop"):
        load_config(CONFIG, ["sft.teacher_carry_drop=1.0"])


def test_stop_accuracy_needs_checks():
    with pytest.raises(ConfigError, match="sft.stop_accuracy"):
        load_config(CONFIG, ["sft.eval_every=0", "sft.stop_accuracy=0.5"])
    with pytest.raises(ConfigError, match="sft.stop_accuracy"):
        load_config(CONFIG, ["sft.eval_every=10", "sft.stop_accuracy=1.5"])
    with pytest.raises(ConfigError, match="sft.stop_window"):
        load_config(CONFIG, ["sft.stop_window=2"])


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_warm_start_calls_sft_and_never_the_reverse():
    pkg = REPO_ROOT / "megatron_rl"
    assert "megatron_rl.sft" in _imported_modules(pkg / "warm_start.py")
    assert not any(m == "megatron_rl.warm_start" or m.startswith("megatron_rl.warm_start.")
                   for m in _imported_modules(pkg / "sft.py"))
