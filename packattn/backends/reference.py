"""Reference backend: plain PyTorch, any device, autograd, float32 (or float64) math.

It is the executable spec of the semantics in `packattn.mask`. Sequences are gathered into a
padded ``(batch, len, heads, dim)`` layout in groups, and queries processed in chunks, so the
score matrices in flight stay under a fixed element budget; with gradients on, each chunk is
recomputed in backward (activation checkpointing), so memory does not grow with total^2.
Everything is device ops with host-known sizes: no host sync.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from packattn import mask as masks
from packattn.backends.base import Backend, Problem
from packattn.backends.reference_traced import masked_softmax, traced_reference_attention
from packattn.varlen import Varlen

SCORE_BUDGET = 2**25  # score elements per chunk


class ReferenceBackend(Backend):
    name = "reference"

    def unsupported(self, params) -> str | None:
        return None

    def run(self, problem: Problem):
        if torch.compiler.is_compiling():  # one graph for every packing (see the module)
            return traced_reference_attention(problem, tree=not isinstance(problem.seqs, Varlen))
        if not isinstance(problem.seqs, Varlen):  # a packattn.Tree
            return reference_tree_attention(problem)
        return reference_attention(problem)


def _chunk(q, k, v, seq_len_q, seq_len_kv, q_pos, mask, scale, compute_dtype):
    """Attention for a padded block: q (B, cq, Hq, D), k/v (B, Lk, Hk, D) -> out (B, cq, Hq, Dv), lse (B, Hq, cq)."""
    B, cq, Hq, D = q.shape
    Lk, Hk = k.shape[1], k.shape[2]
    g = Hq // Hk
    qf = q.to(compute_dtype).view(B, cq, Hk, g, D)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.to(compute_dtype)) * scale
    k_pos = torch.arange(Lk, device=q.device)
    vis = masks.visible(mask, q_pos[None, :, None], k_pos[None, None, :], seq_len_q[:, None, None], seq_len_kv[:, None, None])
    p, lse = masked_softmax(s, vis[:, None, None])
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(compute_dtype))
    return o.reshape(B, cq, Hq, v.shape[-1]), lse.reshape(B, Hq, cq)


def reference_attention(problem: Problem, score_budget: int = SCORE_BUDGET):
    q, k, v, seqs, mask = problem.q, problem.k, problem.v, problem.seqs, problem.mask
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    total_q, Hq, Dv = q.shape[0], q.shape[1], v.shape[-1]
    # padded lengths from the real lengths, not the declared maxima (which may be far larger: 10 tokens
    # declared as max_seqlen 16384 would otherwise cost 16384^2 scores per head)
    N = seqs.num_seqs
    Lq = _longest(seqs.lengths_q, seqs.max_seqlen_q, total_q)
    Lk = _longest(seqs.lengths_kv, seqs.max_seqlen_kv, k.shape[0])
    if N == 0 or Lq == 0 or Lk == 0 or total_q == 0:
        # nothing is visible anywhere; keep the result attached to the graph (zero gradients)
        tie = (q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()).to(q.dtype)
        out = q.new_zeros(total_q, Hq, Dv) + tie
        lse = torch.full((Hq, total_q), float("-inf"), device=q.device, dtype=torch.float32)
        return out, (lse if problem.return_lse else None)

    starts_q, starts_kv = seqs.starts_q.long(), seqs.starts_kv.long()
    len_q, len_kv = seqs.seqlens_q.long(), seqs.seqlens_kv.long()
    cq = max(1, min(Lq, score_budget // (Lk * Hq)))
    group = max(1, score_budget // (cq * Lk * Hq))
    k_idx = torch.arange(Lk, device=q.device)
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)

    out_groups, lse_groups = [], []
    for s0 in range(0, N, group):
        s1 = min(N, s0 + group)
        lq, lk = len_q[s0:s1], len_kv[s0:s1]
        k_rows = starts_kv[s0:s1, None] + k_idx[None, :]
        k_ok = (k_idx[None, :] < lk[:, None])[..., None, None]
        k_rows = k_rows.clamp(max=max(problem.k.shape[0] - 1, 0))
        kb = torch.where(k_ok, k[k_rows], k.new_zeros(()))
        vb = torch.where(k_ok, v[k_rows], v.new_zeros(()))
        outs, lses = [], []
        for c0 in range(0, Lq, cq):
            q_pos = torch.arange(c0, min(Lq, c0 + cq), device=q.device)
            q_rows = (starts_q[s0:s1, None] + q_pos[None, :]).clamp(max=total_q - 1)
            q_ok = (q_pos[None, :] < lq[:, None])[..., None, None]
            qb = torch.where(q_ok, q[q_rows], q.new_zeros(()))
            args = (qb, kb, vb, lq, lk, q_pos, mask, problem.scale, compute_dtype)
            o, l = checkpoint(_chunk, *args, use_reentrant=False) if need_grad else _chunk(*args)
            outs.append(o)
            lses.append(l)
        out_groups.append(torch.cat(outs, dim=1))
        lse_groups.append(torch.cat(lses, dim=2))
    padded_out = torch.cat(out_groups, dim=0)  # (N, Lq, Hq, Dv)
    padded_lse = torch.cat(lse_groups, dim=0)  # (N, Hq, Lq)

    seq_of_row, pos_of_row = seqs.row_map_q()
    valid = seq_of_row >= 0
    seq_c = seq_of_row.clamp_min(0)
    out = padded_out[seq_c, pos_of_row]
    out = torch.where(valid[:, None, None], out, out.new_zeros(())).to(q.dtype)
    lse = None
    if problem.return_lse:
        lse = padded_lse[seq_c, :, pos_of_row].t()
        lse = torch.where(valid[None, :], lse, lse.new_full((), float("-inf"))).float()
    return out, lse


def _longest(lengths: tuple[int, ...] | None, declared: int, rows: int) -> int:
    """The longest sequence: from the host lengths when the descriptor has them, else the declared maximum
    capped by the rows there are (no host sync either way)."""
    return max(lengths, default=0) if lengths is not None else min(declared, rows)


def _tree_chunk(q, k, v, key_end, t0: int, scale: float, compute_dtype):
    """Queries ``t0 ... t0 + len(q) - 1`` of a tree against keys ``0 ... len(k) - 1``: key ``s`` is
    visible to query ``t`` iff ``s <= t < key_end[s]``."""
    cq, Hq, D = q.shape
    Hk = k.shape[1]
    g = Hq // Hk
    t = torch.arange(t0, t0 + cq, device=q.device)
    s_idx = torch.arange(k.shape[0], device=q.device)
    vis = (s_idx[None, :] <= t[:, None]) & (t[:, None] < key_end[None, :])  # (cq, keys)
    scores = torch.einsum("qhgd,khd->hgqk", q.to(compute_dtype).view(cq, Hk, g, D), k.to(compute_dtype)) * scale
    scores = scores.masked_fill(~vis, float("-inf"))  # every query sees itself: no empty row
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("hgqk,khd->qhgd", torch.exp(scores - lse[..., None]), v.to(compute_dtype))
    return o.reshape(cq, Hq, v.shape[-1]), lse.reshape(Hq, cq)


def reference_tree_attention(problem: Problem, score_budget: int = SCORE_BUDGET):
    """Tree attention (`packattn.Tree`) in plain torch: query chunks against the keys before them,
    with the tree rule of `_tree_chunk`; checkpointed per chunk when gradients are on."""
    q, k, v, tree = problem.q, problem.k, problem.v, problem.seqs
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    total, Hq = q.shape[0], q.shape[1]
    key_end = tree.row_subtree_end().long()
    cq = max(1, score_budget // (max(total, 1) * Hq))
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, lses = [], []
    for t0 in range(0, total, cq):
        t1 = min(total, t0 + cq)
        args = (q[t0:t1], k[:t1], v[:t1], key_end[:t1], t0, problem.scale, compute_dtype)
        o, lse = checkpoint(_tree_chunk, *args, use_reentrant=False) if need_grad else _tree_chunk(*args)
        outs.append(o)
        lses.append(lse)
    if not outs:
        tie = (q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()).to(q.dtype)
        return q.new_zeros(0, Hq, v.shape[-1]) + tie, (q.new_empty(Hq, 0, dtype=torch.float32)
                                                       if problem.return_lse else None)
    out = torch.cat(outs).to(q.dtype)
    return out, (torch.cat(lses, dim=1).float() if problem.return_lse else None)
