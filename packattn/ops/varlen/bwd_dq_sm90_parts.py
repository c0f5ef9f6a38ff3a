"""Warp-specialised dQ backward for Hopper (sm_90a) at head dims in column parts (96 = 64 + 32, 192 = 128 + 64) and
with a value head dim of its own (MLA: 192/128, 128/64): `varlen_bwd_dq_parts_kernel`.

The contract, partitions, ring, barriers, tail rendezvous and DELTA_FROM_O are those of
`packattn.ops.varlen.bwd_dq_sm90` (module docstring); the tensors are held in column parts
(`packattn.ops.varlen.bwd_parts_sm90`): Q, K in parts of ``HEAD_DIM``, dO, V, O in parts of ``HEAD_DIM_V``.
Each consumer owns one dQ accumulator per part of ``HEAD_DIM`` (d = 192: 64 + 32 float32 registers per thread).

Step ``j`` of one consumer (no dS carried across steps, at any ``STAGES``)::

    wait   ready[j % S]; tail block only: zero the K / V rows past len_kv (as there, per part)
    issue  S = Q_hi K_hi^T (+ Q_lo K_lo^T)           (1-2 async groups chained on one accumulator)
    issue  dP = dO_hi V_hi^T (+ dO_lo V_lo^T)        (NDP = 1-2 groups)
    (first step with DELTA_FROM_O: delta = rowsum(dO O) over the value parts, stored; `_delta_from_o`)
    wait   until NDP pending                         (S done; dP runs under P)
    P = exp2(S c - lse log2e), masked; wait 0; dS = P (dP - delta)
    issue  dQ_part += dS K_part for each part; wait 0; arrive empty[j % S]

The output is stored from registers (`bwd_common_sm90._store_direct`), per part at its columns. Shared memory
(contract with `packattn.ops.varlen.launch_sm90_bwd_parts.dq_parts_shared_bytes`): Q, dO (and O) of the tile,
the (K, V) ring, the mbarriers.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma_wait,
)

from packattn.ops.varlen.bwd_common_sm90 import (
    _lse_log2,
    _probs,
    _row_vector,
    _store_direct,
)
from packattn.ops.varlen.bwd_dkdv_sm90_parts import (
    _chain_t,
    _into_parts,
    _new_acc,
    groups,
)
from packattn.ops.varlen.bwd_dq_sm90_delta import _delta_from_o
from packattn.ops.varlen.bwd_dq_sm90_load import _dq_tile
from packattn.ops.varlen.bwd_parts_sm90 import (
    _alloc_parts,
    _dq_parts_producer,
    part_lo,
)
from packattn.ops.varlen.bwd_ws_sm90 import _tile_barriers, _zero_tails, ws_partitions
from packattn.ops.varlen.common_sm90 import mma_layout
from packattn.ops.varlen.fwd_sm90_parts import part_hi

WG_ROWS = gl.constexpr(64)  # queries per consumer warp group


@gluon.jit
def _dq_parts_step(j, n_start, accs, ntail, q_wg, q_lo_wg, do_wg, do_lo_wg, o_wg, o_lo_wg, k_hi, k_lo, v_hi, v_lo,
                   ready, empty, zero_bar, lse_log2, delta, delta_ptr, delta_rows, offs_m, n_mid_lo, n_mid_hi, len_q,
                   len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout: gl.constexpr,
                   WG: gl.constexpr, BLOCK_N: gl.constexpr, D_LO: gl.constexpr, DV_LO: gl.constexpr,
                   STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr,
                   TOP_LEFT: gl.constexpr, CONSUMERS: gl.constexpr, FIRST_DELTA: gl.constexpr):
    """Ring step ``j`` (key block ``n_start``) of one consumer; ``accs = (dq_hi, dq_lo)``. ``FIRST_DELTA``: compute
    delta from dO / O (``delta`` ignored), store it at ``delta_ptr[i]`` for ``i < delta_rows`` and return it.
    Returns ``(accs, ntail, delta)`` with no wgmma in flight."""
    dq_hi, dq_lo = accs
    slot = j % STAGES
    mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
    kh, kl, vh, vl = k_hi.index(slot), k_lo.index(slot), v_hi.index(slot), v_lo.index(slot)
    if n_start + BLOCK_N > len_kv:  # keys past the sequence: zeros, not NaN, enter dQ
        ntail = _zero_tails(kh, kl, vh, vl, n_start, len_kv, ntail, zero_bar, BLOCK_N, D_LO, DV_LO, WG, CONSUMERS)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    s_tok = _chain_t(q_wg, q_lo_wg, kh, kl, s_zero, D_LO)
    dp_tok = _chain_t(do_wg, do_lo_wg, vh, vl, s_zero, DV_LO)
    if FIRST_DELTA:  # under the S / dP wgmma (which only read Q, dO, K, V)
        delta = _delta_from_o(do_wg, o_wg, do_lo_wg, o_lo_wg, delta_ptr, delta_rows, s_layout, DV_LO)
    s = warpgroup_mma_wait(groups(True, DV_LO > 0), deps=(s_tok, ))
    p = _probs(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left,
               window_right, chunk_size, BLOCK_N, s_layout, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = p * (dp - delta[:, None])
    dq_hi, dq_lo = _into_parts(ds, q_wg.dtype, kh, kl, dq_hi, dq_lo, True, D_LO > 0)
    dq_hi, dq_lo = warpgroup_mma_wait(0, deps=(dq_hi, dq_lo))
    mbarrier.arrive(empty.index(slot), count=1)
    return (dq_hi, dq_lo), ntail, delta


@gluon.jit
def _dq_parts_blocks(accs, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, Lse, Delta,
                     stride_lse_head, qk_scale_log2, window_left, window_right, chunk_size, q_wg, q_lo_wg, do_wg,
                     do_lo_wg, o_wg, o_lo_wg, k_hi, k_lo, v_hi, v_lo, q_bar, ready, empty, zero_bar,
                     s_layout: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr, D_LO: gl.constexpr,
                     DV_LO: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                     HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, CONSUMERS: gl.constexpr,
                     DELTA_FROM_O: gl.constexpr):
    """The tile's ``num_blocks >= 1`` key blocks (`bwd_dq_sm90._consume_item` with parts): lse (and delta, unless
    ``DELTA_FROM_O``: then the first step computes it), wait for Q / dO, the steps. Returns ``accs``."""
    first = q_start + WG * WG_ROWS
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = first + gl.arange(0, WG_ROWS, layout=row_layout)
    lse_log2 = _lse_log2(Lse, head, stride_lse_head, row0_q, first, len_q, WG_ROWS, row_layout)
    delta_ptr = Delta + (head.to(gl.int64) * stride_lse_head + row0_q.to(gl.int64) + first)
    ntail = n_lo * 0
    if DELTA_FROM_O:
        mbarrier.wait(q_bar, 0)
        accs, ntail, delta = _dq_parts_step(0, n_lo, accs, ntail, q_wg, q_lo_wg, do_wg, do_lo_wg, o_wg, o_lo_wg, k_hi,
                                            k_lo, v_hi, v_lo, ready, empty, zero_bar, lse_log2, None, delta_ptr,
                                            len_q - first, offs_m, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2,
                                            window_left, window_right, chunk_size, s_layout, WG, BLOCK_N, D_LO,
                                            DV_LO, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, True)
        start = 1
    else:
        delta = _row_vector(Delta, head, stride_lse_head, row0_q, first, len_q, WG_ROWS, row_layout, 0.0)
        mbarrier.wait(q_bar, 0)
        start = 0
    for b in range(start, num_blocks):
        accs, ntail, delta = _dq_parts_step(b, n_lo + b * BLOCK_N, accs, ntail, q_wg, q_lo_wg, do_wg, do_lo_wg, o_wg,
                                            o_lo_wg, k_hi, k_lo, v_hi, v_lo, ready, empty, zero_bar, lse_log2, delta,
                                            delta_ptr, len_q - first, offs_m, n_mid_lo, n_mid_hi, len_q, len_kv,
                                            qk_scale_log2, window_left, window_right, chunk_size, s_layout, WG,
                                            BLOCK_N, D_LO, DV_LO, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT,
                                            CONSUMERS, False)
    return accs


@gluon.jit
def _dq_parts_consumer(dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                       stride_dq_row, stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section,
                       qk_scale_log2, scale, window_left, window_right, chunk_size, q_hi, q_lo, do_hi, do_lo, o_hi,
                       o_lo, k_hi, k_lo, v_hi, v_lo, q_bar, ready, empty, zero_bar, HEAD_DIM: gl.constexpr,
                       HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                       HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                       CONSUMERS: gl.constexpr, DELTA_FROM_O: gl.constexpr, WG: gl.constexpr):
    """Consumer warp group ``WG``: queries ``[64 WG, 64 WG + 64)`` of the program's tile, their dQ parts."""
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    DV_LO: gl.constexpr = part_lo(HEAD_DIM_V)
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
    R0: gl.constexpr = WG * WG_ROWS
    accs = (_new_acc(True, D_HI), _new_acc(D_LO > 0, D_LO))
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N)
    if num_blocks > 0:
        accs = _dq_parts_blocks(accs, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q,
                                Lse, Delta, stride_lse_head, qk_scale_log2, window_left, window_right, chunk_size,
                                q_hi.slice(R0, WG_ROWS, dim=0), q_lo.slice(R0, WG_ROWS, dim=0),
                                do_hi.slice(R0, WG_ROWS, dim=0), do_lo.slice(R0, WG_ROWS, dim=0),
                                o_hi.slice(R0, WG_ROWS, dim=0), o_lo.slice(R0, WG_ROWS, dim=0), k_hi, k_lo, v_hi,
                                v_lo, q_bar, ready, empty, zero_bar, s_layout, WG, BLOCK_N, D_LO, DV_LO, STAGES,
                                HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, DELTA_FROM_O)
    dq_hi, dq_lo = accs
    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N, True)
    if seq >= 0:
        base = dQ + row0_q.to(gl.int64) * stride_dq_row + head.to(gl.int64) * stride_dq_head
        _store_direct(dq_hi * scale, base, q_start + R0, len_q, stride_dq_row, WG_ROWS, D_HI, mma_layout(4, D_HI))
        if D_LO > 0:
            _store_direct(dq_lo * scale, base + D_HI, q_start + R0, len_q, stride_dq_row, WG_ROWS, D_LO,
                          mma_layout(4, D_LO))


