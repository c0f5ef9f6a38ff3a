"""The varlen op under torch.compile: one graph for every packing.

Eagerly, the plan (kernels, configs) comes from the batch's longest lengths and the tile tables are built
once per batch (cached on the descriptor, shared by every layer). While torch.compile traces, those lengths
are symbolic and vary per batch: a branch on them would be a guard, so a new packing would recompile. So the
graph holds only the descriptor's tensors and its two longest lengths (symbolic ints); the custom ops here
decide the kernels and build the tables when they run, with the eager path's functions (`op.forward_plan`,
`op.bwd_plan`). The backward op derives everything again from the same inputs, so both sides agree. The
price: tables are built per layer and per pass (a few small device ops), and rows in no sequence are zeroed
by filling whole outputs (no host list of padding rows).
"""

from __future__ import annotations

import torch

from packattn.lengths import short_batch
from packattn.mask import Mask
from packattn.ops.runtime.launch import MASK_FIELDS, mask_options
from packattn.ops.varlen import op
from packattn.varlen import Varlen

# the integers of a traced varlen call: the mask's (`launch.mask_options`), the padding flags, the longest lengths
VARLEN_OPTIONS = (*MASK_FIELDS, "padded_q", "padded_kv", "max_seqlen_q", "max_seqlen_kv")


def _batch(q, k, seq: list[torch.Tensor], options: list[int]) -> tuple[Varlen, Mask]:
    """The descriptor and mask of a traced call, rebuilt from the op's inputs (no host lengths)."""
    mask, (padded_q, padded_kv, max_q, max_kv) = op.read_options(options)
    cu_q, cu_kv, offsets_q, offsets_kv = seq
    seqs = Varlen(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=offsets_q if padded_q else None,
                  cu_seqlens_kv_padded=offsets_kv if padded_kv else None, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                  total_q=q.shape[0], total_kv=k.shape[0], num_seqs=cu_q.shape[0] - 1)
    return seqs, mask


@torch.library.custom_op("packattn::traced_varlen_fwd", mutates_args=())
def traced_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: list[torch.Tensor], scale: float,
                      options: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``seq``: ``cu_seqlens_q, cu_seqlens_kv, offsets_q, offsets_kv``; ``options``:
    `VARLEN_OPTIONS`."""
    seqs, mask = _batch(q, k, seq, options)
    tables, fwd_options = op.forward_plan(q, k, v, seqs, mask, need_grad=False)
    return op._varlen_fwd(q, k, v, tables, None, None, scale, fwd_options)


@traced_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, seq, scale, options):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packattn::traced_varlen_bwd", mutates_args=())
def traced_varlen_bwd(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, seq: list[torch.Tensor], scale: float,
                      options: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `traced_varlen_fwd`: the passes and tile tables the eager backward would take."""
    seqs, mask = _batch(q, k, seq, options)
    short_seqs = short_batch(seqs.max_seqlen_q, seqs.max_seqlen_kv)
    plan = op.bwd_plan(q, k, v, short_seqs)
    tables = [*seq, *op.bwd_tables(seqs, mask, plan)]
    return op._varlen_bwd_planned(plan, dout, dlse, q, k, v, out, lse, tables, None, None, scale,
                                  op.bwd_options(options, short_seqs))


@traced_varlen_bwd.register_fake
def _(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_varlen(ctx, inputs, output):
    q, k, v, seq, scale, options = inputs
    ctx.save_for_backward(q, k, v, *output, *seq)
    ctx.scale, ctx.options = scale, options
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: no dlse term


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, *seq = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = traced_varlen_bwd(dout, dlse, q, k, v, out, lse, seq, ctx.scale, ctx.options)
    return dq, dk, dv, [None] * len(seq), None, None


traced_varlen_fwd.register_autograd(_varlen_backward, setup_context=_save_varlen)


def traced_varlen_attention(q, k, v, seqs: Varlen, mask: Mask, scale: float):
    """``(out, lse)``: `op.attention` while torch.compile traces (``scale >= 0``)."""
    seq = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv]
    padded = [int(seqs.cu_seqlens_q_padded is not None), int(seqs.cu_seqlens_kv_padded is not None)]
    options = mask_options(mask) + padded + list(seqs.traced_max_seqlens())
    return traced_varlen_fwd(q, k, v, seq, scale, options)
