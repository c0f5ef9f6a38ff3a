"""Triton tree attention (`packattn.Tree`): tables, launchers, ``torch.library`` custom ops, the backend.

Kernels: `packattn.ops.tree.kernels_triton` (forward, dQ) and `packattn.ops.varlen.bwd_triton.bwd_dkdv_kernel`
with ``TREE=True`` (dK/dV); on sm_90 (fp16 / bf16) the warp-specialised Gluon kernels instead where
they apply: forward `packattn.ops.tree.launch_sm90_fwd` (head dims 64 / 128), dK/dV
`triton_bwd_gluon.gluon_launch_dkdv(..., key_end=...)` and dQ `packattn.ops.tree.launch_sm90_dq`
(head dim 128). Each choice depends only on dtypes, shapes, device and the environment, so the
forward (which builds the tables for the chosen kernels) and the backward agree. The tree is one "sequence" of ``total`` rows; key ``s`` is visible
to queries ``s <= t < key_end[s]`` with ``key_end = tree.row_subtree_end()``.

Tables, built once per tree and block size with device ops (cached on the `Tree`, no host sync):

* query tiles (forward, dQ): per key block ``j`` the min / max of ``key_end`` over its rows; key
  block ``j`` is *visible* to query tile ``[m0, m1)`` when ``n0 < m1`` and ``max_end > m0``, and
  *full* (no element mask) when it is complete, ``n1 - 1 <= m0`` and ``min_end >= m1``. Runs of
  consecutive blocks of the same kind (0 invisible, 1 masked, 2 full) become intervals
  ``[lo, hi, kind]``; each tile row is ``[q_start, first_interval, num_intervals]``. This compares
  every (query tile, key block) pair: ``O(total^2 / (BLOCK_M * BLOCK_N))`` small integers.
* key tiles (dK/dV, the varlen row format ``[0, k_start, lo, mid_lo, mid_hi, hi]``): the queries
  that see key tile ``[n0, n1)`` are ``[n0, max_end)``, every pair visible for queries in
  ``[n1 - 1, min_end)``.
"""

from __future__ import annotations

import torch

from packattn.ops.runtime import fast_op
from packattn.backends.base import Problem
from packattn.backends.triton_base import TritonBackend, device_unsupported
from packattn.ops.runtime.launch import _last_dim_contiguous, _launch, _precision, block_d, launch_config
from packattn.backends.triton_varlen import (
    TritonVarlenBackend, kernel_limits, bwd_delta, check_dkdv_choice, dkdv_choice, launch_dkdv, unmasked_band,
)
from packattn.mask import Mask
from packattn.tree.blocks import FULL, MASKED, block_end_range, block_kinds  # noqa: F401 (kinds re-exported)


