"""Warp-specialised dK/dV backward for Hopper (sm_90a) at head dims 192 and 256 with the KEYS split over the two
consumer warp groups (FlashAttention-3's hdim-192 / 256 layout): `varlen_bwd_dkdv_ksplit_kernel`.

Contract, tile table, work order, producer, ring, lse / delta slots, tail rendezvous and masks (``TREE`` included)
are those of `packattn.ops.varlen.bwd_dkdv_sm90` / `packattn.ops.varlen.bwd_dkdv_sm90_parts` (module docstrings):
one program per (64-key tile, kv head), ``tile_table(seqs, mask, True, 64, 64)``, the GQA group's query heads in
order, 64 queries a ring step, the parts producer (`bwd_parts_sm90._dkdv_parts_producer`; one part at 256, 128 + 64
at 192). Deterministic: every output element is summed by one warp group in step order, no atomics.

Each group computes the NON-transposed ``S = Q K_w^T`` and ``dP = dO V_w^T`` for its own 32 keys ``w`` only (queries
are the wgmma M, lse / delta are per-row values), writes ``P^T`` and ``dS^T`` (input dtype) into its 32 rows of
two shared ``[64 keys, 64 queries]`` buffers, and after a rendezvous of both groups accumulates ``dV += P^T dO``
and ``dK += dS^T Q`` over ALL 64 keys (keys are the wgmma M) for the columns it owns (`own_width`): 4 MMA units a
step (two groups each computing S^T and dP^T over all 64 keys and dK / dV over half the columns would take 6).
Column ownership: at 256 group ``w`` owns columns ``[128 w, 128 w + 128)`` of dK and dV; at 192 group 0 the
128-column part, group 1 the 64-column part. V and dO have q/k's head dim (d_v = d).

Step ``it`` of consumer ``w`` (enters and leaves with no wgmma in flight)::

    wait   ready[slot]; tail step: zero Q (group 0) / dO (group 1) rows past len_q, rendezvous on zero_bar
    issue  S = Q K_w^T, dP = dO V_w^T                       (async, chained over column parts)
    wait   S; P = exp2(S c - lse log2e), masked off the band; P^T -> pt[it % 2] rows of w   (dP runs)
    fence; group barrier; arrive + wait p_bar               (both groups' P^T are in shared memory)
    issue  dV_own += pt dO_own                              (async)
    wait   dP (dV runs); dS = P (dP - delta); dS^T -> dst[it % 2] rows of w
    fence; group barrier; arrive + wait ds_bar
    issue  dK_own += dst Q_own; wait 0; arrive empty[slot]

``p_bar`` / ``ds_bar`` (count 2, one arrival per group a step, parity ``it & 1``): neither group can arrive
twice before the other arrived once. The P^T / dS^T buffers are double (``it % 2``): a group writes buffer ``b``
at step ``it`` only after the other group arrived at step ``it - 1``, i.e. after its products of step ``it - 2``
(which read ``b``) completed.

Register budget (d = 256, per consumer thread, 240): dK + dV 64 x 128 float32 each = 128, S and dP (64 x 32) 16
each, P kept 16, lse / delta 2 each. The mask compares the step's query rows with two per-key bounds read from a
small shared table (``bnd``: `_query_bounds` of the group's 32 keys, written once), in masked steps only.

Shared memory (contract with `packattn.ops.varlen.launch_sm90_ksplit.ksplit_shared_bytes`): K and V of the tile,
the (Q, dO) ring, lse / delta per slot, the P^T / dS^T double buffers, the bounds tables, the mbarriers. The
outputs are stored from registers (`bwd_common_sm90._store_direct`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from packattn.ops.runtime.gluon_compat import thread_barrier
from packattn.ops.varlen.bwd_common_sm90 import LOG2E, _query_bounds, _store_direct
from packattn.ops.varlen.bwd_dkdv_sm90_load import _dkdv_tile
from packattn.ops.varlen.bwd_dkdv_sm90_parts import _chain_t
from packattn.ops.varlen.bwd_parts_sm90 import (
    _alloc_parts,
    _dkdv_parts_producer,
    part_lo,
)
from packattn.ops.varlen.bwd_ws_sm90 import _zero_tails, ws_partitions
from packattn.ops.varlen.common_sm90 import mma_layout
from packattn.ops.varlen.common_sm90_ws import _opaque_program_id, _ring_barriers
from packattn.ops.varlen.fwd_sm90_parts import part_hi

TILE_KEYS = gl.constexpr(64)  # keys per program (the dK / dV wgmma M)
WG_KEYS = gl.constexpr(32)  # keys of S / dP per consumer warp group
STEP_QUERIES = gl.constexpr(64)  # queries per ring step (the S / dP wgmma M)


# ---------------------------------------------------------------- column ownership (compile time)
@gluon.constexpr_function
def own_part(wg, dim):
    """The column part (0: hi, 1: lo) of a head dim ``dim`` holding consumer ``wg``'s dK / dV columns."""
    return 0 if part_lo(dim) == 0 else int(wg)


