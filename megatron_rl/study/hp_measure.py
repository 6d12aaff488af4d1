"""Measure a finished run's saved weights in high precision: the policy apart from the precision that measured it.

    megatron-rl hp-measure RUN_DIR [--steps final|all|24,49] [--prompts 64] [--seed 0] [--eval-prompts N] [--own]
    megatron-rl study SPEC --hp-measure [--hp-steps ...] [--hp-own]   # every finished run of a study, then RESULTS.md

A run reports entropy through its learner's forward, sampled reward through its engines' sampling and held-out
greedy accuracy through its engines, all in the arm's own precision (an FP8 arm: FP8 trainer forward, W8A8
engine). For each chosen checkpoint of RUN_DIR (`checkpoints/step_<N>`: the weights after step N, i.e. weight
version N + 1; the final one holds the weights the run's after-RL evaluation used) this tool:

1. converts the checkpoint's model weights to an fp32 HF directory in-process (megatron_rl.convert.megatron_to_hf,
   config and tokenizer files from the HF directory the run's engines started from). These are the master weights
   under optim.params_dtype fp32 (the default); with bf16 parameters they are the bf16 model copy;
2. serves them with embedded engines started like the run's (its rollout.* settings, through
   rollout.launcher.launch_from_config) under a high-precision policy: PrecisionConfig() (no rollout quantization,
   no FP8 KV cache, fp32 weights). One engine set per view serves every step (weights swapped through
   /update_weights_from_disk);
3. measures, with the run's own config.yaml (data files, tokenizer, reward function, sampling settings):
   a. held-out greedy accuracy and malformed fraction: phases.rollout.greedy_eval on the first
      train.eval_max_prompts held-out prompts (or --eval-prompts), the function the run's own evaluation calls;
   b. sampled reward: phases.rollout.generate_samples + phases.reward.score (the run's reward function and
      rollout.n_samples_per_prompt, rollout.sampling) over a fixed seeded set of --prompts TRAINING prompts (the
      distribution the run's reward/mean samples), the same set and sampling seeds at every step and in every arm
      of a study; the mean raw reward (reward/mean's definition);
   c. mean token entropy of those completions under an fp32 HF forward of the same weights (entropy of the
      softmax of the raw logits at every completion position, token mean over all completion tokens: the
      definition of the run's `entropy` metric), and the mean |engine log-prob - fp32 forward log-prob| of the
      sampled tokens (about 1e-6 for a high-precision engine; the rollout's measurement error for an FP8 one).

With --own the same measurements also run through the arm's own engine precision (its precision.* rollout
format and KV cache; entropy still from the fp32 forward) on the same prompts: view "own" beside view "hp".
Results go to RUN_DIR/hp_measure.json, keyed by checkpoint step then view; a (step, view) already there is
skipped (resumable), and measuring with other settings than the file records is refused.

Checkpoints the run's retention deleted (checkpoint.keep_last, 2 by default) cannot be measured: curves need a
run that kept them (raise checkpoint.keep_last in a new study's overrides).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HP_MEASURE_FILE = "hp_measure.json"
"""Per run directory: the measurements, {"settings": ..., "steps": {step: {view: record}}}."""
VIEWS = ("hp", "own")
"""hp: a high-precision engine; own: the arm's own engine precision (rollout format and KV cache)."""
VALUE_FIELDS = ("greedy_accuracy", "greedy_malformed", "reward_mean", "reward_shaped_mean", "sampled_accuracy",
                "sampled_malformed", "entropy", "logprob_gap", "response_len_mean")
"""Numeric fields of one (step, view) record, flattened to '<view>/<field>' for the study report."""
FORMAT_VERSION = 1
"""Version of the hp_measure.json layout."""


