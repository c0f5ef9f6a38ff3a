"""The tree attention op (`packattn.Tree`): ``torch.library`` custom ops, fake implementations, autograd.

Kernels: the Triton tree forward and dQ (`packattn.ops.tree.kernels_triton`) and the varlen dK/dV with the
tree mask (`packattn.ops.varlen.bwd_triton.bwd_dkdv_kernel` with ``TREE``); on sm_90 the warp-specialised
Gluon kernels where `packattn.ops.tree.configs` says so (forward, dQ; the dK/dV by the varlen rule). The
tables (`packattn.ops.tree.tables.tree_tables`) are built for the kernels chosen; the backward checks that
its dK/dV pass is still the one they were built for.
"""

from __future__ import annotations

import torch

from packattn.ops.runtime import fast_op
from packattn.ops.runtime.launch import LOG2E, NO_MASK, _last_dim_contiguous, _launch, _precision, block_d
from packattn.ops.tree import configs as tree_configs
from packattn.ops.tree.launch_sm90 import gluon_tree_dq, gluon_tree_fwd
from packattn.ops.tree.tables import tree_tables
from packattn.ops.varlen.configs import triton_config
from packattn.ops.varlen.launch_sm90 import gluon_dkdv
from packattn.ops.varlen.launch_triton import bwd_delta, triton_dkdv
from packattn.ops.varlen.op import bwd_plan, check_plan


def _tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[torch.Tensor], scale: float,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``tables``: ``key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles,
    cu_rows, row0`` (`tree_tables`; the dq/dkdv tables and ``cu_rows``/``row0`` are carried for the
    backward). One list, not eight arguments: see `packattn.ops.varlen.op`. ``scale >= 0``."""
    from packattn.ops.tree.kernels_triton import tree_fwd_kernel

    key_end, fwd_tiles, fwd_intervals = tables[:3]
    cfg = tree_configs.tree_fwd_config(q, k, v)
    if cfg is not None:  # the tables were built for it (`tree_tables`)
        return gluon_tree_fwd(q, k, v, key_end, fwd_tiles, fwd_intervals, scale, cfg)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    total, heads_q, head_dim = q.shape
    out = q.new_empty(q.shape)
    lse = torch.empty((heads_q, total), device=q.device, dtype=torch.float32)
    config = triton_config("fwd", q, v)
    args = (q, k, v, out, lse, fwd_tiles, fwd_intervals, key_end,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), total, heads_q, heads_q // k.shape[1], scale * LOG2E)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      INPUT_PRECISION=_precision(q.dtype))
    _launch(tree_fwd_kernel, (fwd_tiles.shape[0] * heads_q,), args, constexprs, config)
    return out, lse


tree_fwd = torch.library.custom_op("packattn::tree_fwd", _tree_fwd, mutates_args=())


@tree_fwd.register_fake
def _tree_fwd_fake(q, *rest):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _tree_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, key_end: torch.Tensor, dq_tiles: torch.Tensor, dq_intervals: torch.Tensor,
    dkdv_tiles: torch.Tensor, cu_rows: torch.Tensor, row0: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, deterministic (no atomics): the varlen dK/dV pass with the tree mask and a dQ pass over
    the query tiles' intervals (the tables were built for the passes chosen here, `tree_tables`)."""
    from packattn.ops.tree.kernels_triton import tree_dq_kernel

    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    lse = lse.contiguous()
    total, heads_q, head_dim = q.shape
    delta = bwd_delta(out, dout, lse, dlse)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    seq_args = (cu_rows, cu_rows, row0, row0)  # the tree as one sequence of all rows
    dkdv_cfg = bwd_plan(q, k, v).dkdv
    if dkdv_cfg is not None:
        gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, NO_MASK, dkdv_cfg, key_end=key_end)
    else:
        triton_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, NO_MASK, key_end=key_end)
    dq_cfg = tree_configs.tree_dq_config(q, k, v)
    if dq_cfg is not None:  # the dq tables were built with its blocks (`tree_configs.dq_blocks`)
        gluon_tree_dq(q, k, v, dout, lse, delta, dq, dq_tiles, dq_intervals, key_end, scale, dq_cfg)
        return dq, dk, dv
    config = triton_config("dq", q, v)  # (the blocks of `tree_configs.dq_blocks`)
    args = (q, k, v, dout, lse, delta, dq, dq_tiles, dq_intervals, key_end,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
            total, heads_q, heads_q // k.shape[1], scale * LOG2E, scale)
    _launch(tree_dq_kernel, (dq_tiles.shape[0] * heads_q,), args,
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 INPUT_PRECISION=_precision(q.dtype)), config)
    return dq, dk, dv


tree_bwd = torch.library.custom_op("packattn::tree_bwd", _tree_bwd, mutates_args=())


@tree_bwd.register_fake
def _tree_bwd_fake(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, tables, scale = inputs
    key_end, _fwd_tiles, _fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0 = tables
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0)
    ctx.scale = scale
    ctx.plan = bwd_plan(q, k, v)  # the dK/dV pass dkdv_tiles was built for (checked in the backward)
    ctx.set_materialize_grads(False)


def _backward_through(bwd):
    """The backward of ``packattn::tree_fwd`` computing its gradients with ``bwd`` (the
    ``packattn::tree_bwd`` op, or its implementation on the eager path, `fast_op`)."""

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0 = ctx.saved_tensors
        now = bwd_plan(q, k, v)
        check_plan(ctx.plan, now)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(dout, dlse, q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0,
                         ctx.scale)
        return dq, dk, dv, [None] * 8, None  # the structure of the inputs (q, k, v, tables, scale)

    return backward


tree_fwd.register_autograd(_backward_through(tree_bwd), setup_context=_setup_context)
_TreeFwdEager = fast_op.eager_function(_tree_fwd, _setup_context, _backward_through(_tree_bwd))


def attention(q, k, v, tree, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of tree attention, differentiable (eagerly through `fast_op`); ``scale >= 0``."""
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, (cu_rows, row0) = tree_tables(
        tree, q, k, v, need_grad)
    tables = [key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0]
    return fast_op.call(tree_fwd, _TreeFwdEager.apply, q, k, v, tables, scale)
