"""The reference backend while torch.compile traces: the semantics of `packattn.mask` in one pass over
all rows, with no loop whose trip count depends on the batch.

The eager reference groups sequences and chunks queries by the host lengths; traced, each such loop
would be unrolled for one packing, and the next packing would recompile. Here every query row meets
every key row of the batch once, so the graph depends only on symbolic row counts: one
``(heads_q, total_q, total_kv)`` score tensor (recomputed in the backward when gradients are on).
That is meant for tests and debugging under compile, not for long batches.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from packattn import mask as masks
from packattn.backends.base import Problem
from packattn.varlen import lengths_then_zero


def masked_softmax(s: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, lse)`` of scores ``s`` (keys last) where ``visible`` allows: a row that sees no key gets p = 0
    and lse -inf (``lse`` keeps a trailing dimension of 1). The eager reference's chunks use it too."""
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    return p / total, torch.where(empty, torch.full_like(total, float("-inf")), m + torch.log(total))


def attend(q, k, v, visible, scale: float, compute_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (rows_q, heads_q, dv), lse (heads_q, rows_q))`` of q over k, v where ``visible``
    (``rows_q x rows_kv``, bool) allows; a row that sees nothing gives zeros and lse -inf."""
    rows_q, heads_q, d = q.shape
    heads_kv = k.shape[1]
    qg = q.to(compute_dtype).view(rows_q, heads_kv, heads_q // heads_kv, d)
    s = torch.einsum("qhgd,khd->hgqk", qg, k.to(compute_dtype)) * scale
    p, lse = masked_softmax(s, visible)
    out = torch.einsum("hgqk,khd->qhgd", p, v.to(compute_dtype))
    return out.reshape(rows_q, heads_q, v.shape[-1]), lse.reshape(heads_q, rows_q)


def varlen_visible(problem: Problem) -> torch.Tensor:
    """``(total_q, total_kv)`` bool: key row visible to query row (same sequence, and the mask)."""
    seqs, mask = problem.seqs, problem.mask
    seq_q, pos_q = seqs.row_map_q()
    seq_kv, pos_kv = seqs.row_map_kv()
    own = seq_q.clamp_min(0)
    len_q = lengths_then_zero(seqs.cu_seqlens_q)[own, None]
    len_kv = lengths_then_zero(seqs.cu_seqlens_kv)[own, None]
    same = (seq_q[:, None] == seq_kv[None, :]) & (seq_q >= 0)[:, None]
    return same & masks.visible(mask, pos_q[:, None], pos_kv[None, :], len_q, len_kv)


def tree_visible(problem: Problem) -> torch.Tensor:
    """``(total, total)`` bool: key ``s`` visible to query ``t`` iff ``s <= t < row_subtree_end[s]``."""
    key_end = problem.seqs.row_subtree_end().long()
    rows = torch.arange(key_end.shape[0], device=key_end.device)
    return (rows[None, :] <= rows[:, None]) & (rows[:, None] < key_end[None, :])


def traced_reference_attention(problem: Problem, tree: bool):
    """`ReferenceBackend.run` under torch.compile (varlen, dense or ``tree`` descriptors)."""
    q, k, v = problem.q, problem.k, problem.v
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    visible = tree_visible(problem) if tree else varlen_visible(problem)
    args = (q, k, v, visible, problem.scale, compute_dtype)
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, lse = checkpoint(attend, *args, use_reentrant=False) if need_grad else attend(*args)
    return out.to(q.dtype), (lse.float() if problem.return_lse else None)