_partitions = ws_partitions(_dq_parts_consumer, _dq_parts_producer)  # consumer 1: queries 64..127


# ---------------------------------------------------------------- kernel
@gluon.jit
def varlen_bwd_dq_parts_kernel(
    q_desc, k_desc, v_desc, do_desc, o_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, o_lo_desc, Lse, Delta, dQ,
    tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_dq_row, stride_dq_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size, heads_per_section,
    num_work,
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr,
    TOP_LEFT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    DELTA_FROM_O: gl.constexpr = False,
):
    """`bwd_dq_sm90.varlen_bwd_dq_gluon_ws_kernel` with column parts (module docstring). Descriptors from
    `launch_sm90.part_descriptors` (a ``lo`` one None where its dim has one part; ``o_desc`` / ``o_lo_desc`` None
    without ``DELTA_FROM_O``)."""
    CONSUMERS: gl.constexpr = BLOCK_M // WG_ROWS
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((BLOCK_M == WG_ROWS) | (BLOCK_M == 2 * WG_ROWS), "one or two consumer warp groups of 64 queries")
    gl.static_assert((BLOCK_N == 64) | (BLOCK_N == 128), "key block: 64 or 128 rows")
    gl.static_assert(STAGES >= 2, "ring of at least two (K, V) slots")
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    DV_HI: gl.constexpr = part_hi(HEAD_DIM_V)
    DV_LO: gl.constexpr = part_lo(HEAD_DIM_V)
    q_hi, q_lo = _alloc_parts(q_desc, q_lo_desc, 0, BLOCK_M, D_HI, D_LO)
    do_hi, do_lo = _alloc_parts(do_desc, do_lo_desc, 0, BLOCK_M, DV_HI, DV_LO)
    o_hi, o_lo = do_hi, do_lo  # (unused without DELTA_FROM_O)
    if DELTA_FROM_O:
        o_hi, o_lo = _alloc_parts(o_desc, o_lo_desc, 0, BLOCK_M, DV_HI, DV_LO)
    k_hi, k_lo = _alloc_parts(k_desc, k_lo_desc, STAGES, BLOCK_N, D_HI, D_LO)
    v_hi, v_lo = _alloc_parts(v_desc, v_lo_desc, STAGES, BLOCK_N, DV_HI, DV_LO)
    q_bar, zero_bar, ready, empty = _tile_barriers(STAGES, CONSUMERS)
    _partitions((dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_dq_row,
                 stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
                 window_left, window_right, chunk_size, q_hi, q_lo, do_hi, do_lo, o_hi, o_lo, k_hi, k_lo, v_hi, v_lo,
                 q_bar, ready, empty, zero_bar, HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                 TOP_LEFT, CONSUMERS, DELTA_FROM_O),
                (q_desc, k_desc, v_desc, do_desc, o_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, o_lo_desc, tiles,
                 cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, q_hi, q_lo, do_hi, do_lo, o_hi, o_lo, k_hi, k_lo, v_hi, v_lo, q_bar, ready, empty,
                 HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, DELTA_FROM_O),
                CONSUMERS, CONSUMER_REGS, PRODUCER_REGS)
