"""Where the low-precision log-ratio error comes from: GEMMs and layers, tokens, sequences, and the change of scales.

    python tools/ratio_error_sources.py CONFIG --out OUT [overrides...] [--seed 51] [--prompts 16] [--samples 8]
        [--warm-start RUN_DIR]

One batch of sampled answers (the high-precision engine at the config's sampling settings, as
study/precision_error.py samples them) and one low-precision GRPO update of the config's learner from its warm start
fix theta_old (the warm start) and theta (after the update). The per-token error is

    e = (log p_lp(theta) - log p_lp(theta_old)) - (log p_hp(theta) - log p_hp(theta_old))

the error of the log-ratio the clip decision of the first off-policy update sees. Every variant below forwards the
same two weight sets, so the variants differ only in how the forwards quantize:

(a) GEMMs: one transformer layer (or one GEMM role, all layers: qkv, proj, fc1, fc2) in high precision with the rest
    in low precision, and only that layer (role) in low precision with the rest in high precision. The LM head
    (output_layer) is a plain megatron linear in every recipe here: it is never quantized, so it has no row.
(b) tokens: buckets of the high-precision probability of the token at theta_old, of the high-precision entropy there,
    and of the position in the answer; per bucket the mean |e|, its share of sum e^2 and of the tail (|e| above the
    whole batch's 99th percentile of |e|), and the bucket's tail rate.
(c) sequences: the share of sum e^2, of sum |e| and of the tail tokens held by the 1/5/10% of answers with the most
    squared error.
(d) the change of quantization: theta's low-precision forward with theta_old's per-tensor scales (weights and
    activations, each GEMM operand's amax recorded in theta_old's forward of the same micro-batch;
    precision/scale_book.py), with only the weights' and only the activations' scales reused; what is left is the
    rounding of what moved. Per-tensor recipes only (tensorwise); other recipes leave the (d) rows out.
(e) free predictors: the share of sum e^2 and of the tail held by the 10% of answers a selector ranks first from
    what an FP8 run already has before its updates (the FP8 forward's entropy at theta_old summed or maxed over the
    answer, the summed |rollout engine log-prob - FP8 learner log-prob|), beside the oracle (sum e^2) and chance.
    This is what a targeted high-precision decision (algo.calibration.strength=targeted) can reach.

Output: OUT/ratio_error_sources_seed<seed>.json (every number) and .md (the tables, with the command).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from megatron_rl.precision.scale_book import ScaleBook
from megatron_rl.study.precision_error import PROB_EDGES, position_buckets, scored_batch, warm_start

ROLES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj", "fc1": "mlp.linear_fc1",
         "fc2": "mlp.linear_fc2"}
"""GEMM roles of a transformer layer (suffix of the module name under decoder.layers.<i>.)."""
ENTROPY_EDGES = (0.0, 0.01, 0.1, 0.3, 1.0, math.inf)
"""Buckets of the high-precision entropy (nats) of the next-token distribution at theta_old."""
TOP_SEQUENCE_SHARES = (0.01, 0.05, 0.10)
PREDICTOR_TOP_SHARE = 0.10
"""Share of answers a predictor of section (e) picks (the targeted decision's default fraction)."""


class RoleBook(ScaleBook):
    """A ScaleBook whose replay reuses the recorded amaxes of some operand roles only ("weight", "input")."""

    def __init__(self) -> None:
        super().__init__()
        self.roles: tuple[str, ...] = ("weight", "input")

    def amax(self, owner, role, x, given):
        if not self._recording and role not in self.roles:
            return given
        return super().amax(owner, role, x, given)

    @contextlib.contextmanager
    def replaying(self, roles: Sequence[str]) -> Iterator[None]:
        """Replay only `roles` inside the block."""
        outer, self.roles = self.roles, tuple(roles)
        try:
            yield
        finally:
            self.roles = outer


def fp8_linears(learner) -> dict[str, Any]:
    """Name -> module of every low-precision linear of the learner's (single) model chunk."""
    from megatron_rl.precision.linear import _Fp8ParallelMixin
    from megatron_rl.trainer.model import unwrap

    return {name: m for name, m in unwrap(learner.model[0]).named_modules() if isinstance(m, _Fp8ParallelMixin)}


@contextlib.contextmanager
def in_high_precision(modules: Sequence[Any]) -> Iterator[None]:
    """The given low-precision linears compute in high precision inside the block (the others as configured)."""
    from megatron_rl.precision.linear import _Fp8ParallelMixin

    for m in modules:
        m._forward_impl = super(_Fp8ParallelMixin, m)._forward_impl  # the plain megatron GEMM, bound to m
    try:
        yield
    finally:
        for m in modules:
            del m._forward_impl


def variants(names: Sequence[str], num_layers: int) -> list[tuple[str, str, list[str]]]:
    """(group, label, names of the linears in high precision) of every GEMM variant of part (a)."""
    layer = {i: [n for n in names if n.startswith(f"decoder.layers.{i}.")] for i in range(num_layers)}
    role = {r: [n for n in names if n.endswith(suffix)] for r, suffix in ROLES.items()}
    out = [("all", "all low precision", [])]
    out += [("layer hp", f"layer {i} in hp", layer[i]) for i in range(num_layers) if layer[i]]
    out += [("only layer lp", f"only layer {i} in lp", [n for n in names if n not in layer[i]]) for i in range(num_layers) if layer[i]]
    if num_layers > 2:  # precision.first_last_layers_high_precision=1
        out.append(("ends hp", f"layers 0 and {num_layers - 1} in hp", layer[0] + layer[num_layers - 1]))
    out += [("role hp", f"{r} in hp", role[r]) for r in ROLES if role[r]]
    out += [("only role lp", f"only {r} in lp", [n for n in names if n not in role[r]]) for r in ROLES if role[r]]
    return out


# ---------------------------------------------------------------------------------------------------------
# statistics of one error array
# ---------------------------------------------------------------------------------------------------------

def error_stats(e: np.ndarray, tail_threshold: float, base: Optional[np.ndarray] = None) -> dict[str, float]:
    """mean |e|, quantiles of |e|, sum e^2; with the baseline error `base`: the share of its sum e^2 left and the
    share of its tail tokens (|base| > threshold) still in the tail."""
    a = np.abs(e)
    row = {"n": int(e.size), "mean_abs": float(a.mean()), "q50": float(np.percentile(a, 50)),
           "q99": float(np.percentile(a, 99)), "q999": float(np.percentile(a, 99.9)), "max": float(a.max()),
           "sq": float((e ** 2).sum()), "tail_n": int((a > tail_threshold).sum())}
    if base is not None:
        tail = np.abs(base) > tail_threshold
        row["sq_left"] = row["sq"] / max(float((base ** 2).sum()), 1e-300)
        row["tail_left"] = float((a[tail] > tail_threshold).mean()) if tail.any() else math.nan
    return row


def bucket_table(e: np.ndarray, key: np.ndarray, edges: Sequence[float], tail_threshold: float) -> list[dict[str, float]]:
    """Per bucket [lo, hi) of `key`: tokens, mean |e|, share of sum e^2, share of the tail, tail rate."""
    a, tail = np.abs(e), np.abs(e) > tail_threshold
    total_sq, total_tail = max(float((e ** 2).sum()), 1e-300), max(int(tail.sum()), 1)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        m = (key >= lo) & (key < hi)
        n = int(m.sum())
        out.append({"lo": float(lo), "hi": float(hi), "n": n, "token_share": n / max(e.size, 1),
                    "mean_abs": float(a[m].mean()) if n else math.nan, "sq_share": float((e[m] ** 2).sum()) / total_sq,
                    "tail_share": int(tail[m].sum()) / total_tail, "tail_rate": float(tail[m].mean()) if n else math.nan})
    return out


def sequence_concentration(e: np.ndarray, seq: np.ndarray, tail_threshold: float) -> list[dict[str, float]]:
    """Shares of sum e^2, sum |e| and tail tokens held by the top 1/5/10% of sequences ranked by their sum e^2."""
    ids = np.unique(seq)
    sq = np.array([(e[seq == s] ** 2).sum() for s in ids])
    ab = np.array([np.abs(e[seq == s]).sum() for s in ids])
    tl = np.array([(np.abs(e[seq == s]) > tail_threshold).sum() for s in ids])
    order = np.argsort(-sq)
    out = []
    for frac in TOP_SEQUENCE_SHARES:
        k = max(1, int(math.ceil(frac * ids.size)))
        top = order[:k]
        out.append({"top_frac": frac, "sequences": k, "of": int(ids.size), "sq_share": float(sq[top].sum() / max(sq.sum(), 1e-300)),
                    "abs_share": float(ab[top].sum() / max(ab.sum(), 1e-300)),
                    "tail_share": float(tl[top].sum() / max(tl.sum(), 1))})
    out.append({"top_frac": math.nan, "sequences": int((tl > 0).sum()), "of": int(ids.size), "sq_share": math.nan,
                "abs_share": math.nan, "tail_share": 1.0})  # how many answers hold any tail token
    return out


def predictor_capture(e: np.ndarray, seq: np.ndarray, scores: dict[str, np.ndarray], tail_threshold: float,
                      top_share: float = PREDICTOR_TOP_SHARE) -> list[dict[str, float]]:
    """Per predictor (token-level scores, summed per answer, or maxed where the name starts with max), the shares of sum e^2
    and of the tail tokens held by the answers it ranks in its top `top_share`; plus the oracle and chance."""
    ids = np.unique(seq)
    k = max(1, int(round(top_share * ids.size)))
    sq = np.array([(e[seq == s] ** 2).sum() for s in ids])
    tl = np.array([(np.abs(e[seq == s]) > tail_threshold).sum() for s in ids])

    def shares(order: np.ndarray) -> tuple[float, float]:
        top = order[:k]
        return float(sq[top].sum() / max(sq.sum(), 1e-300)), float(tl[top].sum() / max(tl.sum(), 1))

    rows = []
    for name, token_score in [("oracle: sum e^2", None), *scores.items()]:
        if token_score is None:
            per_answer = sq
        else:
            reduce = np.max if name.startswith("max") else np.sum
            per_answer = np.array([reduce(token_score[seq == s]) for s in ids])
        sq_share, tail_share = shares(np.argsort(-per_answer, kind="stable"))
        rows.append({"predictor": name, "answers": k, "of": int(ids.size), "sq_share": sq_share, "tail_share": tail_share})
    rows.append({"predictor": "chance", "answers": k, "of": int(ids.size), "sq_share": k / ids.size, "tail_share": k / ids.size})
    return rows


# ---------------------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------------------

def measure(cfg, hf: Path, batch, vocab: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Every forward of the tool on the warm start (theta_old) and after one low-precision update (theta)."""
    import torch

    from megatron_rl.config.model import ModelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.phases.batching import agg_max_len, with_token_weights
    from megatron_rl.phases.loss import RLLoss
    from megatron_rl.precision import high_precision
    from megatron_rl.precision.scale_book import attach
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import load_initial_weights

    if not cfg.precision.fp8_enabled:
        raise ValueError("the config's learner is high precision (precision.recipe=none): there is no ratio error to split")
    model = ModelConfig(**{**cfg.model.model_dump(), "init_checkpoint": None})
    precision = PrecisionConfig(**{**cfg.precision.model_dump(), "rollout_quantization": "none", "ratio_consistent_scales": False})
    # the update runs at the config's peak lr (a decay or warm-up schedule over one step would give lr 0 or min_lr)
    optim = cfg.optim.model_copy(update={"lr_warmup_steps": 0, "lr_decay_style": "constant"})
    learner = Learner(model, cfg.parallel, optim, precision, vocab_size=vocab, seed=cfg.train.seed, total_steps=1)
    load_initial_weights(learner, str(hf))
    mbs = math.gcd(batch.batch_size, cfg.train.micro_batch_size)
    linears = fp8_linears(learner)
    per_tensor = precision.recipe == "tensorwise"
    book = RoleBook()
    if per_tensor:
        attach(linears.values(), book)
        learner.scale_book = book  # the learner keys each micro-batch's forward in its book
    plan = variants(sorted(linears), learner.arch.num_layers)

    def forward(hp_names: Sequence[str]) -> torch.Tensor:
        with torch.no_grad(), in_high_precision([linears[n] for n in hp_names]):
            return learner.forward_logprobs(batch, mbs)[0]

    t0 = time.perf_counter()
    with torch.no_grad():
        with high_precision():
            hp0, ent0 = learner.forward_logprobs(batch, mbs)
        with book.recording():
            lp0, ent_lp0 = learner.forward_logprobs(batch, mbs)
    with book.paused():
        old = {label: (lp0 if not names else forward(names)) for _, label, names in plan}
        mb = with_token_weights(batch.with_fields(old_logprobs=lp0.detach()), cfg.algo.policy_loss.agg_mode, agg_max_len(cfg))
        update = learner.train_step(mb, RLLoss(cfg.algo), mbs)
        with torch.no_grad(), high_precision():
            hp1, _ = learner.forward_logprobs(batch, mbs)
        new = {label: forward(names) for _, label, names in plan}
    reused = {}
    if per_tensor:
        for label, roles in (("theta_old's scales", ("weight", "input")), ("theta_old's weight scales", ("weight",)),
                             ("theta_old's activation scales", ("input",))):
            with book.replaying(roles):
                reused[label] = forward([])
    if per_tensor and not book.replayed:
        raise RuntimeError("no recorded scale was replayed: the forwards are not keyed by micro-batch")
    say(f"{2 * len(plan) + len(reused) + 3} forwards and one update in {time.perf_counter() - t0:.0f} s")
    mask = batch.loss_mask > 0
    hp_ratio = (hp1 - hp0)[mask]

    def err(lp_new: torch.Tensor, lp_old: torch.Tensor) -> np.ndarray:
        return (((lp_new - lp_old)[mask] - hp_ratio)).double().cpu().numpy()

    rows = torch.arange(batch.batch_size)[:, None].expand_as(mask)
    return {"plan": plan, "errors": {label: err(new[label], old[label]) for _, label, _ in plan},
            "reused": {label: err(lp, lp0) for label, lp in reused.items()},
            "forward_error": (lp0 - hp0)[mask].double().cpu().numpy(),
            "hp_log_ratio": hp_ratio.double().cpu().numpy(), "p_hp": hp0[mask].exp().double().cpu().numpy(),
            "entropy": ent0[mask].double().cpu().numpy(),
            "predictors": {"sum FP8 entropy": ent_lp0[mask].double().cpu().numpy(),
                           "max FP8 entropy": ent_lp0[mask].double().cpu().numpy(),
                           "sum |engine - FP8 learner log-prob|": (batch.rollout_logprobs - lp0)[mask].abs().double().cpu().numpy()},
            "pos": (torch.cumsum(mask.long(), dim=1) - 1)[mask].cpu().numpy(),
            "seq": rows[mask].cpu().numpy(), "recipe": precision.recipe, "num_layers": learner.arch.num_layers,
            "update": {k: float(update[k]) for k in ("grad_norm", "lr", "update_skipped") if k in update}}


def analyse(m: dict[str, Any], bucket_width: int = 5) -> dict[str, Any]:
    """Tables (a)-(d) of one measurement."""
    base = m["errors"]["all low precision"]
    thr = float(np.percentile(np.abs(base), 99))
    gemms = [{"group": g, "label": label, **error_stats(m["errors"][label], thr, base)} for g, label, _ in m["plan"]]
    pos_edges = [lo for lo, _ in position_buckets(int(m["pos"].max()) + 1, bucket_width)] + [int(m["pos"].max()) + 1]
    tokens = {"p_hp": bucket_table(base, m["p_hp"], PROB_EDGES, thr),
              "entropy": bucket_table(base, m["entropy"], ENTROPY_EDGES, thr),
              "position": bucket_table(base, m["pos"], pos_edges, thr)}
    change = [{"label": label, **error_stats(e, thr, base)} for label, e in m["reused"].items()]
    a = np.abs(base)
    return {"tail_threshold": thr, "baseline": error_stats(base, thr), "gemms": gemms, "tokens": tokens,
            "sequences": sequence_concentration(base, m["seq"], thr), "change": change,
            "predictors": predictor_capture(base, m["seq"], m["predictors"], thr),
            "forward_error": error_stats(m["forward_error"], float(np.percentile(np.abs(m["forward_error"]), 99))),
            "hp_log_ratio": error_stats(m["hp_log_ratio"], math.inf),
            "tail_sign": {"positive": float((base[a > thr] > 0).mean()) if (a > thr).any() else math.nan},
            "recipe": m["recipe"], "num_layers": m["num_layers"], "update": m["update"]}


def run(config: Path, out: Path, overrides: Sequence[str], seed: int, prompts: int, samples: int,
        warm: Optional[Path] = None, command: str = "", say: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole measurement; writes OUT/ratio_error_sources_seed<seed>.{json,md} and returns the record."""
    from megatron_rl.config import load_config
    from megatron_rl.config.model import ParallelConfig
    from megatron_rl.data.prepare import prepare_task_data
    from megatron_rl.data.sources import load_prompts
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.parallel import state
    from megatron_rl.reward import get_reward_fn
    from megatron_rl.warm_start import model_vocab_size

    t_start = time.perf_counter()
    cfg = load_config(config, [*overrides, f"run_dir={out}"])
    out.mkdir(parents=True, exist_ok=True)
    if warm is not None:  # a study's warm start: its data and SFT export
        data = {"train": str(warm / "data" / "train.jsonl"), "eval": str(warm / "data" / "eval.jsonl"),
                "tokenizer": str(warm / "data" / "tokenizer")}
        hf = warm / "sft" / "hf"
        if not (hf / "model.safetensors").exists():
            raise FileNotFoundError(f"no SFT export under {hf}")
    else:
        data = prepare_task_data(cfg.data, out / "data")
        hf = warm_start(config, out, _num_layers(cfg, data), data, say)  # the config's SFT, made once under OUT/
    tokenizer = load_tokenizer(data["tokenizer"])
    train_rows = load_prompts(data["train"], cfg.data, tokenizer, generated=True)
    reward_fn = get_reward_fn(cfg.data.reward)
    rng = np.random.default_rng(seed)
    rows = [train_rows[i] for i in rng.choice(len(train_rows), size=prompts, replace=False)]
    state.init_distributed(ParallelConfig(logprob_chunk_size=cfg.parallel.logprob_chunk_size), cfg.train.seed)
    try:
        smp, batch = scored_batch(hf, rows, cfg, samples, seed, reward_fn, tokenizer.pad_token_id)
        m = measure(cfg, hf, batch, model_vocab_size(str(hf), tokenizer), say)
    finally:
        state.destroy_distributed()
    record = {"config": str(config), "overrides": list(overrides), "seed": seed, "prompts": prompts, "samples": samples,
              "sample_reward": float(np.mean([s.reward for s in smp])), "command": command, **analyse(m)}
    record["wall_s"] = time.perf_counter() - t_start
    stem = out / f"ratio_error_sources_seed{seed}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(markdown(record))
    return record


def _num_layers(cfg, data) -> int:
    """The config's model depth (its preset's, unless model.num_layers overrides it)."""
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.presets import resolve_architecture

    return resolve_architecture(cfg.model, len(load_tokenizer(data["tokenizer"]))).num_layers


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def _f(x: float, digits: int = 4) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def markdown(r: dict[str, Any]) -> str:
    """The tables of a record."""
    b = r["baseline"]
    lines = [f"# Where the {r['recipe']} log-ratio error comes from (seed {r['seed']}, {r['prompts']} prompts x {r['samples']} "
             f"samples, {b['n']} answer tokens, {r['num_layers']} layers)", "",
             f"Regenerate: `{r['command']}`" if r["command"] else "", "",
             "e = low-precision log-ratio - high-precision log-ratio of each answer token after one low-precision GRPO "
             "update from the warm start (theta_old -> theta, both fixed across the rows below). Tail: |e| above the "
             f"baseline's 99th percentile, {_f(r['tail_threshold'])}.", "",
             f"Baseline: mean |e| {_f(b['mean_abs'])}, median {_f(b['q50'])}, p99 {_f(b['q99'])}, p99.9 {_f(b['q999'])}, "
             f"max {_f(b['max'])}; the update's own size (mean |hp log-ratio|) {_f(r['hp_log_ratio']['mean_abs'])}, "
             f"the forward error at theta_old (mean |log p_lp - log p_hp|) {_f(r['forward_error']['mean_abs'])}; "
             f"{100 * r['tail_sign']['positive']:.0f}% of tail tokens have e > 0. Sampled reward {r['sample_reward']:.3f}.", "",
             "## (a) Which GEMMs carry it", "",
             "sq left: sum e^2 of the variant / the baseline's; tail left: share of the baseline's tail tokens still "
             "beyond the threshold.", "",
             "| variant | mean abs e | median | p99 | p99.9 | sq left | tail left |", "|---|---|---|---|---|---|---|"]
    for g in r["gemms"]:
        lines.append(f"| {g['label']} | {_f(g['mean_abs'])} | {_f(g['q50'])} | {_f(g['q99'])} | {_f(g['q999'])} | "
                     f"{_f(g.get('sq_left', 1.0), 3)} | {_f(g.get('tail_left', 1.0), 3)} |")
    lines += ["", "The LM head (output_layer) is not quantized by the learner in any recipe (a plain megatron linear): no row.", ""]
    lines += ["## (b) Which tokens", ""]
    for key, title, fmt in (("p_hp", "high-precision probability of the token at theta_old", "{:g}-{:g}"),
                            ("entropy", "high-precision entropy at theta_old (nats)", "{:g}-{:g}"),
                            ("position", "position in the answer", "{:.0f}-{:.0f}")):
        lines += [f"**{title}**", "", "| bucket | tokens | token share | mean abs e | share of sum e^2 | share of tail | tail rate |",
                  "|---|---|---|---|---|---|---|"]
        for row in r["tokens"][key]:
            hi = row["hi"] - 1 if key == "position" else row["hi"]
            lines.append(f"| {fmt.format(row['lo'], hi)} | {row['n']} | {_f(row['token_share'], 3)} | {_f(row['mean_abs'])} | "
                         f"{_f(row['sq_share'], 3)} | {_f(row['tail_share'], 3)} | {_f(row['tail_rate'], 3)} |")
        lines.append("")
    lines += ["## (c) Which sequences", "", "| top answers by sum e^2 | answers | share of sum e^2 | share of sum abs e | share of tail |",
              "|---|---|---|---|---|"]
    for row in r["sequences"]:
        if math.isnan(row["top_frac"]):
            lines.append(f"| answers with any tail token | {row['sequences']} of {row['of']} | | | 1.000 |")
        else:
            lines.append(f"| top {100 * row['top_frac']:.0f}% | {row['sequences']} of {row['of']} | {_f(row['sq_share'], 3)} | "
                         f"{_f(row['abs_share'], 3)} | {_f(row['tail_share'], 3)} |")
    lines += ["", "## (d) The change of quantization", ""]
    if r["change"]:
        lines += ["theta's forward with theta_old's per-tensor scales (each GEMM operand's amax from theta_old's forward of "
                  "the same micro-batch): what is left is the rounding of what moved.", "",
                  "| theta forwarded with | mean abs e | median | p99 | p99.9 | sq left | tail left |", "|---|---|---|---|---|---|---|",
                  f"| its own scales (baseline) | {_f(b['mean_abs'])} | {_f(b['q50'])} | {_f(b['q99'])} | {_f(b['q999'])} | 1.000 | 1.000 |"]
        for c in r["change"]:
            lines.append(f"| {c['label']} | {_f(c['mean_abs'])} | {_f(c['q50'])} | {_f(c['q99'])} | {_f(c['q999'])} | "
                         f"{_f(c['sq_left'], 3)} | {_f(c['tail_left'], 3)} |")
    else:
        lines.append(f"Not measured: recipe {r['recipe']} has no per-tensor scales to reuse.")
    lines += ["", f"## (e) Which answers a selector finds for free (top {100 * PREDICTOR_TOP_SHARE:.0f}%)", "",
              "| ranked by | answers | share of sum e^2 | share of tail |", "|---|---|---|---|"]
    for row in r.get("predictors", []):
        lines.append(f"| {row['predictor']} | {row['answers']} of {row['of']} | {_f(row['sq_share'], 3)} | {_f(row['tail_share'], 3)} |")
    lines += ["", f"Wall time {r['wall_s']:.0f} s.", ""]
    return "\n".join(lines)
