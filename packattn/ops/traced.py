"""The Triton kernels under torch.compile: one graph for every packing.

Eagerly, the triton backends pick their kernels and configs from the batch's longest lengths and build
the tile tables once per batch (cached on the descriptor, shared by every layer). While torch.compile
traces, those lengths are symbolic and vary per batch: a branch on them would be a guard, so a new
packing would recompile. So the graph holds only the descriptor's tensors and its two longest lengths
(symbolic ints); the custom ops here decide the kernels and build the tables when they run, with the
same functions as the eager path (`triton_varlen.forward_plan`, `triton_tree.tree_tables`). The
backward op derives everything again from the same inputs, so both sides agree. The price: tables are
built per layer and per pass (a few small device ops), and rows in no sequence are zeroed by filling
whole outputs (no host list of padding rows).
"""

from __future__ import annotations

import torch

from packattn import mask as masks
from packattn.backends import triton_tree, triton_varlen
from packattn.varlen import Varlen

# the integers of a traced varlen call: the mask's fields, the padding flags, the longest lengths
VARLEN_OPTIONS = ("causal", "has_window", "window_left", "window_right", "chunk_size", "top_left", "padded_q",
                  "padded_kv", "max_seqlen_q", "max_seqlen_kv")


def _mask_options(mask: masks.Mask) -> list[int]:
    left, right = mask.window if mask.window is not None else (0, 0)
    return [int(mask.causal), int(mask.window is not None), left, right, mask.chunk_size or 0,
            int(mask.align == "top_left")]


def _batch(q, k, seq: list[torch.Tensor], options: list[int]) -> tuple[Varlen, masks.Mask]:
    """The descriptor and mask of a traced call, rebuilt from the op's inputs (no host lengths)."""
    causal, has_window, left, right, chunk, top_left, padded_q, padded_kv, max_q, max_kv = options
    mask = masks.Mask(causal=bool(causal), window=(left, right) if has_window else None,
                      chunk_size=chunk or None, align="top_left" if top_left else "bottom_right")
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
    tables, fwd_options = triton_varlen.forward_plan(q, k, v, seqs, mask, need_grad=False)
    return triton_varlen._varlen_fwd(q, k, v, tables, None, None, scale, fwd_options)


@traced_varlen_fwd.register_fake
def _(q, k, v, seq, scale, options):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packattn::traced_varlen_bwd", mutates_args=())
def traced_varlen_bwd(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, seq: list[torch.Tensor], scale: float,
                      options: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `traced_varlen_fwd`: the passes and tile tables the eager backward would take."""
    seqs, mask = _batch(q, k, seq, options)
    plan = triton_varlen.bwd_plan(q, k, v, triton_varlen.short_batch(seqs.max_seqlen_q, seqs.max_seqlen_kv))
    dq_tiles = triton_varlen.tile_table(seqs, mask, False, *plan.dq_choice[:2])
    dkdv_tiles = triton_varlen.tile_table(seqs, mask, True, *plan.dkdv_choice[:2])
    padded_q, padded_kv = seqs.cu_seqlens_q_padded is not None, seqs.cu_seqlens_kv_padded is not None
    return triton_varlen._varlen_bwd_planned(
        plan, dout, dlse, q, k, v, out, lse, *seq, dq_tiles, dkdv_tiles, scale, mask.left, mask.right,
        mask.chunk_size or 0, mask.align == "top_left", padded_q, padded_kv)


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


def traced_varlen_attention(q, k, v, seqs: Varlen, mask: masks.Mask, scale: float, return_lse: bool):
    """`TritonVarlenBackend.run` while torch.compile traces (``scale >= 0``)."""
    seq = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv]
    padded = [int(seqs.cu_seqlens_q_padded is not None), int(seqs.cu_seqlens_kv_padded is not None)]
    options = _mask_options(mask) + padded + list(seqs.traced_max_seqlens())
    out, lse = traced_varlen_fwd(q, k, v, seq, scale, options)
    return out, (lse if return_lse else None)


# ---------------------------------------------------------------- trees
class _TreeRows:
    """What `triton_tree.tree_tables` reads of a `Tree`, rebuilt from ``row_subtree_end`` in an op."""

    def __init__(self, key_end: torch.Tensor):
        self.total, self._key_end, self._cache = key_end.shape[0], key_end, {}

    def row_subtree_end(self) -> torch.Tensor:
        return self._key_end

    def cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


@torch.library.custom_op("packattn::traced_tree_fwd", mutates_args=())
def traced_tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_end: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of tree attention; ``key_end``: int32 `Tree.row_subtree_end`."""
    tables = triton_tree.tree_tables(_TreeRows(key_end), q, k, v, need_grad=False)
    return triton_tree._tree_fwd(q, k, v, [*tables[:6], *tables[6]], scale)


@traced_tree_fwd.register_fake
def _(q, k, v, key_end, scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packattn::traced_tree_bwd", mutates_args=())
def traced_tree_bwd(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, key_end: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `traced_tree_fwd`."""
    key_end, _, _, dq_tiles, dq_intervals, dkdv_tiles, (cu_rows, row0) = triton_tree.tree_tables(
        _TreeRows(key_end), q, k, v, need_grad=True)
    return triton_tree._tree_bwd(dout, dlse, q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles,
                                 cu_rows, row0, scale)


@traced_tree_bwd.register_fake
def _(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_tree(ctx, inputs, output):
    q, k, v, key_end, scale = inputs
    ctx.save_for_backward(q, k, v, *output, key_end)
    ctx.scale = scale
    ctx.set_materialize_grads(False)


def _tree_backward(ctx, dout, dlse):
    q, k, v, out, lse, key_end = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = traced_tree_bwd(dout, dlse, q, k, v, out, lse, key_end, ctx.scale)
    return dq, dk, dv, None, None


traced_tree_fwd.register_autograd(_tree_backward, setup_context=_save_tree)


def traced_tree_attention(q, k, v, tree, scale: float, return_lse: bool):
    """`TritonTreeBackend.run` while torch.compile traces (``scale >= 0``); a tree without sharing runs
    the tree kernels too (eagerly it runs the varlen ones: reading which case applies would be a guard)."""
    key_end = tree.row_subtree_end().to(torch.int32).contiguous()
    out, lse = traced_tree_fwd(q, k, v, key_end, scale)
    return out, (lse if return_lse else None)