def build_query_tiles(key_end: torch.Tensor, total: int, block_m: int, block_n: int):
    """``(tiles int32 (num_tiles, 3), intervals int32 (n, 3))`` for the forward and dQ kernels."""
    device = key_end.device
    nq, nk = -(-total // block_m), -(-total // block_n)
    kind = block_kinds(key_end, total, block_m, block_n)
    padded = torch.nn.functional.pad(kind, (1, 1))  # (nq, nk + 2), zero columns on both sides
    change = padded[:, 1:] != padded[:, :-1]  # (nq, nk + 1): a run of one kind starts at block c
    # boundaries in row-major order, without a host sync: scatter each into its rank among all
    # boundaries; unused slots (and the dump slot at the end) keep kind 0
    flat = change.flatten()
    slots = nq * (nk + 1)
    rank = torch.cumsum(flat.to(torch.int64), 0) - 1
    where = torch.where(flat, rank, torch.full_like(rank, slots))
    column = torch.arange(nk + 1, device=device).repeat(nq)
    starts = torch.zeros(slots + 1, dtype=torch.int64, device=device).scatter_(0, where, column)
    kinds = torch.zeros(slots + 1, dtype=torch.int64, device=device).scatter_(
        0, where, padded[:, 1:].flatten().long())
    # a run ends where the next boundary (same row: every row ends with a change to kind 0) starts
    ends = torch.cat([starts[1:], starts.new_zeros(1)])
    intervals = torch.stack([starts * block_n, (ends * block_n).clamp(max=nk * block_n), kinds], 1)
    counts = change.sum(1)
    first = torch.cumsum(counts, 0) - counts
    m0 = torch.arange(nq, device=device) * block_m
    tiles = torch.stack([m0, first, counts], 1)
    order = torch.argsort((kind > 0).sum(1), descending=True, stable=True)  # longest work first
    return tiles[order].to(torch.int32).contiguous(), intervals.to(torch.int32).contiguous()


def build_key_tiles(key_end: torch.Tensor, total: int, block_n: int, step: int) -> torch.Tensor:
    """``int32 (num_key_tiles, 6)`` rows ``[0, k_start, lo, mid_lo, mid_hi, hi]`` (query positions),
    the row format of the varlen dK/dV kernel."""
    device = key_end.device
    nk = -(-total // block_n)
    n0 = torch.arange(nk, device=device) * block_n
    n1 = (n0 + block_n).clamp(max=total)
    low, high = block_end_range(key_end, total, block_n)
    lo, hi = n0, high.clamp(max=total)
    empty = lo >= hi
    mid_lo, mid_hi = unmasked_band(lo, hi, n1 - 1, low.clamp(max=total), step, empty)
    order = torch.argsort(hi - lo, descending=True, stable=True)
    table = torch.stack([torch.zeros_like(n0), n0, lo, mid_lo, mid_hi, hi], 1)[order]
    return table.to(torch.int32).contiguous()


def tree_tables(tree, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_grad: bool) -> tuple:
    """(key_end, fwd tiles, fwd intervals, dq tiles, dq intervals, dkdv tiles, extents), cached on the tree.
    The dK/dV key tiles are built for the pass `tree_bwd` runs on these tensors (`dkdv_blocks`: the Gluon
    warp-specialised one where `use_gluon_dkdv`, the Triton one otherwise): both sides decide from
    dtypes, shapes, device and the environment only, so they agree. The dQ tables serve the Triton and
    the Gluon tree dQ alike (`use_gluon_tree_dq` requires the Gluon blocks to be ``launch_config``'s)."""
    from packattn.ops.tree.launch_sm90_fwd import tree_fwd_blocks, use_gluon_tree_fwd
    from packattn.backends.triton_varlen import dkdv_blocks

    head_dim, dtype, device = q.shape[-1], q.dtype, q.device
    if use_gluon_tree_fwd(q, k, v):
        fwd_blocks = tree_fwd_blocks(head_dim)
    else:
        fwd = launch_config("fwd", head_dim, dtype, device)
        fwd_blocks = (fwd.block_m, fwd.block_n)
    dq = launch_config("dq", head_dim, dtype, device)
    dkdv_keys, dkdv_step = dkdv_blocks(q, k, v)
    total = tree.total
    key_end = tree.cached("triton_tree_key_end", lambda: tree.row_subtree_end().to(torch.int32).contiguous())

    def query_tables(block_m: int, block_n: int):
        return tree.cached(("triton_tree_query_tiles", block_m, block_n),
                           lambda: build_query_tiles(key_end, total, block_m, block_n))

    fwd_tiles, fwd_intervals = query_tables(*fwd_blocks)
    if need_grad:
        dq_tiles, dq_intervals = query_tables(dq.block_m, dq.block_n)
        dkdv_tiles = tree.cached(("triton_tree_key_tiles", dkdv_keys, dkdv_step),
                                 lambda: build_key_tiles(key_end, total, dkdv_keys, dkdv_step))
    else:
        dq_tiles, dq_intervals, dkdv_tiles = fwd_tiles[:0], fwd_intervals[:0], fwd_tiles.new_empty(0, 6)
    # the dK/dV kernel reads the tree as one sequence of `total` rows
    extents = tree.cached("triton_tree_extents",
                          lambda: (torch.tensor([0, total], dtype=torch.int32, device=device),
                                   torch.zeros(1, dtype=torch.int32, device=device)))
    return key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, extents


# ---------------------------------------------------------------- custom ops
def _tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[torch.Tensor], scale: float,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``tables``: ``key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles,
    cu_rows, row0`` (`tree_tables`; the dq/dkdv tables and ``cu_rows``/``row0`` are carried for the
    backward). One list, not eight arguments: see `triton_varlen.FWD_TABLES`."""
    from packattn.ops.tree.launch_sm90_fwd import gluon_tree_fwd, use_gluon_tree_fwd
    from packattn.ops.tree.kernels_triton import tree_fwd_kernel

    key_end, fwd_tiles, fwd_intervals = tables[:3]
    if use_gluon_tree_fwd(q, k, v):  # the tables were built for it (`tree_tables`)
        return gluon_tree_fwd(q, k, v, key_end, fwd_tiles, fwd_intervals, scale)

    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    total, heads_q, head_dim = q.shape
    out = q.new_empty(q.shape)
    lse = torch.empty((heads_q, total), device=q.device, dtype=torch.float32)
    config = launch_config("fwd", head_dim, q.dtype, q.device)
    args = (q, k, v, out, lse, fwd_tiles, fwd_intervals, key_end,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), total, heads_q, heads_q // k.shape[1],
            scale * 1.4426950408889634)
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
    """``(dq, dk, dv)``, deterministic (no atomics): the varlen dK/dV pass with the tree mask and a
    dQ pass over the query tiles' intervals; on sm_90 the Gluon warp-specialised kernels where
    `use_gluon_dkdv` / `use_gluon_tree_dq` say so (the tables were built for them, `tree_tables`)."""
    from packattn.ops.tree.launch_sm90_dq import gluon_tree_dq, use_gluon_tree_dq
    from packattn.backends.triton_varlen import use_gluon_dkdv
    from packattn.ops.tree.kernels_triton import tree_dq_kernel

    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    lse = lse.contiguous()
    total, heads_q, head_dim = q.shape
    delta = bwd_delta(out, dout, lse, dlse)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), INPUT_PRECISION=_precision(q.dtype),
                  HAS_LEFT=False, HAS_RIGHT=False, HAS_CHUNK=False, TOP_LEFT=False)
    seq_args = (cu_rows, cu_rows, row0, row0)  # the tree as one sequence of all rows
    if use_gluon_dkdv(q, k, v):
        from packattn.ops.varlen.launch_sm90_bwd import gluon_launch_dkdv

        gluon_launch_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, (-1, -1, 0), False,
                          key_end=key_end)
    else:
        launch_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, key_end, scale, (0, 0, 0), common,
                    tree=True)
    if use_gluon_tree_dq(q, k, v):  # same blocks as the Triton dQ: the dq tables fit both
        gluon_tree_dq(q, k, v, dout, lse, delta, dq, dq_tiles, dq_intervals, key_end, scale)
        return dq, dk, dv
    config = launch_config("dq", head_dim, q.dtype, q.device)
    args = (q, k, v, dout, lse, delta, dq, dq_tiles, dq_intervals, key_end,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
            total, heads_q, heads_q // k.shape[1], scale * 1.4426950408889634, scale)
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
    ctx.dkdv_choice = dkdv_choice(q, k, v)  # what dkdv_tiles was built for (checked in the backward)
    ctx.set_materialize_grads(False)


def _backward_through(bwd):
    """The backward of ``packattn::tree_fwd`` computing its gradients with ``bwd`` (the
    ``packattn::tree_bwd`` op, or its implementation on the eager path, `fast_op`)."""

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0 = ctx.saved_tensors
        check_dkdv_choice(ctx.dkdv_choice, q, k, v)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(dout, dlse, q, k, v, out, lse, key_end, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0,
                         ctx.scale)
        return dq, dk, dv, [None] * 8, None  # the structure of the inputs (q, k, v, tables, scale)

    return backward


tree_fwd.register_autograd(_backward_through(tree_bwd), setup_context=_setup_context)
_TreeFwdEager = fast_op.eager_function(_tree_fwd, _setup_context, _backward_through(_tree_bwd))


# ---------------------------------------------------------------- backend
class TritonTreeBackend(TritonBackend):
    """Our Triton tree kernels: a `Tree` descriptor, GQA/MQA, lse, deterministic backward."""

    name = "triton_tree"

    def unsupported(self, params) -> str | None:
        if params.kind != "tree":
            return "handles tree descriptors only"
        if (why := device_unsupported(params.device_type)) is not None:
            return why
        return kernel_limits(params)

    def run(self, problem: Problem):
        if torch.compiler.is_compiling():  # one graph for every tree: tables built when the op runs
            from packattn.ops.traced import traced_tree_attention

            q, scale = (-problem.q, -problem.scale) if problem.scale < 0 else (problem.q, problem.scale)
            return traced_tree_attention(q, problem.k, problem.v, problem.seqs, scale, problem.return_lse)
        if problem.seqs.varlen_equivalent is not None:  # no sharing: exactly causal varlen, run as such
            seqs = problem.seqs.varlen_equivalent
            return TritonVarlenBackend().run(Problem(problem.q, problem.k, problem.v, seqs, Mask.make(True),
                                                     problem.scale, problem.return_lse, problem.deterministic))
        q, k, v, tree = problem.q, problem.k, problem.v, problem.seqs
        scale = problem.scale
        if scale < 0:  # the kernels need scale >= 0: (q, -s) gives the same scores as (-q, s)
            q, scale = -q, -scale
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, (cu_rows, row0) = tree_tables(
            tree, q, k, v, need_grad)
        out, lse = fast_op.call(
            tree_fwd, _TreeFwdEager.apply, q, k, v, [key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, cu_rows, row0], scale)
        return out, (lse if problem.return_lse else None)
