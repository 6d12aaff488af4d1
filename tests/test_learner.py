"""Single-process Learner: log-probs/entropy vs naive formulas, chunking, training, the sum-form loss contract.

Run: pytest -q tests/test_learner.py
"""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.parallel import state
from megatron_rl.trainer.learner import Learner
from megatron_rl.trainer.logprobs import vocab_parallel_logprobs_entropy
from megatron_rl.trainer.model import unwrap
from megatron_rl.types import TrainBatch

warnings.filterwarnings("ignore", category=UserWarning)
VOCAB, B, S = 50, 4, 12


@pytest.fixture(scope="module")
def learner():
    """A world-1 tiny learner and its initial full state dict."""
    torch.set_num_threads(1)
    lrn = Learner(
        ModelConfig(preset="tiny"), ParallelConfig(logprob_chunk_size=5),
        OptimConfig(lr=1e-2, clip_grad=1e6), PrecisionConfig(), vocab_size=VOCAB, seed=3,
    )
    init = lrn.gather_full_state_dict()
    yield lrn, init
    state.destroy_distributed()


def make_batch(seed: int = 0) -> TrainBatch:
    """Right-padded batch with prompt tokens masked out and a global token_weight."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    pos = torch.arange(S)[None]
    mask = ((pos >= 2) & (pos < torch.tensor([12, 9, 7, 11])[:, None])).float()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * mask
    return TrainBatch(ids, labels, mask, adv, torch.zeros(B, S), token_weight=mask / mask.sum())


def naive_logits(lrn: Learner, ids: torch.Tensor) -> torch.Tensor:
    """Full logits [B, S, V] straight from the GPTModel (no schedule, no chunking)."""
    model = unwrap(lrn.model[0])
    return model(ids, torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1), None)


def naive_lp_ent(logits: torch.Tensor, labels: torch.Tensor):
    """log_softmax + gather, and -(p log p).sum()."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_forward_logprobs_match_naive_reference(learner):
    """Shapes, finiteness, equality with log_softmax+gather and the naive entropy; independent of micro-batching."""
    lrn, init = learner
    lrn.load_full_state_dict(init)
    batch = make_batch()
    lp, ent = lrn.forward_logprobs(batch, micro_batch_size=2)
    assert lp.shape == (B, S) and ent.shape == (B, S)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp <= 0).all() and (ent >= 0).all() and (ent <= torch.log(torch.tensor(float(lrn.arch.vocab_size))) + 1e-5).all()
    with torch.no_grad():
        ref_lp, ref_ent = naive_lp_ent(naive_logits(lrn, batch.input_ids), batch.labels)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    lp1, ent1 = lrn.forward_logprobs(batch, micro_batch_size=1)
    torch.testing.assert_close(lp1, lp, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_logprobs_values_and_gradients(chunk):
    """Any chunk size gives the naive values and the naive autograd gradients; input logits stay untouched."""
    g = torch.Generator().manual_seed(chunk)
    logits = (3 * torch.randn(3, 5, 33, generator=g)).requires_grad_(True)
    labels = torch.randint(0, 33, (3, 5), generator=g)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    before = logits.detach().clone()
    lp, ent = vocab_parallel_logprobs_entropy(logits, labels, None, chunk_size=chunk)
    (a * lp + b * ent).sum().backward()
    grad = logits.grad.clone()
    assert torch.equal(logits.detach(), before)
    logits.grad = None
    ref_lp, ref_ent = naive_lp_ent(logits, labels)
    (a * ref_lp + b * ref_ent).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, logits.grad, atol=1e-5, rtol=0)


def test_chunk_size_must_be_positive():
    """A bad chunk size names the config field."""
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), None, chunk_size=0)


