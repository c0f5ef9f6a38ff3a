"""Head dims in column parts for the warp-specialised Gluon forward (`packattn.ops.varlen.fwd_sm90`).

Gluon tensor shapes are powers of two, so a head dim that is not one (96, 192) runs exactly, without padding,
as two column parts: ``hi`` = the widest power of two <= d (`part_hi`), ``lo = d - hi`` (96 = 64 + 32, 192 =
128 + 64). Q, K and V live in shared memory as one buffer per part, each filled by its own TMA box (host
descriptors over the same ``(rows, heads * d)`` view, blocks ``[rows, hi]`` and ``[rows, lo]``: the ``lo``
box at column ``head * d + hi``); ``S = Q_hi K_hi^T + Q_lo K_lo^T`` chains two async wgmma on one accumulator
(`_issue_qk_parts`); the output is one accumulator per value part (`_pv_lo`, `_store_cols`). The value head
dim may differ from the q/k one (MLA: q/k 192 with v 128, q/k 128 with v 64).

Every helper takes the ``lo`` operands as None where a dim has no second part. With q/k and v of one
power-of-two dim the kernel calls none of these helpers but `_issue_qk_parts` (which then is `_issue_qk`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
)

from packattn.ops.runtime.gluon_compat import tma_load
from packattn.ops.varlen.common_sm90 import _issue_qk, _scale_acc, mma_layout
from packattn.ops.varlen.common_sm90_ws import _ring_barriers


@gluon.constexpr_function
def part_hi(head_dim):
    """The widest power of two <= ``head_dim``: the first column part (the whole dim for a power of two)."""
    head_dim = int(head_dim)
    return 1 << (head_dim.bit_length() - 1)


@gluon.constexpr_function
def parts_ok(head_dim):
    """Does the kernel take ``head_dim``: a power of two, or two parts whose second is a power of two >= 16
    (a wgmma K step of 16-bit inputs; a 32-byte TMA box row)?"""
    lo = int(head_dim) - part_hi(head_dim)
    return lo == 0 or (lo >= 16 and lo & (lo - 1) == 0)


@gluon.jit
def _part_buffers(q_desc, k_desc, v_desc, q_lo_desc, k_lo_desc, v_lo_desc, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_HI: gl.constexpr, DV_HI: gl.constexpr,
                  SPLIT_KV: gl.constexpr = False):
    """`common_sm90_ws._ws_buffers` with column parts and a value head dim of its own: ``(q_smem, k_bufs,
    v_bufs, q_lo, k_lo_bufs, v_lo_bufs, q_bar, q_empty, ready, empty)``. Where a descriptor is None (no second
    part) its ``lo`` buffer is the first part's, unused (a name bound to None cannot travel in the tuples of
    ``gl.warp_specialize``): the kernel's partitions test the head dims, not the buffers."""
    NUM_CONSUMERS: gl.constexpr = BLOCK_M // 64
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D_HI], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D_HI], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, DV_HI], v_desc.layout)
    q_lo = q_smem
    k_lo_bufs = k_bufs
    v_lo_bufs = v_bufs
    if q_lo_desc is not None:
        q_lo = gl.allocate_shared_memory(q_lo_desc.dtype, [BLOCK_M, q_lo_desc.block_type.shape[1]], q_lo_desc.layout)
        k_lo_bufs = gl.allocate_shared_memory(k_lo_desc.dtype, [STAGES, BLOCK_N, k_lo_desc.block_type.shape[1]],
                                              k_lo_desc.layout)
    if v_lo_desc is not None:
        v_lo_bufs = gl.allocate_shared_memory(v_lo_desc.dtype, [STAGES, BLOCK_N, v_lo_desc.block_type.shape[1]],
                                              v_lo_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=NUM_CONSUMERS)
    ready, empty = _ring_barriers(STAGES, NUM_CONSUMERS, SPLIT_KV)
    return q_smem, k_bufs, v_bufs, q_lo, k_lo_bufs, v_lo_bufs, q_bar, q_empty, ready, empty


@gluon.jit
def _load_q_parts(q_desc, q_lo_desc, q_smem, q_lo, q_bar, q_empty, loads_q, row, col, D_HI: gl.constexpr):
    """`common_sm90_ws._ws_load_q` of both column parts onto ``q_bar`` (the ``lo`` part at ``col + D_HI``)."""
    mbarrier.wait(q_empty, (loads_q & 1) ^ 1)
    nbytes: gl.constexpr = q_desc.block_type.nbytes + (0 if q_lo_desc is None else q_lo_desc.block_type.nbytes)
    mbarrier.expect(q_bar, nbytes)
    tma_load(q_desc, [row, col], q_bar, q_smem)
    if q_lo_desc is not None:
        tma_load(q_lo_desc, [row, col + D_HI], q_bar, q_lo)


