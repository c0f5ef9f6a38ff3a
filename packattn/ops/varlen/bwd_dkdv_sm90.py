"""Warp-specialised dK/dV backward for Hopper (sm_90a), written in Gluon (FlashAttention-3 style).

Computes dK (times ``scale``) and dV under the contract of `packattn.ops.varlen.bwd_common_sm90` (module
docstring): one program per (key tile of ``BLOCK_N`` keys, kv head) in head sections, tile-table rows ``[seq,
k_start, m_lo, m_mid_lo, m_mid_hi, m_hi]`` from ``tile_table(seqs, mask, True, BLOCK_N, BLOCK_M)``; the GQA group's
query heads in order and, per head, the query blocks ``m_lo + i * BLOCK_M``; the element mask only outside
the fully visible band; keys no query sees get dK = dV = 0; a tile without steps loads nothing and stores
zeros. This module holds the consumers and the kernel; the decode and the producer are in
`packattn.ops.varlen.bwd_dkdv_sm90_load`.

Partitions (launched with ``num_warps = 4``; ``CONSUMERS = BLOCK_N // 64``, the default partition is consumer
0, a 4-warp worker is consumer 1 when there are two, plus a 1-warp producer)::

    producer (1 warp)                        consumer c (4 warps)
    TMA K, V (BLOCK_N rows) -> kv_bar        keys [64 c, 64 c + 64): own K / V rows, own dK / dV; wait kv_bar
    for it in 0 .. total-1:                  for it in 0 .. total-1: step(it)
      wait empty[it % S] (parity ^ 1)        store dV, dK * scale (staged in its own V / K rows)
      cp.async lse, delta -> stats[it % S]
      cp.async.mbarrier.arrive ready[it % S]
      expect + TMA Q[it], dO[it] -> ready[it % S]

``total = group_size * num_m_blocks``; every partition decodes the same row and walks the steps in the same
order (counters, no divisions), so slot ``it % STAGES`` and parity ``(it // STAGES) & 1`` agree. ``ready[slot]``
(count 1) completes when the TMA bytes have landed and the producer's cp.async are done
(``cp.async.mbarrier.arrive`` adds its own pending arrival); ``empty[slot]`` counts one arrival per consumer.

Step ``it`` of one consumer (enters and leaves with no wgmma in flight)::

    wait   ready[slot]; tail block only: zero the rows past len_q (below)
    issue  S^T = K Q^T, dP^T = V dO^T            (async)
    lse from stats[slot]; wait until 1 pending   (S^T done)
    P^T = exp2(S^T c - lse log2e), masked        (dP^T runs)
    issue  dV += P^T dO                          (async)
    wait   until 1 pending                       (dP^T done; dV runs)
    delta from stats[slot]; dS^T = P^T (dP^T - delta)
    issue  dK += dS^T Q; wait until 0 pending; arrive empty[slot]

dK is finished within the step (carrying dS^T across the back edge costs 16 registers at the peak, over
budget); the consumers are tied only by ``empty`` and the tail rendezvous, so they drift out of phase and one's
wgmma fill the other's elementwise work.

Register budget (d = 128, BLOCK_M = 64, per consumer thread; 240 with two consumers at one CTA per SM, 232
with one consumer at two CTAs per SM): dK + dV 128, S^T and dP^T 32 each, the P^T / dS^T operands 16 each.
It fits only because nothing else per query lives across the loop: lse / delta come from shared memory; the
mask compares the block's query positions, read from a small shared table (``cols``: a ``gl.arange`` would be
hoisted by LLVM and hold 16 registers through the loop), with two per-key bounds computed once
(`bwd_common_sm90._query_range_of_keys`); the epilogue decodes the tile row again (through `_opaque_program_id`,
and with one consumer `_opaque_num_programs`) instead of keeping its scalars.

Tail step (``m_start + BLOCK_M > len_q``, at most one per query head, the same steps in every consumer): with
two consumers, consumer 0 zeroes the slot's Q rows past ``len_q`` and consumer 1 its dO rows
(`bwd_ws_sm90._zero_tails`), then both arrive on ``zero_bar`` (count 2) and wait with parity ``ntail & 1``
(``ntail``: tail steps so far); neither can arrive twice before the other arrived once. With one consumer it
zeroes both, with no rendezvous. lse / delta past ``len_q`` land as 0 (cp.async zero fill): those columns get
finite P^T and zero Q / dO rows, so they add nothing.

``TREE``: the sequence is a packed trie (one sequence of ``total`` rows), key ``s`` visible to the queries
``s <= t < key_end[s]`` (``KeyEnd``: int32 `Tree.row_subtree_end`). Only the per-key bounds change
(`bwd_common_sm90._query_range_of_tree_keys`); tables (`packattn.ops.tree.tables.build_key_tiles`), band, tails and
schedule are the varlen ones.

Shared memory (contract with `packattn.ops.varlen.launch_sm90.dkdv_shared_bytes`): K and V of the tile, the
(Q, dO) ring, lse / delta per slot, the query-position tables, the mbarriers; one consumer at d = 128 with
(64, 64, 2 stages) stays under ~113 KB so that two CTAs share an SM.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from packattn.ops.runtime.gluon_compat import thread_barrier
from packattn.ops.varlen.bwd_common_sm90 import LOG2E, _query_bounds, _store_tile
from packattn.ops.varlen.bwd_dkdv_sm90_load import _dkdv_tile, _dkdv_ws_producer
from packattn.ops.varlen.bwd_ws_sm90 import _tile_barriers, _zero_tails, ws_partitions
from packattn.ops.varlen.common_sm90 import _to_operand, mma_layout
from packattn.ops.varlen.common_sm90_ws import _opaque_num_programs, _opaque_program_id

WG_KEYS = gl.constexpr(64)  # keys per consumer warp group (one wgmma M = 64 per warp group)
# ---------------------------------------------------------------- consumers
@gluon.jit
def _probs_t_ws(s_t, lse_log2, q_lo, q_hi, m_start, m_mid_lo, m_mid_hi, qk_scale_log2, cols, BLOCK_M: gl.constexpr,
                s_layout: gl.constexpr):
    """``P^T = exp2(S^T c - lse log2e)`` with the per-key bounds of `bwd_common_sm90._query_bounds`. ``cols``: shared
    memory holding ``0 .. BLOCK_M-1``; the column positions are loaded from it in masked blocks, because
    LLVM hoists a ``gl.arange`` out of the loop and keeps its 16 values per thread live throughout."""
    p_t = gl.exp2(s_t * qk_scale_log2 - lse_log2[None, :])
    if (m_start < m_mid_lo) | (m_start >= m_mid_hi):
        offs_q = m_start + cols.load(gl.SliceLayout(0, s_layout))
        ok = (offs_q[None, :] >= q_lo[:, None]) & (offs_q[None, :] < q_hi[:, None])
        p_t = gl.where(ok, p_t, 0.0)
    return p_t


@gluon.jit
def _dkdv_ws_step(it, m_start, dk, dv, ntail, k_wg, v_wg, cols, q_bufs, do_bufs, stats, ready, empty, zero_bar,
                  m_mid_lo, m_mid_hi, q_lo, q_hi, len_q, qk_scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  WG: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Step ``it`` (queries ``m_start ...`` of one query head) of one consumer warp group (module
    docstring). Returns ``(dk, dv, ntail)`` with no wgmma in flight (``ntail``: tail steps so far).
    ``CONSUMERS == 1``: the only consumer zeroes both tails, no ``zero_bar`` rendezvous (``ntail``
    unchanged)."""
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    q_buf = q_bufs.index(slot)
    do_buf = do_bufs.index(slot)
    stat = stats.index(slot)
    if m_start + BLOCK_M > len_q:  # rows past the sequence: zeros, not NaN, enter dK / dV
        ntail = _zero_tails(q_buf, q_buf, do_buf, do_buf, m_start, len_q, ntail, zero_bar, BLOCK_M, 0, 0, WG, CONSUMERS)

    s_zero = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, s_layout)
    s_tok = warpgroup_mma(k_wg, q_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v_wg, do_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    lse = stat.slice(0, BLOCK_M).load(gl.SliceLayout(0, s_layout))
    lse_log2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # a row that sees no key: P = 0
    s_t = warpgroup_mma_wait(1, deps=(s_tok, ))
    p_t = _probs_t_ws(s_t, lse_log2, q_lo, q_hi, m_start, m_mid_lo, m_mid_hi, qk_scale_log2, cols, BLOCK_M,
                      s_layout)
    p_op = _to_operand(p_t, k_wg.dtype, o_layout)
    dv_tok = warpgroup_mma(p_op, do_buf, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=(dp_tok, ))
    delta = stat.slice(BLOCK_M, BLOCK_M).load(gl.SliceLayout(0, s_layout))
    ds_t = _to_operand(p_t * (dp_t - delta[None, :]), k_wg.dtype, o_layout)
    dk_tok = warpgroup_mma(ds_t, q_buf, dk, is_async=True)
    dv, dk, p_op, ds_t = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_t))
    mbarrier.arrive(empty.index(slot), count=1)  # this consumer is done with the slot
    return dk, dv, ntail


