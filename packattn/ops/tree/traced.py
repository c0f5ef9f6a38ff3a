"""The tree op under torch.compile: one graph for every tree. As `packattn.ops.varlen.traced`: the graph holds
only ``key_end`` (`Tree.row_subtree_end`); the ops here choose the kernels and build the tables when they run,
with the eager path's functions (`tables.tree_tables`)."""

from __future__ import annotations

import torch

from packattn.ops.tree import op
from packattn.ops.tree.tables import tree_tables


class _TreeRows:
    """What `tables.tree_tables` reads of a `Tree`, rebuilt from ``row_subtree_end`` in an op."""

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
    tables = tree_tables(_TreeRows(key_end), q, k, v, need_grad=False)
    return op._tree_fwd(q, k, v, [*tables[:6], *tables[6]], scale)


@traced_tree_fwd.register_fake
def _(q, k, v, key_end, scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packattn::traced_tree_bwd", mutates_args=())
def traced_tree_bwd(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, key_end: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `traced_tree_fwd`."""
    key_end, _, _, dq_tiles, dq_intervals, dkdv_tiles, (cu_rows, row0) = tree_tables(
        _TreeRows(key_end), q, k, v, need_grad=True)
    return op._tree_bwd(dout, dlse, q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0,
                        scale)


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


def traced_tree_attention(q, k, v, tree, scale: float):
    """``(out, lse)``: `op.attention` while torch.compile traces (``scale >= 0``); a tree without sharing runs
    the tree kernels too (eagerly it runs the varlen ones: reading which case applies would be a guard)."""
    key_end = tree.row_subtree_end().to(torch.int32).contiguous()
    return traced_tree_fwd(q, k, v, key_end, scale)