def test_training_reduces_a_simple_loss(learner):
    """A few steps of token-weighted NLL on a fixed batch lower the loss."""
    lrn, init = learner
    lrn.load_full_state_dict(init)
    batch = make_batch(1)

    def nll(lp, ent, mb, ctx):
        return -(mb.token_weight * lp).sum(), {}

    losses = [lrn.train_step(batch, nll, micro_batch_size=2)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.2, losses


def test_sum_form_loss_contract_gradients(learner):
    """Micro-batched train_step leaves exactly d(sum of loss_fn outputs)/d(theta) in the grads (naive autograd reference)."""
    lrn, init = learner
    lrn.load_full_state_dict(init)
    batch = make_batch(2)
    chunk = lrn.model[0]

    # The optimizer aliases param.grad to main_grad after a step; drop that alias as train_step does.
    lrn.optimizer.zero_grad()
    chunk.zero_grad_buffer()
    ref_lp, ref_ent = naive_lp_ent(naive_logits(lrn, batch.input_ids), batch.labels)
    ref_loss = (batch.token_weight * (-batch.advantages * ref_lp - 0.05 * ref_ent)).sum()
    ref_loss.backward()
    ref_grads = {n: p.main_grad.clone() for n, p in chunk.named_parameters()}
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item()

    seen = []

    def loss_fn(lp, ent, mb, ctx):
        seen.append((ctx.micro_batch_index, ctx.num_micro_batches, ctx.dp_size, ctx.cp_size, mb.batch_size))
        assert ctx.group is state.dp_cp_group()
        loss = (mb.token_weight * (-mb.advantages * lp - 0.05 * ent)).sum()
        return loss, {"tokens": mb.loss_mask.sum()}

    metrics = lrn.train_step(batch, loss_fn, micro_batch_size=1)
    assert seen == [(i, B, 1, 1, 1) for i in range(B)]
    assert metrics["loss"] == pytest.approx(ref_loss.item(), abs=1e-6)
    assert metrics["tokens"] == batch.loss_mask.sum().item()
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert metrics["lr"] == pytest.approx(1e-2)
    for n, p in chunk.named_parameters():
        torch.testing.assert_close(p.main_grad, ref_grads[n], atol=1e-6, rtol=1e-5, msg=n)


def test_state_dict_roundtrip_and_errors(learner):
    """load then gather returns what was loaded; missing names and bad shapes are named in the error."""
    lrn, init = learner
    changed = {k: v + 0.01 * torch.arange(v.numel()).view_as(v) / v.numel() for k, v in init.items()}
    lrn.load_full_state_dict(changed)
    back = lrn.gather_full_state_dict()
    assert set(back) == set(init)
    for k in init:
        torch.testing.assert_close(back[k], changed[k], atol=0, rtol=0)
    assert "output_layer.weight" in back and back["decoder.layers.1.mlp.linear_fc1.weight"].shape == (256, 64)
    assert {k: tuple(v.shape) for k, v in back.items()} == lrn.expected_full_shapes()
    assert sum(v.numel() for v in back.values()) == lrn.arch.num_parameters()
    with pytest.raises(KeyError, match="decoder.final_layernorm.weight"):
        lrn.load_full_state_dict({k: v for k, v in init.items() if k != "decoder.final_layernorm.weight"})
    bad = dict(init)
    bad["decoder.final_layernorm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight"):
        lrn.load_full_state_dict(bad)
    lrn.load_full_state_dict(init)


def test_bad_batches_are_rejected(learner):
    """Errors name the offending field or setting."""
    lrn, _ = learner
    batch = make_batch()
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        lrn.forward_logprobs(batch, micro_batch_size=3)
    with pytest.raises(ValueError, match="TrainBatch.advantages"):
        lrn.forward_logprobs(batch.with_fields(advantages=torch.zeros(B, S + 1)), micro_batch_size=2)
    long = TrainBatch(*(torch.zeros(1, 200, dtype=torch.long) for _ in range(2)), *(torch.zeros(1, 200) for _ in range(3)))
    with pytest.raises(ValueError, match="max_seq_len"):
        lrn.forward_logprobs(long, micro_batch_size=1)

    def vector_loss(lp, ent, mb, ctx):
        return lp.sum(-1), {}

    with pytest.raises(ValueError, match="0-d loss"):
        lrn.train_step(batch, vector_loss, micro_batch_size=2)


def test_config_errors_name_fields():
    """Layouts the model cannot split fail before building anything, naming the fields."""
    from megatron_rl.models.presets import resolve_architecture
    from megatron_rl.trainer.model import build_transformer_config

    arch = resolve_architecture(ModelConfig(preset="tiny", num_layers=3), 50)
    with pytest.raises(ValueError, match="num_layers=3"):
        build_transformer_config(arch, ParallelConfig(pipeline_model_parallel_size=2), OptimConfig(), PrecisionConfig())
    with pytest.raises(ValueError, match="num_query_groups=2"):
        build_transformer_config(resolve_architecture(ModelConfig(), 50), ParallelConfig(tensor_model_parallel_size=4), OptimConfig(), PrecisionConfig())
    with pytest.raises(ValueError, match="world size 1"):
        state.check_world_size(ParallelConfig(tensor_model_parallel_size=2), 1)


def test_fp8_emulation_is_per_layer_and_switchable(learner):
    """recipe=blockwise changes log-probs; high_precision() and all-high-precision ends give the plain model's values."""
    from megatron_rl.precision import high_precision

    lrn, init = learner
    lrn.load_full_state_dict(init)
    batch = make_batch(3)
    plain, _ = lrn.forward_logprobs(batch, micro_batch_size=4)
    fp8 = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(recipe="blockwise"), vocab_size=VOCAB)
    fp8.load_full_state_dict(init)
    quantized, _ = fp8.forward_logprobs(batch, micro_batch_size=4)
    assert (quantized - plain).abs().max() > 1e-4
    with high_precision():
        shadow, _ = fp8.forward_logprobs(batch, micro_batch_size=4)
    torch.testing.assert_close(shadow, plain, atol=1e-6, rtol=0)
    ends = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(),
                   PrecisionConfig(recipe="blockwise", first_last_layers_high_precision=1), vocab_size=VOCAB)
    ends.load_full_state_dict(init)
    torch.testing.assert_close(ends.forward_logprobs(batch, micro_batch_size=4)[0], plain, atol=1e-6, rtol=0)