# ------------------------------------------------------------------------------------------------ files
def read_measurements(run_dir: str | Path) -> Optional[dict]:
    """The run's hp_measure.json, or None without one."""
    path = Path(run_dir) / HP_MEASURE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def flat_values(record: Optional[dict], step: int) -> dict[str, float]:
    """{'<view>/<field>': value} of checkpoint `step` in a read_measurements() record (empty when not measured)."""
    if not record:
        return {}
    out = {}
    for view, values in (record.get("steps", {}).get(str(step)) or {}).items():
        for key in VALUE_FIELDS:
            v = values.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{view}/{key}"] = float(v)
    return out


def _write_atomic(path: Path, record: dict) -> None:
    """Write JSON through a temporary file and a rename: a killed measurement never leaves a torn file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def settings_record(prompts: int, seed: int, eval_prompts: Optional[int]) -> dict[str, Any]:
    """The settings a measurement file is made with (every (step, view) in one file shares them); ValueError for
    counts below 1."""
    if prompts < 1 or (eval_prompts is not None and eval_prompts < 1):
        raise ValueError(f"prompts ({prompts}) and eval_prompts ({eval_prompts}) must be >= 1")
    return {"prompt_set": "train", "prompts": int(prompts), "seed": int(seed),
            "eval_prompts": None if eval_prompts is None else int(eval_prompts)}


def check_settings(existing: Optional[dict], settings: dict[str, Any], path: Path) -> None:
    """ValueError naming the differing settings when `path` was measured with others than `settings`."""
    if not existing:
        return
    old = existing.get("settings", {})
    diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v]
    if diff:
        raise ValueError(f"{path} was measured with other settings ({'; '.join(diff)}); use the same ones, or delete "
                         "it to measure again")


# ------------------------------------------------------------------------------------------------ steps
def available_steps(run_dir: str | Path) -> list[int]:
    """Steps of the run's complete checkpoints, oldest first."""
    from megatron_rl.trainer.checkpoint import list_checkpoints

    return [step for step, _ in list_checkpoints(Path(run_dir) / "checkpoints")]


