"""How the low-precision log-prob and log-ratio error grows with depth and with position in the answer.

    python tools/logratio_depth.py examples/configs/deep_addtrace_base.yaml --out runs/depth_error \
        [--depths 2 4 8 16] [--recipes tensorwise blockwise nvfp4] [--seed 1] [--prompts 16] [--samples 8]

For each depth d: a warm start of the config's model with model.num_layers=d (same width, same data, same SFT
steps; `megatron-rl sft` in a subprocess with pinned kernels, made once under OUT/depth<d>/ and reused), its
held-out greedy accuracy, and one batch of sampled answers (prompts x samples, the high-precision engine at
the config's sampling temperature, seeded by --seed). Then for each recipe a learner holding the warm start's
weights measures, per answer token:

- `dlogp`: log p_lp - log p_hp of the token at the same weights (the forward error of low precision);
- `dlr`: (log r_lp - log r_hp) after one low-precision GRPO update on the batch (advantages from the exact-match
  rewards, the config's loss and learning rate): the ratio error the clip decision of the first off-policy
  update sees, r = p(after) / p(before) in each precision.

- `hidden`: the relative error ||h_lp - h_hp|| / ||h_hp|| of the residual stream after every transformer layer
  (the same forward, answer tokens only): how the error grows through the layers of one model, free of how
  confident that model's outputs are (a confident model's log-probs sit near 0 in both precisions, whatever its
  hidden error).

dlogp and dlr are bucketed by the token's position in the answer (0 = first generated token) and by the
high-precision probability of the token (confidence), and reported as mean |.| and the 50/90/99% quantiles of
|.|, plus the mean signed error. Output: OUT/error_seed<seed>.json (every
number), OUT/error_seed<seed>.md (tables) and OUT/error_seed<seed>.png (mean |dlogp| and |dlr| against
position, one line per depth, one panel per recipe). Deterministic: the same seed gives the same numbers.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

DEFAULT_DEPTHS = (2, 4, 8, 16)
DEFAULT_RECIPES = ("tensorwise", "blockwise", "nvfp4")
RECIPE_OVERRIDES: dict[str, dict[str, Any]] = {
    "tensorwise": {"recipe": "tensorwise"},
    "blockwise": {"recipe": "blockwise"},
    "mxfp8": {"recipe": "mxfp8"},
    "nvfp4": {"recipe": "nvfp4", "fp4_hadamard_wgrad": True, "fp4_stochastic_rounding": True},
    "mxfp4": {"recipe": "mxfp4", "fp4_hadamard_wgrad": True, "fp4_stochastic_rounding": True},
}
"""Learner precision of each recipe name (the study arms' settings; rollouts are not involved here)."""
QUANTILES = (50, 90, 99)
"""Quantiles of |error| reported per bucket (percent)."""
PROB_EDGES = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0001)
"""Buckets of the token's high-precision probability p_hp (the model's confidence in it)."""


def position_buckets(max_len: int, width: int) -> list[tuple[int, int]]:
    """[lo, hi) answer-position buckets of `width` tokens covering 0..max_len-1."""
    return [(lo, min(lo + width, max_len)) for lo in range(0, max_len, width)]


def bucket_stats(err: np.ndarray, pos: np.ndarray, buckets: Sequence[tuple[int, int]]) -> list[dict[str, float]]:
    """Per bucket: tokens, mean |err|, quantiles of |err|, mean err (nan where a bucket is empty)."""
    out = []
    for lo, hi in buckets:
        e = err[(pos >= lo) & (pos < hi)]
        row = {"lo": lo, "hi": hi, "n": int(e.size), "mean_abs": float(np.abs(e).mean()) if e.size else math.nan,
               "mean": float(e.mean()) if e.size else math.nan}
        for q in QUANTILES:
            row[f"q{q}"] = float(np.percentile(np.abs(e), q)) if e.size else math.nan
        out.append(row)
    return out


def prob_bucket_stats(err: np.ndarray, p_hp: np.ndarray) -> list[dict[str, float]]:
    """Per p_hp bucket [lo, hi): tokens and mean |err|."""
    out = []
    for lo, hi in zip(PROB_EDGES, PROB_EDGES[1:]):
        e = err[(p_hp >= lo) & (p_hp < hi)]
        out.append({"lo": lo, "hi": min(hi, 1.0), "n": int(e.size), "mean_abs": float(np.abs(e).mean()) if e.size else math.nan})
    return out