def test_lr_schedule_warmup_then_linear_decay(learner):
    """Step k uses lr(k): linear warm-up from lr/warmup, then linear decay to min_lr at total_steps."""
    lrn0, init = learner
    lrn = Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_style="linear"),
                  PrecisionConfig(), vocab_size=VOCAB, total_steps=5)
    lrn.load_full_state_dict(init)
    batch = make_batch(4)

    def nll(lp, ent, mb, ctx):
        return -(mb.token_weight * lp).sum(), {}

    lrs = [lrn.train_step(batch, nll, micro_batch_size=4)["lr"] for _ in range(5)]
    # warm-up: 1/2, 2/2 of peak; decay over the remaining 3 steps to min_lr
    expected = [5e-3, 1e-2, 1e-3 + 9e-3 * (2 / 3), 1e-3 + 9e-3 * (1 / 3), 1e-3]
    assert lrs == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="total_steps"):
        Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(lr_decay_style="cosine"), PrecisionConfig(), vocab_size=VOCAB)


def test_te_environment_checked_only_on_gpu_with_fp8(learner, monkeypatch):
    """check_te_environment runs once per GPU Learner with an FP8 recipe; a CPU Learner never imports TE."""
    import sys

    from megatron_rl.precision import te
    from megatron_rl.trainer.learner import check_precision_environment

    assert "transformer_engine" not in sys.modules
    seen, asked = [], []
    monkeypatch.setattr(te, "check_te_environment", seen.append)
    monkeypatch.setattr(te, "check_te_recipe_support", asked.append)  # TE's own check_recipe_support, on the GPU
    blockwise, none = PrecisionConfig(recipe="blockwise"), PrecisionConfig()
    check_precision_environment(blockwise, on_gpu=False)
    check_precision_environment(none, on_gpu=True)
    assert seen == asked == []
    check_precision_environment(blockwise, on_gpu=True)
    assert seen == asked == [blockwise]