@gluon.jit
def _load_kv_parts(k_desc, v_desc, k_lo_desc, v_lo_desc, k_bufs, v_bufs, k_lo_bufs, v_lo_bufs, ready, block, row0_kv,
                   n_lo, col_k, col_v, num_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_HI: gl.constexpr,
                   DV_HI: gl.constexpr):
    """`common_sm90._load_kv_block` with column parts: K at column ``col_k`` (its ``lo`` part at ``col_k +
    D_HI``), V at ``col_v`` (``lo`` at ``col_v + DV_HI``), all onto the slot's one barrier."""
    slot = block % STAGES
    pred = block < num_blocks
    bar = ready.index(slot)
    row = row0_kv + n_lo + block * BLOCK_N
    nbytes: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                            + (0 if k_lo_desc is None else k_lo_desc.block_type.nbytes)
                            + (0 if v_lo_desc is None else v_lo_desc.block_type.nbytes))
    mbarrier.expect(bar, nbytes, pred=pred)
    tma_load(k_desc, [row, col_k], bar, k_bufs.index(slot), pred=pred)
    if k_lo_desc is not None:
        tma_load(k_lo_desc, [row, col_k + D_HI], bar, k_lo_bufs.index(slot), pred=pred)
    tma_load(v_desc, [row, col_v], bar, v_bufs.index(slot), pred=pred)
    if v_lo_desc is not None:
        tma_load(v_lo_desc, [row, col_v + DV_HI], bar, v_lo_bufs.index(slot), pred=pred)


@gluon.jit
def _issue_qk_parts(q_smem, q_lo, k_bufs, k_lo_bufs, ready, block, s_zero, STAGES: gl.constexpr):
    """`common_sm90._issue_qk` over the column parts: wait for the slot, then ``S = Q_hi K_hi^T`` and ``S +=
    Q_lo K_lo^T`` as two async wgmma groups chained on one accumulator (returns the second's token; waiting
    for it with ``n`` groups pending covers both). Without a ``lo`` part: `_issue_qk` itself (one group)."""
    if q_lo is None:
        tok = _issue_qk(q_smem, k_bufs, ready, block, s_zero, STAGES)
    else:
        slot = block % STAGES
        mbarrier.wait(ready.index(slot), (block // STAGES) & 1)
        tok = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        tok = warpgroup_mma(q_lo, k_lo_bufs.index(slot).permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _pv_lo(p_op, alpha, acc_lo, v_lo_buf, o_lo_layout: gl.constexpr, rescale=True):
    """The value ``lo`` part of one block: rescale ``acc_lo`` by ``alpha`` (``rescale``: `common_sm90._scale_acc`)
    and issue ``acc_lo += P V_lo`` as an async wgmma group (returns its token); ``p_op`` is the hi part's A
    operand, re-laid for this accumulator."""
    acc_lo = _scale_acc(acc_lo, alpha, rescale, o_lo_layout)
    p_lo = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=o_lo_layout, k_width=2))
    return warpgroup_mma(p_lo, v_lo_buf, acc_lo, is_async=True)


@gluon.jit
def _store_cols(acc, l_i, Out, row0_q, q_start, len_q, head, stride_o_row, stride_o_head, col0: gl.constexpr,
                o_layout: gl.constexpr, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr):
    """Store columns ``col0 ... col0 + WIDTH - 1`` of the rows ``q_start + i < len_q``: ``acc / l`` in ``Out``'s
    dtype (0 where ``l = 0``), as `common_sm90_ws._store_out` does for the first part (which also stores lse)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    l_safe = gl.where(l_o == 0.0, 1.0, l_o)
    out = acc * (1.0 / l_safe)[:, None]
    rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, o_layout))
    base = Out + row0_q * stride_o_row + head.to(gl.int64) * stride_o_head
    ptrs = base + rows[:, None] * stride_o_row + cols[None, :]
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < len_q)[:, None])


@gluon.constexpr_function
def lo_mma_layout(head_dim):
    """The wgmma accumulator layout of the second value part of ``head_dim`` (one warp group's 64 rows), None
    where the dim has one part."""
    lo = int(head_dim) - part_hi(head_dim)
    return None if lo == 0 else mma_layout(4, lo)