@gluon.jit
def _fill_cols(cols, BLOCK_M: gl.constexpr):
    """Write ``0 .. BLOCK_M-1`` to this consumer's query-position table (`_probs_t_ws`)."""
    cols.store(gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0])))
    thread_barrier()  # (this warp group's threads) before they read it back in another layout


@gluon.jit
def _consume_tile(step, kv_phase, dk, dv, ntail, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q,
                  len_kv, KeyEnd, qk_scale_log2, window_left, window_right, chunk_size, k_wg, v_wg, cols, q_bufs,
                  do_bufs, stats, kv_bar, ready, empty, zero_bar, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  WG: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, TREE: gl.constexpr,
                  CONSUMERS: gl.constexpr):
    """The ``total > 0`` steps of one work item, ring steps ``step .. step + total - 1``, once the tile's
    K / V have landed (``kv_bar`` phase ``kv_phase``); the query-position table is filled first. Returns ``(dk, dv,
    ntail)`` with no wgmma in flight."""
    offs_k = k_start + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, s_layout))
    q_lo, q_hi = _query_bounds(offs_k, KeyEnd, len_q, len_kv, window_left, window_right, chunk_size, HAS_LEFT,
                               HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
    _fill_cols(cols, BLOCK_M)
    m_end = m_lo + num_m_blocks * BLOCK_M
    m_start = m_lo  # first query of step it (query heads x blocks, as the producer walks them)
    mbarrier.wait(kv_bar, kv_phase)
    for it in range(step, step + total):
        dk, dv, ntail = _dkdv_ws_step(it, m_start, dk, dv, ntail, k_wg, v_wg, cols, q_bufs, do_bufs, stats, ready,
                                      empty, zero_bar, m_mid_lo, m_mid_hi, q_lo, q_hi, len_q, qk_scale_log2, s_layout,
                                      o_layout, WG, BLOCK_M, STAGES, CONSUMERS)
        m_start += BLOCK_M
        if m_start == m_end:
            m_start = m_lo
    return dk, dv, ntail


@gluon.jit
def _store_dkdv(dk, dv, dK, dV, dk_stage, dv_stage, kv_head, first_key, len_kv, row0_kv, stride_dk_row,
                stride_dk_head, stride_dv_row, stride_dv_head, scale, HEAD_DIM: gl.constexpr):
    """Store this consumer's rows ``first_key ...`` (those before ``len_kv``) of dV and ``dK * scale``,
    staged through ``dv_stage`` / ``dk_stage`` (`bwd_common_sm90._store_tile`)."""
    row0_kv64 = row0_kv.to(gl.int64)
    _store_tile(dv, dv_stage, dV + row0_kv64 * stride_dv_row + kv_head.to(gl.int64) * stride_dv_head, first_key,
                len_kv, stride_dv_row, WG_KEYS, HEAD_DIM, 4)
    _store_tile(dk * scale, dk_stage, dK + row0_kv64 * stride_dk_row + kv_head.to(gl.int64) * stride_dk_head,
                first_key, len_kv, stride_dk_row, WG_KEYS, HEAD_DIM, 4)


@gluon.jit
def _dkdv_ws_consumer(dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd, stride_dk_row,
                      stride_dk_head, stride_dv_row, stride_dv_head, num_heads_kv, group_size, heads_per_section,
                      qk_scale_log2, scale, window_left, window_right, chunk_size, k_smem, v_smem, col_smem,
                      q_bufs, do_bufs, stats, kv_bar, ready, empty, zero_bar, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, TREE: gl.constexpr, CONSUMERS: gl.constexpr,
                      WG: gl.constexpr):
    """Consumer warp group ``WG`` (4 warps) of ``CONSUMERS`` (1 or 2): keys ``[64 WG, 64 WG + 64)`` of the
    program's key tile, their dK / dV."""
    KEY0: gl.constexpr = WG * WG_KEYS  # first key of this group in the tile
    s_layout: gl.constexpr = mma_layout(4, BLOCK_M)  # S^T, dP^T: (64 keys, BLOCK_M queries)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)  # dK, dV: (64 keys, HEAD_DIM)
    k_wg = k_smem.slice(KEY0, WG_KEYS, dim=0)
    v_wg = v_smem.slice(KEY0, WG_KEYS, dim=0)
    cols = col_smem.index(WG)
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, gl.program_id(0),
                   gl.num_programs(0), num_heads_kv, group_size, heads_per_section, BLOCK_M)
    dk = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, o_layout)
    dv = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, o_layout)
    if total > 0:
        dk, dv, ntail = _consume_tile(0, 0, dk, dv, m_lo * 0, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks,
                                      total, len_q, len_kv, KeyEnd, qk_scale_log2, window_left, window_right,
                                      chunk_size, k_wg, v_wg, cols, q_bufs, do_bufs, stats, kv_bar, ready, empty,
                                      zero_bar, s_layout, o_layout, WG, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT,
                                      HAS_CHUNK, TOP_LEFT, TREE, CONSUMERS)
    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    if CONSUMERS == 1:  # (at 232 registers the section size, if shared with the first decode, spills)
        nprog = _opaque_num_programs(num_heads_kv)
    else:
        nprog = gl.num_programs(0)
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                   _opaque_program_id(num_heads_kv), nprog, num_heads_kv, group_size, heads_per_section, BLOCK_M)
    first_key = k_start + KEY0
    if seq >= 0:
        # staged through this warp group's own K / V rows (nobody else reads them; its wgmma are done;
        # with total == 0 no TMA was issued into them)
        _store_dkdv(dk, dv, dK, dV, k_wg, v_wg, kv_head, first_key, len_kv, row0_kv, stride_dk_row,
                    stride_dk_head, stride_dv_row, stride_dv_head, scale, HEAD_DIM)


