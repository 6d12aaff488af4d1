"""Per-token log-probs and entropy from vocab-parallel logits, chunked over tokens, differentiable.

Each TP rank holds logits for a slice [start, start + V/tp) of the vocabulary. Per chunk of
`chunk_size` tokens we all-reduce over the TP group: the max (for stability), sum(exp(z)),
the target logit and sum(exp(z) * z); then
    logprob = z_label - log sum exp(z),   entropy = log sum exp(z) - sum(p * z).
The work is a custom autograd Function: forward keeps no per-chunk graph, backward recomputes
the softmax one chunk at a time, so the extra memory is one chunk of [chunk_size, V/tp] in both
directions (the logits themselves are kept, as any loss on them would). Gradients flow to the
logits from both log-probs and entropy (an entropy bonus is trainable); backward needs no
communication because the loss downstream is replicated over TP ranks.
The input logits are never modified (megatron's vocab_parallel_cross_entropy writes into its
input; this module does not use it).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """In-place all-reduce when the group has more than one rank."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_stats(z_raw: torch.Tensor, labels: torch.Tensor, vocab_start: int, group):
    """(logprob, entropy, logsumexp) of one chunk of [n, V/tp] logits, reduced over the TP group."""
    z = z_raw.float()
    zmax = z.max(dim=-1).values
    _all_reduce(zmax, dist.ReduceOp.MAX, group)
    z = z - zmax[:, None]
    ez = z.exp()
    local = labels - vocab_start
    in_range = (local >= 0) & (local < z.shape[-1])
    target = torch.where(in_range, z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1), torch.zeros_like(zmax))
    packed = torch.stack([ez.sum(-1), target, (ez * z).sum(-1)])
    _all_reduce(packed, dist.ReduceOp.SUM, group)
    sumexp, target, ezz = packed
    lse = sumexp.log()
    return target - lse, lse - ezz / sumexp, lse + zmax


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Chunked log-prob/entropy with a chunk-recomputing backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, chunk_size, group):
        """logits [N, V/tp], labels [N] -> (logprob [N], entropy [N]) in fp32."""
        n = logits.shape[0]
        logprob = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logprob[s:e], entropy[s:e], lse[s:e] = _chunk_stats(logits[s:e], labels[s:e], vocab_start, group)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.vocab_start, ctx.chunk_size = vocab_start, chunk_size
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        """dL/dz_j = g_lp (1[j = label] - p_j) - g_ent p_j (log p_j + H), one chunk at a time."""
        logits, labels, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, v = logits.shape
        if g_logprob is None:
            g_logprob = torch.zeros_like(lse)
        if g_entropy is None:
            g_entropy = torch.zeros_like(lse)
        for s in range(0, n, ctx.chunk_size):
            e = min(n, s + ctx.chunk_size)
            logp = logits[s:e].float() - lse[s:e, None]
            p = logp.exp()
            g = -(g_logprob[s:e, None] * p) - g_entropy[s:e, None] * p * (logp + entropy[s:e, None])
            local = labels[s:e] - ctx.vocab_start
            in_range = (local >= 0) & (local < v)
            rows = torch.nonzero(in_range).squeeze(-1)
            g[rows, local[rows]] += g_logprob[s:e][rows]
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `labels` and entropies, shaped like `labels`, from [..., V/tp] logits (this rank's vocab slice)."""
    if chunk_size < 1:
        raise ValueError(f"parallel.logprob_chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not align")
    tp_rank = dist.get_rank(group=tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    vocab_start = tp_rank * logits.shape[-1]
    flat = logits.reshape(-1, logits.shape[-1])
    logprob, entropy = _VocabParallelLogprobEntropy.apply(flat, labels.reshape(-1).long(), vocab_start, chunk_size, tp_group)
    return logprob.view(labels.shape), entropy.view(labels.shape)


def vocab_parallel_label_is_argmax(logits: torch.Tensor, labels: torch.Tensor,
                                   tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Bool, shaped like `labels`: the label's logit is the largest of the whole vocabulary (what greedy decoding picks).

    From [..., V/tp] logits (this rank's vocab slice); no gradient. An exact tie with another token counts as a hit
    (greedy takes the lowest index); with float logits ties do not occur in practice.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not align")
    tp_rank = dist.get_rank(group=tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    with torch.no_grad():
        z = logits.detach().float()
        top = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)
        local = labels.to(z.device).long() - tp_rank * z.shape[-1]
        in_range = (local >= 0) & (local < z.shape[-1])
        picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        # the label's logit lives on one TP rank; the others contribute -inf to the MAX
        target = _all_reduce(torch.where(in_range, picked, torch.full_like(picked, -math.inf)), dist.ReduceOp.MAX, tp_group)
        return target >= top


def gather_cp_sequence(x: torch.Tensor, cp_group: Optional[dist.ProcessGroup], seq_dim: int = 1) -> torch.Tensor:
    """Undo megatron's load-balanced CP layout: all-gather the local [.., S/cp, ..] pieces into [.., S, ..] (no grad)."""
    from megatron_rl.trainer.spec import cp_chunk_positions

    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    if cp == 1:
        return x
    pieces = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(pieces, x.contiguous(), group=cp_group)
    full_len = x.shape[seq_dim] * cp
    positions = torch.cat([cp_chunk_positions(full_len, cp, r) for r in range(cp)]).to(x.device)
    out = torch.empty(*x.shape[:seq_dim], full_len, *x.shape[seq_dim + 1:], dtype=x.dtype, device=x.device)
    out.index_copy_(seq_dim, positions, torch.cat(pieces, dim=seq_dim))
    return out