@gluon.constexpr_function
def own_width(wg, dim):
    """How many columns of a head dim consumer ``wg`` owns: half of a power of two, else its own part."""
    if part_lo(dim) == 0:
        return int(dim) // 2
    return part_hi(dim) if int(wg) == 0 else part_lo(dim)


@gluon.constexpr_function
def own_offset(wg, dim):
    """The first owned column inside the owned part's buffer."""
    return int(wg) * (int(dim) // 2) if part_lo(dim) == 0 else 0


@gluon.constexpr_function
def own_col(wg, dim):
    """The first owned column in the head dim (the output's column)."""
    if part_lo(dim) == 0:
        return int(wg) * (int(dim) // 2)
    return 0 if int(wg) == 0 else part_hi(dim)


@gluon.jit
def _own_cols(hi, lo, WG: gl.constexpr, DIM: gl.constexpr):
    """Consumer ``WG``'s columns of one slot of a tensor held in parts ``hi`` / ``lo``: a ``[rows, own_width]``
    view (a wgmma B operand)."""
    if own_part(WG, DIM) == 0:
        buf = hi
    else:
        buf = lo
    if own_width(WG, DIM) < buf.shape[1]:
        buf = buf.slice(own_offset(WG, DIM), own_width(WG, DIM), dim=1)
    return buf


# ---------------------------------------------------------------- consumers
@gluon.jit
def _probs(s, lse_log2, m_start, m_mid_lo, m_mid_hi, qk_scale_log2, bnd, s_layout: gl.constexpr, WG: gl.constexpr):
    """``P = exp2(S c - lse log2e)`` of one step's (64 queries, 32 keys); outside the fully visible band the
    queries ``[q_lo(k), q_hi(k))`` of each key (``bnd`` rows ``2 WG`` / ``2 WG + 1``) see it, the others get P = 0."""
    p = gl.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if (m_start < m_mid_lo) | (m_start >= m_mid_hi):
        rows = m_start + gl.arange(0, STEP_QUERIES, layout=gl.SliceLayout(1, s_layout))
        q_lo = bnd.index(2 * WG).load(gl.SliceLayout(0, s_layout))
        q_hi = bnd.index(2 * WG + 1).load(gl.SliceLayout(0, s_layout))
        ok = (rows[:, None] >= q_lo[None, :]) & (rows[:, None] < q_hi[None, :])
        p = gl.where(ok, p, 0.0)
    return p


@gluon.jit
def _exchange(x, bufs, it, bar, WG: gl.constexpr):
    """Write ``x^T`` (this group's 32 keys x 64 queries, input dtype) into its rows of ``bufs[it % 2]``, then
    rendezvous with the other group on ``bar`` (parity ``it & 1``); returns the full ``[64, 64]`` buffer."""
    buf = bufs.index(it % 2)
    buf.slice(WG * WG_KEYS, WG_KEYS, dim=0).store(gl.permute(x.to(bufs.dtype), [1, 0]))
    fence_async_shared()  # generic-proxy stores before the other group's wgmma (async proxy) read them
    thread_barrier()  # (this warp group) every thread's rows are written before the one arrival
    mbarrier.arrive(bar, count=1)
    mbarrier.wait(bar, it & 1)
    return buf


@gluon.jit
def _ksplit_step(it, m_start, dk, dv, ntail, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi, do_lo, stats, pt_bufs,
                 dst_bufs, bnd, ready, empty, zero_bar, p_bar, ds_bar, m_mid_lo, m_mid_hi, len_q, qk_scale_log2,
                 s_layout: gl.constexpr, WG: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Step ``it`` (queries ``m_start ...`` of one query head) of consumer ``WG`` (module docstring); ``k_*`` /
    ``v_*``: this group's 32 keys. Returns ``(dk, dv, ntail)`` with no wgmma in flight."""
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    qh, ql, dh, dl = q_hi.index(slot), q_lo.index(slot), do_hi.index(slot), do_lo.index(slot)
    stat = stats.index(slot)
    if m_start + STEP_QUERIES > len_q:  # rows past the sequence: zeros, not NaN, enter S, dP, dK, dV
        ntail = _zero_tails(qh, ql, dh, dl, m_start, len_q, ntail, zero_bar, STEP_QUERIES, D_LO, D_LO, WG, 2)
    s_zero = gl.zeros([STEP_QUERIES, WG_KEYS], gl.float32, s_layout)
    s_tok = _chain_t(qh, ql, k_hi, k_lo, s_zero, D_LO)
    dp_tok = _chain_t(dh, dl, v_hi, v_lo, s_zero, D_LO)
    lse = stat.slice(0, STEP_QUERIES).load(gl.SliceLayout(1, s_layout))
    lse_log2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # a row that sees no key: P = 0
    s = warpgroup_mma_wait(1 + (D_LO > 0), deps=(s_tok, ))
    p = _probs(s, lse_log2, m_start, m_mid_lo, m_mid_hi, qk_scale_log2, bnd, s_layout, WG)
    pt = _exchange(p, pt_bufs, it, p_bar, WG)
    dv_tok = warpgroup_mma(pt, _own_cols(dh, dl, WG, HEAD_DIM), dv, is_async=True)
    dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    delta = stat.slice(STEP_QUERIES, STEP_QUERIES).load(gl.SliceLayout(1, s_layout))
    dst = _exchange(p * (dp - delta[:, None]), dst_bufs, it, ds_bar, WG)
    dk_tok = warpgroup_mma(dst, _own_cols(qh, ql, WG, HEAD_DIM), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
    mbarrier.arrive(empty.index(slot), count=1)  # this consumer is done with the slot
    return dk, dv, ntail


@gluon.jit
def _fill_bounds(bnd, k_start, KeyEnd, len_q, len_kv, window_left, window_right, chunk_size, WG: gl.constexpr,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                 TREE: gl.constexpr):
    """Write ``q_lo`` / ``q_hi`` (`bwd_common_sm90._query_bounds`) of this group's 32 keys into ``bnd`` rows
    ``2 WG`` / ``2 WG + 1``:
    read back in masked steps only, so no per-key vector lives in registers across the loop."""
    offs_k = k_start + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.BlockedLayout([1], [32], [4], [0]))
    q_lo, q_hi = _query_bounds(offs_k, KeyEnd, len_q, len_kv, window_left, window_right, chunk_size, HAS_LEFT,
                               HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
    bnd.index(2 * WG).store(q_lo)
    bnd.index(2 * WG + 1).store(q_hi)
    thread_barrier()  # (this warp group's threads) before they read it back in another layout


@gluon.jit
def _ksplit_loop(dk, dv, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, KeyEnd,
                 qk_scale_log2, window_left, window_right, chunk_size, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi,
                 do_lo, stats, pt_bufs, dst_bufs, bnd, kv_bar, ready, empty, zero_bar, p_bar, ds_bar,
                 s_layout: gl.constexpr, WG: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                 TREE: gl.constexpr):
    """The ``total > 0`` steps of the program's tile; returns ``(dk, dv)`` with no wgmma in flight."""
    _fill_bounds(bnd, k_start, KeyEnd, len_q, len_kv, window_left, window_right, chunk_size, WG, HAS_LEFT,
                 HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
    m_end = m_lo + num_m_blocks * STEP_QUERIES
    m_start = m_lo  # first query of step it (query heads x blocks, as the producer walks them)
    ntail = m_lo * 0
    mbarrier.wait(kv_bar, 0)
    for it in range(total):
        dk, dv, ntail = _ksplit_step(it, m_start, dk, dv, ntail, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi, do_lo,
                                     stats, pt_bufs, dst_bufs, bnd, ready, empty, zero_bar, p_bar, ds_bar, m_mid_lo,
                                     m_mid_hi, len_q, qk_scale_log2, s_layout, WG, HEAD_DIM, STAGES)
        m_start += STEP_QUERIES
        if m_start == m_end:
            m_start = m_lo
    return dk, dv


@gluon.jit
def _ksplit_consumer(dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd, stride_dk_row,
                     stride_dk_head, stride_dv_row, stride_dv_head, num_heads_kv, group_size, heads_per_section,
                     qk_scale_log2, scale, window_left, window_right, chunk_size, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo,
                     do_hi, do_lo, stats, pt_bufs, dst_bufs, bnd_smem, kv_bar, ready, empty, zero_bar, p_bar, ds_bar,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                     HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, TREE: gl.constexpr, WG: gl.constexpr):
    """Consumer warp group ``WG`` (the last argument, `bwd_ws_sm90.ws_partitions`): S / dP of keys ``[32 WG, 32 WG +
    32)`` of the tile, dK / dV of all 64 keys on its own columns (`own_width`), stored from registers."""
    W: gl.constexpr = own_width(WG, HEAD_DIM)
    KEY0: gl.constexpr = WG * WG_KEYS
    s_layout: gl.constexpr = mma_layout(4, WG_KEYS)  # S, dP: (64 queries, 32 keys)
    dk = gl.zeros([TILE_KEYS, W], gl.float32, mma_layout(4, W))
    dv = gl.zeros([TILE_KEYS, W], gl.float32, mma_layout(4, W))
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, _row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, gl.program_id(0),
                   gl.num_programs(0), num_heads_kv, group_size, heads_per_section, STEP_QUERIES)
    if total > 0:
        dk, dv = _ksplit_loop(dk, dv, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, KeyEnd,
                              qk_scale_log2, window_left, window_right, chunk_size, k_hi.slice(KEY0, WG_KEYS, dim=0),
                              k_lo.slice(KEY0, WG_KEYS, dim=0), v_hi.slice(KEY0, WG_KEYS, dim=0),
                              v_lo.slice(KEY0, WG_KEYS, dim=0), q_hi, q_lo, do_hi, do_lo, stats, pt_bufs, dst_bufs,
                              bnd_smem, kv_bar, ready, empty, zero_bar, p_bar, ds_bar,
                              s_layout, WG, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, _row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                   _opaque_program_id(num_heads_kv), gl.num_programs(0), num_heads_kv, group_size, heads_per_section,
                   STEP_QUERIES)
    if seq >= 0:  # the other group may still read K / V / the exchange buffers: stored from registers
        row0 = row0_kv.to(gl.int64)
        base_v = dV + row0 * stride_dv_row + kv_head.to(gl.int64) * stride_dv_head + own_col(WG, HEAD_DIM)
        base_k = dK + row0 * stride_dk_row + kv_head.to(gl.int64) * stride_dk_head + own_col(WG, HEAD_DIM)
        _store_direct(dv, base_v, k_start, len_kv, stride_dv_row, TILE_KEYS, W, mma_layout(4, W))
        _store_direct(dk * scale, base_k, k_start, len_kv, stride_dk_row, TILE_KEYS, W, mma_layout(4, W))


@gluon.jit
def _ksplit_small_buffers(dtype: gl.constexpr, STAGES: gl.constexpr):
    """``(stats, pt_bufs, dst_bufs, bnd_smem, kv_bar, zero_bar, p_bar, ds_bar, ready, empty)``, barriers initialised:
    lse / delta per ring slot, the P^T / dS^T double buffers ``[2, 64 keys, 64 queries]``, two bounds rows per
    consumer, ``kv_bar`` (count 1), the rendezvous (count 2) and the ring (`_ring_barriers`, two consumers)."""
    stats = gl.allocate_shared_memory(gl.float32, [STAGES, 2 * STEP_QUERIES],
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    xchg: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_KEYS, STEP_QUERIES], dtype)
    pt_bufs = gl.allocate_shared_memory(dtype, [2, TILE_KEYS, STEP_QUERIES], xchg)
    dst_bufs = gl.allocate_shared_memory(dtype, [2, TILE_KEYS, STEP_QUERIES], xchg)
    bnd_smem = gl.allocate_shared_memory(gl.int32, [4, WG_KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    zero_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(zero_bar, count=2)
    mbarrier.init(p_bar, count=2)
    mbarrier.init(ds_bar, count=2)
    # not `bwd_ws_sm90._tile_barriers` (or `bwd_dkdv_sm90._small_buffers`): those initialise the ring before
    # p_bar / ds_bar, which reorders the mbarrier.init instructions (other PTX)
    ready, empty = _ring_barriers(STAGES, 2)
    return stats, pt_bufs, dst_bufs, bnd_smem, kv_bar, zero_bar, p_bar, ds_bar, ready, empty


_partitions = ws_partitions(_ksplit_consumer, _dkdv_parts_producer)  # consumer 1: keys 32..63 of S / dP


# ---------------------------------------------------------------- kernel
@gluon.jit
def varlen_bwd_dkdv_ksplit_kernel(
    q_desc, k_desc, v_desc, do_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, Lse, Delta, dK, dV, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd,
    stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head, stride_lse_head,
    num_heads_kv, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size, heads_per_section,
    num_work,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr,
    TOP_LEFT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    TREE: gl.constexpr = False,
):
    """dK, dV with the keys split over two consumer warp groups (module docstring); arguments as
    `bwd_dkdv_sm90_parts.varlen_bwd_dkdv_parts_kernel` with ``HEAD_DIM_V = HEAD_DIM`` (descriptors from
    `launch_sm90.part_descriptors`, the ``lo`` ones None at 256), ``BLOCK_N = BLOCK_M = 64``."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((BLOCK_N == TILE_KEYS) & (BLOCK_M == STEP_QUERIES), "64-key tiles, 64 queries a step")
    gl.static_assert(STAGES >= 2, "ring of at least two (Q, dO) slots")
    gl.static_assert((HEAD_DIM == 192) | (HEAD_DIM == 256), "head dim 192 or 256")
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    k_hi, k_lo = _alloc_parts(k_desc, k_lo_desc, 0, BLOCK_N, D_HI, D_LO)
    v_hi, v_lo = _alloc_parts(v_desc, v_lo_desc, 0, BLOCK_N, D_HI, D_LO)
    q_hi, q_lo = _alloc_parts(q_desc, q_lo_desc, STAGES, BLOCK_M, D_HI, D_LO)
    do_hi, do_lo = _alloc_parts(do_desc, do_lo_desc, STAGES, BLOCK_M, D_HI, D_LO)
    stats, pt_bufs, dst_bufs, bnd_smem, kv_bar, zero_bar, p_bar, ds_bar, ready, empty = _ksplit_small_buffers(
        k_desc.dtype, STAGES)
    _partitions((dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd, stride_dk_row,
                 stride_dk_head, stride_dv_row, stride_dv_head, num_heads_kv, group_size, heads_per_section,
                 qk_scale_log2, scale, window_left, window_right, chunk_size, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi,
                 do_lo, stats, pt_bufs, dst_bufs, bnd_smem, kv_bar, ready, empty, zero_bar, p_bar, ds_bar, HEAD_DIM,
                 STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE),
                (q_desc, k_desc, v_desc, do_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, Lse, Delta, tiles,
                 cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_lse_head, num_heads_kv, group_size,
                 heads_per_section, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi, do_lo, stats, kv_bar, ready, empty,
                 HEAD_DIM, HEAD_DIM, BLOCK_M, STAGES),
                2, CONSUMER_REGS, PRODUCER_REGS)