@gluon.jit
def _small_buffers(STAGES: gl.constexpr, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr):
    """``(col_smem, stats, kv_bar, zero_bar, ready, empty)`` of the kernel and of the part kernel
    (`bwd_dkdv_sm90_parts`), the barriers initialised (`bwd_ws_sm90._tile_barriers`)."""
    # per consumer: 0 .. BLOCK_M-1, the query positions of a block (see `_probs_t_ws`)
    col_smem = gl.allocate_shared_memory(gl.int32, [CONSUMERS, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # per ring slot: lse (BLOCK_M floats) then delta (BLOCK_M floats) of the slot's queries
    stats = gl.allocate_shared_memory(gl.float32, [STAGES, 2 * BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    kv_bar, zero_bar, ready, empty = _tile_barriers(STAGES, CONSUMERS)
    return col_smem, stats, kv_bar, zero_bar, ready, empty


@gluon.jit
def _dkdv_ws_buffers(q_desc, k_desc, v_desc, do_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Shared memory of the kernel, barriers initialised: ``(k_smem, v_smem, q_bufs, do_bufs, col_smem, stats,
    kv_bar, zero_bar, ready, empty)`` (module docstring; ``zero_bar`` is ``kv_bar``, unused, with one consumer)."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    col_smem, stats, kv_bar, zero_bar, ready, empty = _small_buffers(STAGES, BLOCK_M, CONSUMERS)
    return k_smem, v_smem, q_bufs, do_bufs, col_smem, stats, kv_bar, zero_bar, ready, empty


_partitions = ws_partitions(_dkdv_ws_consumer, _dkdv_ws_producer)  # consumer 1: keys 64..127


# ---------------------------------------------------------------- kernel
@gluon.jit
def varlen_bwd_dkdv_gluon_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, Lse, Delta, dK, dV, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd,
    stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head, stride_lse_head,
    num_heads_kv, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size, heads_per_section,
    num_work,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, TREE: gl.constexpr = False,
):
    """dK, dV of one (key tile, kv head) per program, grid ``num_work = tiles.shape[0] * num_heads_kv`` (the
    argument itself is unused). Launch with ``num_warps = 4`` and ``maxnreg`` / ``CONSUMER_REGS`` /
    ``PRODUCER_REGS`` from `packattn.ops.runtime.sm90.ws_split`. Descriptors over the ``(rows, heads *
    HEAD_DIM)`` views: ``q_desc`` / ``do_desc`` blocks ``[BLOCK_M, HEAD_DIM]``, ``k_desc`` / ``v_desc`` blocks
    ``[BLOCK_N, HEAD_DIM]``; ``Lse`` / ``Delta`` float32 ``(heads_q, rows)`` with row stride 1. ``TREE``: the
    tree mask, ``KeyEnd`` int32 `Tree.row_subtree_end`; otherwise ``KeyEnd`` is unused (any int32 pointer) and
    the ``HAS_*`` / ``TOP_LEFT`` mask applies."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((BLOCK_N == WG_KEYS) | (BLOCK_N == 2 * WG_KEYS), "one or two consumer warp groups of 64 keys")
    gl.static_assert((BLOCK_M == 32) | (BLOCK_M == 64), "query block: 32 or 64 rows")
    gl.static_assert(STAGES >= 2, "ring of at least two (Q, dO) slots")
    CONSUMERS: gl.constexpr = BLOCK_N // WG_KEYS
    k_smem, v_smem, q_bufs, do_bufs, col_smem, stats, kv_bar, zero_bar, ready, empty = _dkdv_ws_buffers(
        q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS)
    _partitions((dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd, stride_dk_row,
                 stride_dk_head, stride_dv_row, stride_dv_head, num_heads_kv, group_size, heads_per_section,
                 qk_scale_log2, scale, window_left, window_right, chunk_size, k_smem, v_smem, col_smem, q_bufs, do_bufs,
                 stats, kv_bar, ready, empty, zero_bar, HEAD_DIM, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                 TOP_LEFT, TREE, CONSUMERS),
                (q_desc, k_desc, v_desc, do_desc, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q,
                 row_offsets_kv, stride_lse_head, num_heads_kv, group_size, heads_per_section, k_smem, v_smem, q_bufs,
                 do_bufs, stats, kv_bar, ready, empty, HEAD_DIM, BLOCK_M, STAGES),
                CONSUMERS, CONSUMER_REGS, PRODUCER_REGS)
