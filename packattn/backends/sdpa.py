"""SDPA backend: `torch.nn.functional.scaled_dot_product_attention`.

Dense batches go straight to SDPA; packed batches run one SDPA call per sequence (sensible for
a handful of sequences, and on CPU), using the host lengths the descriptor carries.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from packattn import mask as masks
from packattn.backends.base import Backend, Problem


class SdpaBackend(Backend):
    name = "sdpa"

    def unsupported(self, params) -> str | None:
        if params.kind == "tree":
            return "tree descriptors need a tree-aware backend"
        if params.return_lse:
            return "SDPA does not return the log-sum-exp"
        if params.kind == "varlen" and not params.host_lengths:
            return "per-sequence SDPA needs host lengths in the descriptor"
        return None

    def run(self, problem: Problem):
        ctx = contextlib.nullcontext()
        if problem.deterministic and problem.q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel([SDPBackend.MATH])
        with ctx:
            if problem.dense is not None:
                return _dense(problem), None
            return _per_sequence(problem), None


def _sdpa(q, k, v, mask: masks.Mask, scale: float):
    """q (B, Lq, Hq, D), k/v (B, Lk, Hk, D) -> (B, Lq, Hq, Dv); rows that see no key are zeros."""
    lq, lk = q.shape[1], k.shape[1]
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        # SDPA's CPU kernels keep fp16/bf16 intermediates (errors like a naive fp16/bf16 computation,
        # worst in the backward); packattn accumulates in float32, so run them in float32 here
        return _sdpa(q.float(), k.float(), v.float(), mask, scale).to(q.dtype)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    if mask.is_full:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
    visible = masks.dense_mask(mask, lq, lk, device=q.device)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale, enable_gqa=gqa)
    out = out.transpose(1, 2)
    # SDPA's answer for a row with no visible key varies by kernel; ours is zeros
    return torch.where(visible.any(-1)[None, :, None, None], out, out.new_zeros(()))


def _dense(problem: Problem):
    batch, sq, sk = problem.dense
    q = problem.q.view(batch, sq, *problem.q.shape[1:])
    k = problem.k.view(batch, sk, *problem.k.shape[1:])
    v = problem.v.view(batch, sk, *problem.v.shape[1:])
    if sq == 0 or sk == 0:
        return problem.q.new_zeros(batch * sq, q.shape[2], v.shape[-1]) + _tie(problem)
    out = _sdpa(q, k, v, problem.mask, problem.scale)
    return out.reshape(batch * sq, *out.shape[2:])


def _tie(problem: Problem):
    """A zero attached to the autograd graph, so empty results still backpropagate (zeros)."""
    return sum(t.flatten()[:0].sum() for t in (problem.q, problem.k, problem.v)).to(problem.q.dtype)


def _per_sequence(problem: Problem):
    seqs = problem.seqs
    hq, dv = problem.q.shape[1], problem.v.shape[-1]
    pieces, row = [], 0
    for sq, sk, lq, lk in zip(seqs.host_starts_q, seqs.host_starts_kv, seqs.lengths_q, seqs.lengths_kv):
        if lq == 0:
            continue
        if sq > row:
            pieces.append(problem.q.new_zeros(sq - row, hq, dv))
        if lk == 0:
            piece = problem.q.new_zeros(lq, hq, dv)
        else:
            q = problem.q[sq : sq + lq].unsqueeze(0)
            k = problem.k[sk : sk + lk].unsqueeze(0)
            v = problem.v[sk : sk + lk].unsqueeze(0)
            piece = _sdpa(q, k, v, problem.mask, problem.scale)[0]
        pieces.append(piece)
        row = sq + lq
    if seqs.total_q > row:
        pieces.append(problem.q.new_zeros(seqs.total_q - row, hq, dv))
    if not pieces:
        return problem.q.new_zeros(0, hq, dv) + _tie(problem)
    return torch.cat(pieces, dim=0) + _tie(problem)