def summary_stats(err: np.ndarray) -> dict[str, float]:
    """Whole-answer statistics of one error array."""
    row = {"n": int(err.size), "mean_abs": float(np.abs(err).mean()) if err.size else math.nan,
           "mean": float(err.mean()) if err.size else math.nan, "std": float(err.std()) if err.size else math.nan}
    for q in QUANTILES:
        row[f"q{q}"] = float(np.percentile(np.abs(err), q)) if err.size else math.nan
    return row


# ---------------------------------------------------------------------------------------------------------
# warm starts (subprocesses) and sampling (in-process engine)
# ---------------------------------------------------------------------------------------------------------

def warm_start(config: Path, out: Path, depth: int, data: dict[str, str], say: Callable[[str], None]) -> Path:
    """OUT/depth<d>/sft/hf: the config's SFT at `depth` layers on the shared data (reused when present)."""
    from megatron_rl.cpu_kernels import pinned_env

    run_dir = out / f"depth{depth}"
    hf = run_dir / "sft" / "hf"
    if (hf / "model.safetensors").exists():
        return hf
    overrides = [f"model.num_layers={depth}", f"run_dir={run_dir}", f"data.train_file={data['train']}",
                 f"data.eval_file={data['eval']}", f"data.tokenizer_dir={data['tokenizer']}"]
    env = pinned_env(__import__("os").environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    say(f"depth {depth}: SFT warm start -> {hf}")
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "sft.log").open("a") as log:
        rc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "sft", str(config), *overrides], env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (hf / "model.safetensors").exists():
        raise RuntimeError(f"SFT at depth {depth} failed (rc={rc}); see {run_dir / 'sft.log'}")
    (run_dir / "sft_wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return hf



def scored_batch(hf: Path, rows, cfg, samples: int, seed: int, reward_fn, pad_token_id: int):
    """(samples, train batch): `samples` answers per prompt of `rows` sampled by `sample_answers`, rewarded, with the
    config's GRPO advantages, as the learner's train batch."""
    import torch

    from megatron_rl.algo.advantages import compute_advantages
    from megatron_rl.phases.batching import build_train_batch

    smp, _ = sample_answers(hf, rows, cfg, samples, seed)
    for s in smp:
        s.reward, s.correct = reward_fn(s.response_text, s.answer)
    adv = compute_advantages(torch.tensor([s.reward for s in smp], dtype=torch.float32), samples,
                             cfg.algo.advantage.estimator, std_eps=cfg.algo.advantage.std_eps,
                             unbiased_std=cfg.algo.advantage.unbiased_std)
    return smp, build_train_batch(smp, adv, pad_token_id, 16, None)


def sample_answers(hf: Path, rows, cfg, n: int, seed: int):
    """Samples (types.Sample, prompt-major groups of n) from the high-precision engine at the config's sampling settings."""
    from megatron_rl.engine.generation import Engine, GenerationRequest, SamplingParams
    from megatron_rl.parallel.compat import compat_mode_suspended
    from megatron_rl.types import Sample

    engine = Engine(str(hf), tokenizer_path=str(hf))
    tok = engine.tokenizer
    s = cfg.rollout.sampling
    reqs = []
    for i, row in enumerate(rows):
        ids = tok(row.prompt, add_special_tokens=False)["input_ids"]
        params = SamplingParams.from_dict({"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                           "max_new_tokens": s.max_new_tokens, "sampling_seed": seed * 100_003 + i})
        reqs.append(GenerationRequest(input_ids=ids, params=params))
    samples = []
    with compat_mode_suspended():  # the learner of this process installed the CPU compat mode; generation needs none
        outputs = engine.generate(reqs)
    for gid, (row, req, outs) in enumerate(zip(rows, reqs, outputs)):
        for o in outs:
            text = tok.decode(o.output_ids, skip_special_tokens=True)
            samples.append(Sample(prompt_ids=req.input_ids, response_ids=list(o.output_ids), rollout_logprobs=list(o.logprobs),
                                  finish_reason=o.finish_reason.get("type", ""), group_id=gid, answer=row.answer,
                                  response_text=text))
    return samples, tok


def greedy_accuracy(hf: Path, rows, reward_fn, is_malformed, max_new_tokens: int) -> dict[str, float]:
    """Held-out greedy accuracy (and malformed fraction) of an HF export, through the high-precision engine."""
    from megatron_rl.engine.generation import Engine, GenerationRequest, SamplingParams
    from megatron_rl.parallel.compat import compat_mode_suspended

    engine = Engine(str(hf), tokenizer_path=str(hf))
    tok = engine.tokenizer
    params = SamplingParams.from_dict({"n": 1, "temperature": 0.0, "max_new_tokens": max_new_tokens})
    reqs = [GenerationRequest(input_ids=tok(r.prompt, add_special_tokens=False)["input_ids"], params=params) for r in rows]
    with compat_mode_suspended():
        outputs = engine.generate(reqs)
    texts = [tok.decode(outs[0].output_ids, skip_special_tokens=True) for outs in outputs]
    out = {"accuracy": sum(reward_fn(t, r.answer)[1] for t, r in zip(texts, rows)) / len(rows)}
    if is_malformed is not None:
        out["malformed"] = sum(is_malformed(t) for t in texts) / len(rows)
    return out


# ---------------------------------------------------------------------------------------------------------
# the measurement (in-process learners, world of one)
# ---------------------------------------------------------------------------------------------------------

class LayerTap:
    """Forward hooks that keep every transformer layer's output hidden states ([s, b, h] per micro-batch)."""

    def __init__(self, learner) -> None:
        """Hook every decoder layer of the learner's (single) model chunk."""
        from megatron_rl.trainer.model import unwrap

        self.outputs: dict[int, list] = {}
        layers = unwrap(learner.model[0]).decoder.layers
        self.handles = [layer.register_forward_hook(self._keep(i)) for i, layer in enumerate(layers)]

    def _keep(self, index: int):
        def hook(module, inputs, output):
            self.outputs.setdefault(index, []).append((output[0] if isinstance(output, tuple) else output).detach().float())
        return hook

    def take(self) -> list:
        """[layers] of [b, s, h] hidden states of the forwards since the last take()."""
        import torch

        out = [torch.cat([h.transpose(0, 1) for h in self.outputs[i]]) for i in sorted(self.outputs)]
        self.outputs = {}
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()


def measure_recipe(cfg, depth: int, recipe: str, hf: Path, batch, vocab: int) -> dict[str, np.ndarray]:
    """Per answer token of `batch`: dlogp at the warm start's weights, the hidden-state error after every layer,
    and dlr after one low-precision update."""
    import torch

    from megatron_rl.config.model import ModelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.phases.batching import agg_max_len, with_token_weights
    from megatron_rl.phases.loss import RLLoss
    from megatron_rl.precision import high_precision
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import load_initial_weights

    model = ModelConfig(**{**cfg.model.model_dump(), "num_layers": depth, "init_checkpoint": None})
    precision = PrecisionConfig(**{**cfg.precision.model_dump(), **RECIPE_OVERRIDES[recipe], "rollout_quantization": "none"})
    learner = Learner(model, cfg.parallel, cfg.optim, precision, vocab_size=vocab, seed=cfg.train.seed, total_steps=1)
    load_initial_weights(learner, str(hf))
    mbs = math.gcd(batch.batch_size, cfg.train.micro_batch_size)
    tap = LayerTap(learner)
    with torch.no_grad():
        lp0, _ = learner.forward_logprobs(batch, mbs)
        h_lp = tap.take()
        with high_precision():
            hp0, _ = learner.forward_logprobs(batch, mbs)
        h_hp = tap.take()
    tap.close()
    # one GRPO update in low precision, as the first mini-batch of an RL step trains (on-policy: pi_old = pi)
    mb = with_token_weights(batch.with_fields(old_logprobs=lp0.detach()), cfg.algo.policy_loss.agg_mode, agg_max_len(cfg))
    learner.train_step(mb, RLLoss(cfg.algo), mbs)
    with torch.no_grad():
        lp1, _ = learner.forward_logprobs(batch, mbs)
        with high_precision():
            hp1, _ = learner.forward_logprobs(batch, mbs)
    mask = batch.loss_mask > 0
    pos = (torch.cumsum(mask.long(), dim=1) - 1)[mask]
    dlogp = (lp0 - hp0)[mask]
    dlr = ((lp1 - lp0) - (hp1 - hp0))[mask]
    drift = (hp1 - hp0)[mask]
    # relative residual-stream error after each layer, per answer token: [layers, tokens]
    hidden = torch.stack([((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12))[mask] for a, b in zip(h_lp, h_hp)])
    return {"pos": pos.cpu().numpy(), "dlogp": dlogp.double().cpu().numpy(), "dlr": dlr.double().cpu().numpy(),
            "hp_log_ratio": drift.double().cpu().numpy(), "p_hp": hp0[mask].exp().double().cpu().numpy(),
            "hidden": hidden.double().cpu().numpy()}


def run(config: Path, out: Path, depths: Sequence[int], recipes: Sequence[str], seed: int, prompts: int, samples: int,
        bucket_width: int = 5, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole measurement; writes OUT/error_seed<seed>.{json,md,png} and returns the JSON record."""
    from megatron_rl.config import load_config
    from megatron_rl.config.model import ParallelConfig
    from megatron_rl.data.prepare import prepare_task_data
    from megatron_rl.data.sources import load_prompts
    from megatron_rl.data.tasks import malformed_checker
    from megatron_rl.parallel import state
    from megatron_rl.reward import get_reward_fn
    from megatron_rl.warm_start import model_vocab_size

    for r in recipes:
        if r not in RECIPE_OVERRIDES:
            raise ValueError(f"unknown recipe {r!r}; valid: {sorted(RECIPE_OVERRIDES)}")
    t_start = time.perf_counter()
    cfg = load_config(config, [f"run_dir={out}"])
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_task_data(cfg.data, out / "data")
    warm = {d: warm_start(config, out, d, data, say) for d in depths}
    from megatron_rl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data["tokenizer"])
    train_rows = load_prompts(data["train"], cfg.data, tokenizer, generated=True)
    eval_rows = load_prompts(data["eval"], cfg.data, tokenizer, generated=True)[: cfg.train.eval_max_prompts]
    is_malformed, reward_fn = malformed_checker(train_rows), get_reward_fn(cfg.data.reward)
    rng = np.random.default_rng(seed)
    rows = [train_rows[i] for i in rng.choice(len(train_rows), size=prompts, replace=False)]
    state.init_distributed(ParallelConfig(logprob_chunk_size=cfg.parallel.logprob_chunk_size), cfg.train.seed)
    record: dict[str, Any] = {"config": str(config), "seed": seed, "prompts": prompts, "samples": samples,
                              "depths": list(depths), "recipes": list(recipes), "bucket_width": bucket_width, "by_depth": {}}
    try:
        for d in depths:
            hf = warm[d]
            t0 = time.perf_counter()
            acc = greedy_accuracy(hf, eval_rows, reward_fn, is_malformed, cfg.rollout.sampling.max_new_tokens)
            smp, batch = scored_batch(hf, rows, cfg, samples, seed, reward_fn, tokenizer.pad_token_id)
            max_len = int(batch.loss_mask.sum(dim=1).max())
            buckets = position_buckets(max_len, bucket_width)
            entry: dict[str, Any] = {"eval": acc, "sample_reward": float(np.mean([s.reward for s in smp])),
                                     "sample_malformed": float(np.mean([is_malformed(s.response_text) for s in smp]))
                                     if is_malformed else math.nan, "answer_len_mean": float(batch.loss_mask.sum(1).mean()),
                                     "recipes": {}}
            for r in recipes:
                m = measure_recipe(cfg, d, r, hf, batch, model_vocab_size(str(hf), tokenizer))
                entry["recipes"][r] = {
                    "dlogp": {"all": summary_stats(m["dlogp"]), "buckets": bucket_stats(m["dlogp"], m["pos"], buckets),
                              "by_prob": prob_bucket_stats(m["dlogp"], m["p_hp"])},
                    "dlr": {"all": summary_stats(m["dlr"]), "buckets": bucket_stats(m["dlr"], m["pos"], buckets),
                            "by_prob": prob_bucket_stats(m["dlr"], m["p_hp"])},
                    "hp_log_ratio": summary_stats(m["hp_log_ratio"]),
                    "hidden_by_layer": [float(v) for v in m["hidden"].mean(axis=1)],
                    "hidden_last_buckets": bucket_stats(m["hidden"][-1], m["pos"], buckets),
                }
                say(f"depth {d:>2} {r:<10}: mean |dlogp| {entry['recipes'][r]['dlogp']['all']['mean_abs']:.4f}, "
                    f"mean |dlr| {entry['recipes'][r]['dlr']['all']['mean_abs']:.4f}")
            entry["wall_s"] = time.perf_counter() - t0
            record["by_depth"][str(d)] = entry
    finally:
        state.destroy_distributed()
    record["wall_s"] = time.perf_counter() - t_start
    record["sft_wall_s"] = {str(d): _read_float(out / f"depth{d}" / "sft_wall_s.txt") for d in depths}
    stem = out / f"error_seed{seed}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(markdown(record))
    plot(record, stem.with_suffix(".png"))
    return record


def _read_float(path: Path) -> float:
    return float(path.read_text()) if path.exists() else math.nan


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def markdown(record: dict[str, Any]) -> str:
    """Tables of a record: per depth and recipe the whole-answer numbers, then mean |error| per position bucket."""
    depths, recipes = record["depths"], record["recipes"]
    lines = [f"# Low-precision error by depth and answer position (seed {record['seed']}, "
             f"{record['prompts']} prompts x {record['samples']} samples)", "",
             "| depth | held-out acc (hp) | malformed (sampled) | recipe | mean abs dlogp | q50 / q90 / q99 abs dlogp | "
             "mean abs dlr | q50 / q90 / q99 abs dlr | mean abs hp log-ratio (update size) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in depths:
        e = record["by_depth"][str(d)]
        for r in recipes:
            x = e["recipes"][r]
            p, q = x["dlogp"]["all"], x["dlr"]["all"]
            lines.append(f"| {d} | {100 * e['eval']['accuracy']:.1f}% | {100 * e['sample_malformed']:.1f}% | {r} | "
                         f"{p['mean_abs']:.4f} | {p['q50']:.4f} / {p['q90']:.4f} / {p['q99']:.4f} | {q['mean_abs']:.4f} | "
                         f"{q['q50']:.4f} / {q['q90']:.4f} / {q['q99']:.4f} | {x['hp_log_ratio']['mean_abs']:.4f} |")
    for key, title in (("dlogp", "mean |dlogp| (same weights)"), ("dlr", "mean |dlr| (after one update)")):
        for r in recipes:
            first = record["by_depth"][str(depths[0])]["recipes"][r][key]["buckets"]
            heads = [f"{b['lo']}-{b['hi'] - 1}" for b in first]
            lines += ["", f"**{title}, {r}, by answer position**", "", "| depth | " + " | ".join(heads) + " |",
                      "|---|" + "---|" * len(heads)]
            for d in depths:
                bs = record["by_depth"][str(d)]["recipes"][r][key]["buckets"]
                lines.append(f"| {d} | " + " | ".join(f"{b['mean_abs']:.4f}" if b["n"] else "" for b in bs) + " |")
    layers = max(depths)
    lines += ["", "**relative hidden-state error ||h_lp - h_hp|| / ||h_hp|| after layer l (mean over answer tokens)**", "",
              "| depth | recipe | " + " | ".join(str(i + 1) for i in range(layers)) + " |", "|---|---|" + "---|" * layers]
    for d in depths:
        for r in recipes:
            v = record["by_depth"][str(d)]["recipes"][r]["hidden_by_layer"]
            lines.append(f"| {d} | {r} | " + " | ".join(f"{x:.4f}" for x in v) + " |" * (layers - len(v)) + " |")
    first = record["by_depth"][str(depths[0])]["recipes"][recipes[0]]["dlogp"]["by_prob"]
    heads = [f"p_hp {b['lo']:g}-{b['hi']:g}" for b in first]
    lines += ["", "**mean |dlogp| by the token's high-precision probability (tokens in brackets)**", "",
              "| depth | recipe | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for d in depths:
        for r in recipes:
            bs = record["by_depth"][str(d)]["recipes"][r]["dlogp"]["by_prob"]
            lines.append(f"| {d} | {r} | " + " | ".join(f"{b['mean_abs']:.4f} ({b['n']})" if b["n"] else "" for b in bs) + " |")
    lines += ["", f"Wall time: {record['wall_s']:.0f} s (measurement; SFT warm starts: "
              + ", ".join(f"depth {d}: {record['sft_wall_s'][str(d)]:.0f} s" for d in depths) + ").", ""]
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    """Mean |dlogp| (top) and |dlr| (bottom) against answer position; one panel per recipe, one line per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths, recipes = record["depths"], record["recipes"]
    fig, axes = plt.subplots(3, len(recipes), figsize=(4.2 * len(recipes), 9.6), squeeze=False)
    for col, r in enumerate(recipes):
        ax = axes[2][col]
        for d in depths:
            v = record["by_depth"][str(d)]["recipes"][r]["hidden_by_layer"]
            ax.plot(range(1, len(v) + 1), v, marker="o", ms=3, label=f"{d} layers")
        ax.set_yscale("log")
        ax.set_title(f"{r}: relative hidden error after layer l", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    for row, (key, label) in enumerate((("dlogp", "mean |dlogp| (same weights)"), ("dlr", "mean |dlr| (after 1 update)"))):
        for col, r in enumerate(recipes):
            ax = axes[row][col]
            for d in depths:
                bs = [b for b in record["by_depth"][str(d)]["recipes"][r][key]["buckets"] if b["n"]]
                ax.plot([(b["lo"] + b["hi"] - 1) / 2 for b in bs], [b["mean_abs"] for b in bs], marker="o", ms=3,
                        label=f"{d} layers")
            ax.set_yscale("log")
            ax.set_title(f"{r}: {label}", fontsize=9)
            ax.set_xlabel("position in the answer (tokens)")
            ax.grid(alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