def select_steps(which: str, available: Sequence[int]) -> list[int]:
    """Checkpoint steps to measure: 'final' (the newest), 'late' (those of the second half of training, from step
    (final + 1) // 2 - 1 on: what the study reports' late-checkpoint rows average), 'all', or comma-separated steps
    (each must be saved)."""
    if not available:
        raise ValueError("the run has no complete checkpoint to measure")
    if which == "final":
        return [max(available)]
    if which == "late":
        return sorted(s for s in available if s >= (max(available) + 1) // 2 - 1)
    if which == "all":
        return sorted(available)
    try:
        wanted = sorted({int(s) for s in which.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"steps {which!r}: use final, late, all, or comma-separated checkpoint steps") from None
    missing = [s for s in wanted if s not in available]
    if missing or not wanted:
        raise ValueError(f"steps {which!r}: no checkpoint of step(s) {missing or which} (saved: {list(available)})")
    return wanted


def pending(run_dir: str | Path, which: str, views: Sequence[str], settings: dict[str, Any]) -> list[tuple[int, str]]:
    """(step, view) pairs still to measure (ValueError when the file holds other settings or a step is not saved)."""
    run_dir = Path(run_dir)
    existing = read_measurements(run_dir)
    check_settings(existing, settings, run_dir / HP_MEASURE_FILE)
    done = (existing or {}).get("steps", {})
    return [(s, v) for s in select_steps(which, available_steps(run_dir)) for v in views if v not in done.get(str(s), {})]


def prompt_subset(rows: Sequence, count: int, seed: int) -> list:
    """`count` rows drawn without replacement by a seeded generator (all rows, in order, when there are fewer)."""
    import numpy as np

    if count >= len(rows):
        return list(rows)
    return [rows[i] for i in np.random.default_rng(seed).choice(len(rows), size=count, replace=False)]


# ------------------------------------------------------------------------------------------------ the run
def engine_hf_dir(cfg, run_dir: Path) -> Path:
    """The HF directory the run's engines started from (config.json and tokenizer files of the served model)."""
    from megatron_rl.warm_start import is_megatron_checkpoint, sft_dir

    init = cfg.model.init_checkpoint
    if init:
        return run_dir / "init_hf" if is_megatron_checkpoint(init) else Path(init)
    return sft_dir(cfg, run_dir) / "hf"


def view_precision(cfg, view: str):
    """The PrecisionConfig engines of `view` serve under: hp the default (nothing quantized), own the run's."""
    from megatron_rl.config.precision import PrecisionConfig

    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; valid: {', '.join(VIEWS)}")
    return PrecisionConfig() if view == "hp" else cfg.precision


def serves_high_precision(precision) -> bool:
    """True when engines under `precision` serve exactly what the hp view serves (no rollout format, no FP8 KV cache)."""
    from megatron_rl.precision.rollout_formats import rollout_format

    return rollout_format(precision).quantization_config is None and precision.kv_cache_dtype == "auto"


def measurement_rollout(cfg):
    """The run's rollout settings for engines this tool starts: free ports, no key, never colocated (no learner)."""
    if cfg.rollout.engine not in ("embedded", "sglang"):
        raise ValueError(f"rollout.engine={cfg.rollout.engine}: hp-measure starts its own engines (embedded or sglang); "
                         "it cannot load weights into external servers")
    return cfg.rollout.model_copy(update={"base_port": 0, "api_key": None, "placement": "disaggregated",
                                          "colocate_offload": False})


class ViewEngines:
    """The engines of one view, started at the first step's weights and swapped to each later step's."""

    def __init__(self, cfg, view: str, tokenizer_dir: Path, log_dir: Path) -> None:
        """Nothing starts until `serve`."""
        self.cfg, self.view, self.precision = cfg, view, view_precision(cfg, view)
        self.rollout = measurement_rollout(cfg)
        self.tokenizer_dir, self.log_dir = tokenizer_dir, log_dir
        self.cluster = self.client = self.workers = None

    def serve(self, hf_dir: Path, step: int, work: Path) -> dict[str, Any]:
        """Serve the fp32 HF weights `hf_dir` in this view's format; returns what the engines serve."""
        from megatron_rl.precision.rollout_formats import checkpoint_format, read_config, write_launch_checkpoint
        from megatron_rl.rollout.client import RolloutClient
        from megatron_rl.rollout.launcher import launch_from_config

        # the weights in this view's rollout format (hp: the fp32 directory itself), built as the run's launch was
        path = write_launch_checkpoint(str(hf_dir), self.precision, str(work / f"launch_{self.view}"))
        if self.cluster is None:
            self.cluster = launch_from_config(self.rollout, path, tokenizer_path=str(self.tokenizer_dir),
                                              log_dir=str(self.log_dir / self.view), precision=self.precision,
                                              launch_dir=str(work / f"launch_{self.view}"))
            self.client = RolloutClient.from_config(self.rollout, self.cluster.generate_urls)
            self.client.wait_until_healthy_sync(self.rollout.startup_timeout_s)
            self.workers = RolloutClient(self.cluster.worker_urls, request_timeout_s=self.rollout.weight_sync.timeout_s)
        else:
            self.workers.update_weights_from_disk_sync(path, weight_version=str(step + 1))
        config = read_config(path)
        info = self.workers.server_info_sync()[0]
        return {"served_dir_format": checkpoint_format(config) or "none",
                "quantization_config": config.get("quantization_config"),
                "dtype": config.get("dtype") or config.get("torch_dtype"), "kv_cache_dtype": info.get("kv_cache_dtype"),
                "engine": info.get("engine", info.get("version")), "deterministic": info.get("enable_deterministic_inference")}

    def close(self) -> None:
        """Stop the engines."""
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def forward_stats(model, samples: Sequence, pad_id: int) -> dict[str, float]:
    """Token-mean entropy of the softmax at every completion position under `model`'s forward, the mean |engine
    log-prob - forward log-prob| of the sampled tokens, and the completion-token count."""
    import torch

    from megatron_rl.phases.batching import build_train_batch

    if not samples:
        return {"entropy": math.nan, "logprob_gap": math.nan, "completion_tokens": 0}
    # the batch is built on the host, as the run builds its step batch; each chunk moves to the model's device
    batch = build_train_batch(samples, torch.zeros(len(samples)), pad_id)  # device-ok: host-side batch
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples])  # device-ok: host-side batch
    device = next(model.parameters()).device
    b, seq = batch.input_ids.shape
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rows = max(1, (1 << 25) // max(1, seq * vocab))  # about 128 MB of fp32 logits at a time
    ent_sum = gap_sum = 0.0
    count = 0
    with torch.inference_mode():
        for lo in range(0, b, rows):
            part = slice(lo, lo + rows)
            ids = batch.input_ids[part].to(device)
            attn = (torch.arange(seq, device=device)[None, :] < lengths[part, None].to(device)).long()
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
            mask = batch.loss_mask[part].to(device) > 0
            entropy = -(logp.exp() * logp).sum(-1)
            token_lp = logp.gather(-1, batch.labels[part, :, None].to(device))[..., 0]
            ent_sum += float(entropy[mask].double().sum())
            gap_sum += float((token_lp - batch.rollout_logprobs[part].to(device))[mask].abs().double().sum())
            count += int(mask.sum())
    return {"entropy": ent_sum / count if count else math.nan, "logprob_gap": gap_sum / count if count else math.nan,
            "completion_tokens": count}


def samples_digest(samples: Sequence) -> str:
    """sha256 of the sampled completions' token ids (equal digests: the same samples)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps(list(s.response_ids)).encode())
    return h.hexdigest()


def measure_view(engines: ViewEngines, hf_dir: Path, step: int, work: Path, data: dict[str, Any], model) -> dict[str, Any]:
    """One (step, view) record: greedy held-out evaluation, sampled reward, fp32-forward entropy, what was served."""
    from megatron_rl.phases import reward, rollout

    cfg, t0 = engines.cfg, time.perf_counter()
    served = engines.serve(hf_dir, step, work)
    max_new = cfg.rollout.sampling.max_new_tokens
    greedy = rollout.greedy_eval(engines.client, data["tokenizer"], data["eval_rows"], data["reward_fn"], max_new,
                                 data["is_malformed"])
    batch = rollout.generate_samples(engines.client, data["tokenizer"], data["prompts"], cfg.rollout, seed=data["seed"])
    scored = reward.score(batch, data["reward_fn"], cfg.algo, max_new, data["is_malformed"])
    out = {"weight_version": step + 1, "greedy_accuracy": greedy["accuracy"], "eval_prompts": len(data["eval_rows"]),
           "reward_mean": scored["reward/mean"], "reward_shaped_mean": scored["reward/shaped_mean"],
           "sampled_accuracy": scored["accuracy/train"], "prompts": len(data["prompts"]),
           "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
           "response_len_mean": batch.stats["rollout/response_len_mean"], "truncated_frac": batch.stats["rollout/truncated_frac"],
           "samples_sha256": samples_digest(batch.samples), "engine": served}
    if "malformed" in greedy:
        out["greedy_malformed"] = greedy["malformed"]
    if "malformed/train" in scored:
        out["sampled_malformed"] = scored["malformed/train"]
    out.update(forward_stats(model, batch.samples, data["tokenizer"].pad_token_id))
    out["wall_s"] = time.perf_counter() - t0
    return out


def load_run_data(cfg, run_dir: Path, prompts: int, seed: int, eval_prompts: Optional[int]) -> dict[str, Any]:
    """Tokenizer, held-out rows, the measurement prompts, reward function and format check, as the run read them."""
    from megatron_rl.data.tasks import malformed_checker
    from megatron_rl.reward import get_reward_fn
    from megatron_rl.runtime import load_datasets

    tokenizer, train_rows, eval_rows = load_datasets(cfg, run_dir)
    limit = cfg.train.eval_max_prompts if eval_prompts is None else eval_prompts
    return {"tokenizer": tokenizer, "eval_rows": eval_rows[:limit], "prompts": prompt_subset(train_rows, prompts, seed),
            "reward_fn": get_reward_fn(cfg.data.reward), "is_malformed": malformed_checker(train_rows), "seed": seed}


def measure_run(run_dir: str | Path, which: str = "final", views: Sequence[str] = ("hp",), prompts: int = 64,
                seed: int = 0, eval_prompts: Optional[int] = None, say: Callable[[str], None] = print) -> dict:
    """Measure the chosen checkpoints of a run in every view (skipping what RUN_DIR/hp_measure.json holds); returns
    the file's record."""
    from megatron_rl.config import load_config
    from megatron_rl.convert import megatron_to_hf
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.parallel import state
    from megatron_rl.trainer.checkpoint import step_dir_name

    import torch

    run_dir = Path(run_dir)
    unknown = [v for v in views if v not in VIEWS]
    if unknown:
        raise ValueError(f"unknown view(s) {unknown}; valid: {', '.join(VIEWS)}")
    settings = settings_record(prompts, seed, eval_prompts)
    todo = pending(run_dir, which, views, settings)
    path = run_dir / HP_MEASURE_FILE
    record = read_measurements(run_dir) or {"format": FORMAT_VERSION, "settings": settings, "steps": {}}
    if not todo:
        say(f"{run_dir}: nothing to measure (steps {which}, views {', '.join(views)} already in {path.name})")
        return record
    cfg = load_config(run_dir / "config.yaml", check_layout=False, check_device=False)  # no learner runs here
    base = engine_hf_dir(cfg, run_dir)
    data = load_run_data(cfg, run_dir, prompts, seed, eval_prompts)
    record["settings"] = {**settings, "prompts_used": len(data["prompts"]), "eval_prompts_used": len(data["eval_rows"]),
                          "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
                          "sampling": cfg.rollout.sampling.model_dump(mode="json")}
    scratch = run_dir / "hp_measure_work"
    engines = {v: ViewEngines(cfg, v, base, scratch / "logs") for v in views}
    try:
        for step in sorted({s for s, _ in todo}):
            work = scratch / f"step_{step}"
            shutil.rmtree(work, ignore_errors=True)
            hf = Path(megatron_to_hf(str(run_dir / "checkpoints" / step_dir_name(step)), str(work / "hf"), dtype="fp32",
                                     hf_config_dir=str(base)))
            model = load_hf_model(str(hf), dtype=torch.float32)
            for view in sorted((v for s, v in todo if s == step), key=VIEWS.index):
                hp_entry = record["steps"].get(str(step), {}).get("hp")
                if view == "own" and hp_entry is not None and serves_high_precision(cfg.precision):
                    # the arm's engines already run in high precision (e.g. NVFP4 arms, rolled out unquantized)
                    entry = {**hp_entry, "same_as": "hp", "wall_s": 0.0}
                else:
                    entry = measure_view(engines[view], hf, step, work, data, model)
                record["steps"].setdefault(str(step), {})[view] = entry
                _write_atomic(path, record)
                say(f"{run_dir} step {step} {view}: greedy {entry['greedy_accuracy']:.4f}, reward {entry['reward_mean']:.4f}, "
                    f"entropy {entry['entropy']:.4f}, log-prob gap {entry['logprob_gap']:.2e} "
                    f"(served {entry['engine']['served_dir_format']}, kv {entry['engine']['kv_cache_dtype']}; "
                    f"{entry['wall_s']:.0f} s)")
            del model
            shutil.rmtree(work, ignore_errors=True)
    finally:
        for e in engines.values():
            e.close()
        state.destroy_distributed()  # the checkpoint reader's world of one
    shutil.rmtree(scratch, ignore_errors=True)
    return record
