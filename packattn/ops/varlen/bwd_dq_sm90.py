"""Warp-specialised dQ backward for Hopper (sm_90a), written in Gluon (FlashAttention-3 style).

Computes dQ (times ``scale``) under the contract of `packattn.ops.varlen.bwd_common_sm90` (module docstring): one
program per (query tile of ``BLOCK_M`` queries, query head) in head sections, tile-table rows ``[seq, q_start,
n_lo, n_mid_lo, n_mid_hi, n_hi]`` from ``tile_table(seqs, mask, False, BLOCK_M, BLOCK_N)``, key blocks ``n_lo +
j * BLOCK_N`` in order, kv head ``head // group_size``; queries that see no key get dQ = 0; a tile without key
blocks loads nothing and stores zeros. The partitions and barriers mirror `packattn.ops.varlen.bwd_dkdv_sm90`
with queries and keys swapped; the decode and the producer are in `packattn.ops.varlen.bwd_dq_sm90_load`,
DELTA_FROM_O in `packattn.ops.varlen.bwd_dq_sm90_delta`. `_dq_ws_step` and `_dq_ws_buffers` also serve the tree
dQ (`packattn.ops.tree.dq_sm90`).

Partitions (launched with ``num_warps = 4``; ``CONSUMERS = BLOCK_M // 64``, the default partition is consumer
0, a 4-warp worker is consumer 1 when there are two, plus a 1-warp producer)::

    producer (1 warp)                        consumer c (4 warps)
    TMA Q, dO (BLOCK_M rows) -> q_bar        queries [64 c, 64 c + 64): own Q / dO rows, own dQ, own lse /
    for j in 0 .. num_blocks-1:              delta (loaded once before the loop); wait q_bar
      wait empty[j % S] (parity ^ 1)         for j: step(j); store dQ * scale (staged in its own Q rows)
      expect + TMA K[j], V[j] -> ready[j % S]

Step ``j`` of one consumer with ``CARRY_DS`` (``STAGES >= 3``; dS[j] crosses the back edge as a register A
operand, no wgmma does)::

    wait   ready[j % S]; tail block only: zero the rows past len_kv (below)
    issue  S[j] = Q K[j]^T, dP[j] = dO V[j]^T, dQ += dS[j-1] K[j-1]   (async; three groups in flight)
    wait   until 2 pending                   (S[j] done)
    P[j] = exp2(S c - lse log2e), masked off the band   (dP[j], dQ[j-1] run)
    wait   until 1 pending                   (dP[j] done)
    dS[j] = P (dP - delta) -> A operand      (dQ[j-1] runs)
    wait   until 0 pending; arrive empty[(j-1) % S]   (K[j-1] was last read by dQ[j-1])

after the loop: dQ += dS[last] K[last], wait, arrive ``empty[last % S]``. Slot ``j % S`` is held through step
``j + 1``, so ``STAGES = 4`` keeps two blocks of prefetch. Without ``CARRY_DS`` (``STAGES = 2``): issue S[j],
dP[j]; wait until 1 pending; P[j]; wait until 0; dS[j]; dQ += dS[j] K[j]; wait; arrive ``empty[j % S]``.
The consumers are tied only by ``empty`` and the tail rendezvous (no CTA barrier in the loop).

Tail block (``n_start + BLOCK_N > len_kv``; at most one per tile, the same step in every consumer): with two
consumers, consumer 0 zeroes the slot's K rows past ``len_kv`` and consumer 1 its V rows
(`bwd_ws_sm90._zero_tails`), then both arrive on ``zero_bar`` (count 2) and wait with parity ``ntail & 1``;
with one consumer it zeroes both, with no rendezvous (``zero_bar`` not allocated). Query rows past ``len_q``
only produce dQ rows that are never stored.

Budget (contract with `packattn.ops.varlen.launch_sm90.dq_shared_bytes` / `dq_resources`): two consumers
(128-query tiles) at one CTA per SM, 240 registers per consumer thread (d = 128: dQ 64, S and dP 32 each at
``BLOCK_N = 64``, the P / dS operands 16 each); one consumer (64-query tiles) with <= ~113 KB of shared
memory at two CTAs per SM, 232 registers (the short-batch dQ at d = 128).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from packattn.ops.varlen.bwd_common_sm90 import _lse_log2, _probs, _row_vector, _store_tile
from packattn.ops.varlen.bwd_dq_sm90_delta import _delta_from_o
from packattn.ops.varlen.bwd_dq_sm90_load import _dq_tile, _dq_ws_producer
from packattn.ops.varlen.bwd_ws_sm90 import _tile_barriers, _zero_tails, ws_partitions
from packattn.ops.varlen.common_sm90 import _to_operand, mma_layout

WG_ROWS = gl.constexpr(64)  # queries per consumer warp group (one wgmma M = 64 per warp group)


# ---------------------------------------------------------------- consumers
@gluon.jit
def _probs_tree(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, ends, qk_scale_log2, BLOCK_N: gl.constexpr,
                s_layout: gl.constexpr):
    """`bwd_common_sm90._probs` with the tree mask (`packattn.ops.tree.kernels_triton`): query ``t`` sees key ``s``
    iff ``s <= t < key_end[s]``; ``ends``: shared memory holding ``key_end`` of the block's keys (0 past
    the tree: no query sees them), read only in masked blocks."""
    p = gl.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if (n_start < n_mid_lo) | (n_start >= n_mid_hi):
        keys = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        key_end = ends.load(gl.SliceLayout(0, s_layout))
        ok = (keys[None, :] <= offs_m[:, None]) & (offs_m[:, None] < key_end[None, :])
        p = gl.where(ok, p, 0.0)
    return p


@gluon.jit
def _dq_ws_step(j, n_start, ds_prev, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready, empty, zero_bar,
                lse_log2, delta, offs_m, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left, window_right,
                chunk_size, s_layout: gl.constexpr, o_layout: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, TREE: gl.constexpr, CARRY_DS: gl.constexpr,
                WITH_PREV: gl.constexpr, CONSUMERS: gl.constexpr = 2,
                o_wg=None, delta_ptr=None, delta_rows=None, DELTA_FROM_O: gl.constexpr = False):
    """Ring step ``j``, the key block at ``n_start``, of one consumer warp group (module docstring).
    ``CARRY_DS``: issue the previous block's ``dQ += dS K`` (operand ``ds_prev``, when ``WITH_PREV``)
    under this block's work and return this block's dS as an A operand; otherwise finish this block's
    dQ product here. ``TREE``: the tree mask (`_probs_tree`, ``key_ends``: the ring of the blocks'
    ``key_end``), else the varlen masks (``key_ends`` unused). ``CONSUMERS
    == 1`` (module docstring): the only consumer zeroes both tails (K and V rows), no
    ``zero_bar`` rendezvous (``ntail`` unchanged). Returns ``(dq, ds, ntail)`` with no wgmma in flight.
    ``DELTA_FROM_O`` (the tile's first step; ``delta`` is None): delta = rowsum(dO O) from
    ``do_wg`` / ``o_wg`` while the S and dP wgmma run, stored to ``delta_ptr[i]`` for ``i < delta_rows``
    (`_delta_from_o`); returns ``(dq, ds, ntail, delta)``."""
    gl.static_assert((not DELTA_FROM_O) | ((not WITH_PREV) & (not TREE)), "delta from O: the tile's first step")
    slot = j % STAGES
    mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
    k_buf = k_bufs.index(slot)
    v_buf = v_bufs.index(slot)
    if n_start + BLOCK_N > len_kv:  # keys past the sequence: zeros, not NaN, enter dQ
        ntail = _zero_tails(k_buf, k_buf, v_buf, v_buf, n_start, len_kv, ntail, zero_bar, BLOCK_N, 0, 0, WG, CONSUMERS)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_wg, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_wg, v_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DELTA_FROM_O:  # under the S / dP wgmma (both only read do_wg; nobody writes it or o_wg)
        delta = _delta_from_o(do_wg, o_wg, do_wg, o_wg, delta_ptr, delta_rows, s_layout, 0)
    if CARRY_DS and WITH_PREV:
        prev = (j + STAGES - 1) % STAGES
        dq_tok = warpgroup_mma(ds_prev, k_bufs.index(prev), dq, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    if TREE:
        p = _probs_tree(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, key_ends.index(slot), qk_scale_log2,
                        BLOCK_N, s_layout)
    else:
        p = _probs(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left,
                   window_right, chunk_size, BLOCK_N, s_layout, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
    if CARRY_DS and WITH_PREV:
        dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    else:
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = _to_operand(p * (dp - delta[:, None]), q_wg.dtype, o_layout)
    if CARRY_DS:
        if WITH_PREV:
            dq, ds_prev = warpgroup_mma_wait(0, deps=(dq_tok, ds_prev))
            mbarrier.arrive(empty.index(prev), count=1)  # K[j-1] (dQ[j-1]) and V[j-1] (dP[j-1]) are done
    else:
        dq, ds = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, k_buf, dq, is_async=True), ds))
        mbarrier.arrive(empty.index(slot), count=1)  # this consumer is done with the slot
    if DELTA_FROM_O:
        return dq, ds, ntail, delta
    else:
        return dq, ds, ntail


@gluon.jit
def _dq_ws_blocks(step, num_blocks, n_lo, n_mid_lo, n_mid_hi, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, ready, empty,
                  zero_bar, lse_log2, delta, offs_m, len_q, len_kv, qk_scale_log2, window_left, window_right,
                  chunk_size, s_layout: gl.constexpr, o_layout: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                  HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, CONSUMERS: gl.constexpr = 2, o_wg=None,
                  delta_ptr=None, delta_rows=None,
                  DELTA_FROM_O: gl.constexpr = False):
    """The tile's ``num_blocks >= 1`` key blocks ``n_lo + b * BLOCK_N`` (fully visible band ``[n_mid_lo,
    n_mid_hi)``) as ring steps ``step + b`` of one consumer warp group: with
    ``CARRY_DS`` (``STAGES >= 3``) dS crosses from block to block and the last dQ product is finished
    (and its slot released) here. Returns ``(dq, ntail)``, no wgmma in flight. (The tree kernel,
    `packattn.ops.tree.dq_sm90`, walks its intervals with its own loop around `_dq_ws_step`.) ``DELTA_FROM_O``
    (``delta`` None): the first step computes delta from ``do_wg`` / ``o_wg`` and stores it
    (`_dq_ws_step`), the other steps use it; without ``CARRY_DS`` that first step is peeled off the loop."""
    CARRY_DS: gl.constexpr = STAGES >= 3
    first_b = 0
    if DELTA_FROM_O:  # the first step peeled: it computes delta (and with CARRY_DS hands its dS on)
        dq, ds, ntail, delta = _dq_ws_step(step, n_lo, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, None, ready,
                                           empty, zero_bar, lse_log2, None, offs_m, n_mid_lo, n_mid_hi, len_q,
                                           len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                                           o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                           TOP_LEFT, False, CARRY_DS, False, CONSUMERS, o_wg, delta_ptr,
                                           delta_rows, True)
        first_b = 1
    if CARRY_DS:
        if not DELTA_FROM_O:
            dq, ds, ntail = _dq_ws_step(step, n_lo, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, None, ready, empty,
                                        zero_bar, lse_log2, delta, offs_m, n_mid_lo, n_mid_hi, len_q, len_kv,
                                        qk_scale_log2, window_left, window_right, chunk_size, s_layout, o_layout, WG,
                                        BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, False,
                                        True, False, CONSUMERS)
        for b in range(1, num_blocks):
            dq, ds, ntail = _dq_ws_step(step + b, n_lo + b * BLOCK_N, ds, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                                        None, ready, empty, zero_bar, lse_log2, delta, offs_m, n_mid_lo, n_mid_hi,
                                        len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                                        o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                        TOP_LEFT, False, True, True, CONSUMERS)
        last = (step + num_blocks - 1) % STAGES
        dq, ds = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, k_bufs.index(last), dq, is_async=True), ds))
        mbarrier.arrive(empty.index(last), count=1)
    else:
        for b in range(first_b, num_blocks):
            dq, ds, ntail = _dq_ws_step(step + b, n_lo + b * BLOCK_N, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                                        None, ready, empty, zero_bar, lse_log2, delta, offs_m, n_mid_lo, n_mid_hi,
                                        len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                                        o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                        TOP_LEFT, False, False, False, CONSUMERS)
    return dq, ntail


@gluon.jit
def _consume_item(step, q_phase, dq, ntail, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q,
                  Lse, Delta, stride_lse_head, qk_scale_log2, window_left, window_right, chunk_size, q_wg, do_wg,
                  k_bufs, v_bufs, q_bar, ready, empty, zero_bar, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                  CONSUMERS: gl.constexpr, o_wg=None, DELTA_FROM_O: gl.constexpr = False):
    """One tile with ``num_blocks >= 1`` key blocks, ring steps ``step ...``: this warp group's lse / delta
    / query positions, wait for Q / dO (``q_bar`` phase ``q_phase``), the blocks (`_dq_ws_blocks`).
    ``DELTA_FROM_O``: delta is not loaded; the first step computes it from dO / O (``o_wg``, loaded on
    ``q_bar`` too) and stores it to ``Delta`` at the addresses the load would read (`_row_vector`).
    Returns ``(dq, ntail)``, no wgmma in flight."""
    first = q_start + WG * WG_ROWS
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = first + gl.arange(0, WG_ROWS, layout=row_layout)
    lse_log2 = _lse_log2(Lse, head, stride_lse_head, row0_q, first, len_q, WG_ROWS, row_layout)
    if DELTA_FROM_O:
        delta_ptr = Delta + (head.to(gl.int64) * stride_lse_head + row0_q.to(gl.int64) + first)
        mbarrier.wait(q_bar, q_phase)
        return _dq_ws_blocks(step, num_blocks, n_lo, n_mid_lo, n_mid_hi, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                             ready, empty, zero_bar, lse_log2, None, offs_m, len_q, len_kv, qk_scale_log2,
                             window_left, window_right, chunk_size, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, o_wg, delta_ptr,
                             len_q - first, True)
    else:
        delta = _row_vector(Delta, head, stride_lse_head, row0_q, first, len_q, WG_ROWS, row_layout, 0.0)
        mbarrier.wait(q_bar, q_phase)
        return _dq_ws_blocks(step, num_blocks, n_lo, n_mid_lo, n_mid_hi, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                             ready, empty, zero_bar, lse_log2, delta, offs_m, len_q, len_kv, qk_scale_log2,
                             window_left, window_right, chunk_size, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS)


@gluon.jit
def _dq_ws_consumer(dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_dq_row,
                    stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
                    window_left, window_right, chunk_size, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty,
                    zero_bar, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                    CONSUMERS: gl.constexpr, o_smem, DELTA_FROM_O: gl.constexpr, WG: gl.constexpr):
    """Consumer warp group ``WG`` (4 warps) of ``CONSUMERS`` (1 or 2): queries ``[64 WG, 64 WG + 64)`` of
    the program's tile, their dQ. ``DELTA_FROM_O``: delta of its rows from dO and O (its rows of ``o_smem``)
    instead of loaded (`_consume_item`)."""
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)  # S, dP: (64 queries, BLOCK_N keys)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)  # dQ: (64 queries, HEAD_DIM)
    q_wg = q_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    do_wg = do_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N)
    dq = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
    if num_blocks > 0:
        ntail = n_lo * 0  # tail steps so far (an i32 value: it changes inside a branch)
        if DELTA_FROM_O:  # this warp group's rows of O
            dq, ntail = _consume_item(0, 0, dq, ntail, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q,
                                      len_kv, row0_q, Lse, Delta, stride_lse_head, qk_scale_log2, window_left,
                                      window_right, chunk_size, q_wg, do_wg, k_bufs, v_bufs, q_bar, ready, empty,
                                      zero_bar, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT,
                                      HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS,
                                      o_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0), True)
        else:
            dq, ntail = _consume_item(0, 0, dq, ntail, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q,
                                      len_kv, row0_q, Lse, Delta, stride_lse_head, qk_scale_log2, window_left,
                                      window_right, chunk_size, q_wg, do_wg, k_bufs, v_bufs, q_bar, ready, empty,
                                      zero_bar, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT,
                                      HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS)

    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N, True)
    if seq >= 0:
        # staged through this warp group's own Q rows (nobody else reads them; its wgmma are done;
        # with num_blocks == 0 no TMA was issued into them)
        base = dQ + row0_q.to(gl.int64) * stride_dq_row + head.to(gl.int64) * stride_dq_head
        _store_tile(dq * scale, q_wg, base, q_start + WG * WG_ROWS, len_q, stride_dq_row, WG_ROWS, HEAD_DIM, 4)


# consumer 1: queries 64..127; with DELTA_FROM_O the producer loads O too (a third TMA on q_bar), the consumers read it
_partitions = ws_partitions(_dq_ws_consumer, _dq_ws_producer)


# ---------------------------------------------------------------- kernel
@gluon.jit
def _dq_ws_buffers(q_desc, k_desc, v_desc, do_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                   CONSUMERS: gl.constexpr = 2):
    """Shared memory and barriers of a warp-specialised dQ kernel (this module's and the tree's,
    `packattn.ops.tree.dq_sm90`, which always has two consumers), initialised: ``(q_smem, do_smem, k_bufs,
    v_bufs, q_bar, zero_bar, ready, empty)``; ``empty`` counts the ``CONSUMERS`` consumer warp groups,
    ``zero_bar`` is the two consumers' tail rendezvous (with one consumer not allocated: ``q_bar`` is
    returned in its place, unused)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((CONSUMERS == 1) | (CONSUMERS == 2), "one or two consumer warp groups")
    gl.static_assert(BLOCK_M == CONSUMERS * WG_ROWS, "consumer warp groups of 64 queries each")
    gl.static_assert((BLOCK_N == 64) | (BLOCK_N == 128), "key block: 64 or 128 rows")
    gl.static_assert(STAGES >= 2, "ring of at least two (K, V) slots")

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar, zero_bar, ready, empty = _tile_barriers(STAGES, CONSUMERS)
    return q_smem, do_smem, k_bufs, v_bufs, q_bar, zero_bar, ready, empty


@gluon.jit
def varlen_bwd_dq_gluon_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, o_desc, Lse, Delta, dQ, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_dq_row, stride_dq_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size, heads_per_section,
    num_work,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    DELTA_FROM_O: gl.constexpr = False,
):
    """dQ of one (query tile, query head) per program, grid ``num_work = tiles.shape[0] * num_heads_q`` (the
    argument itself is unused). Launch with ``num_warps = 4`` and ``maxnreg`` / ``CONSUMER_REGS`` /
    ``PRODUCER_REGS`` from `packattn.ops.runtime.sm90.ws_split`. Descriptors: ``q_desc`` / ``do_desc`` blocks
    ``[BLOCK_M, HEAD_DIM]``, ``k_desc`` / ``v_desc`` blocks ``[BLOCK_N, HEAD_DIM]``. ``BLOCK_M`` 128: two consumer
    warp groups; 64: one. ``DELTA_FROM_O`` (`packattn.ops.varlen.bwd_dq_sm90_delta`): ``o_desc`` (O, blocks as
    ``do_desc``) is loaded with Q / dO and ``Delta`` is written (rowsum(dO O) of the tile's rows) instead of
    read; without it ``o_desc`` is unused (the launcher passes None: no kernel parameter)."""
    CONSUMERS: gl.constexpr = BLOCK_M // WG_ROWS
    gl.static_assert((BLOCK_M == WG_ROWS) | (BLOCK_M == 2 * WG_ROWS), "one or two consumer warp groups of 64 queries")
    q_smem, do_smem, k_bufs, v_bufs, q_bar, zero_bar, ready, empty = _dq_ws_buffers(
        q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, num_warps, CONSUMERS)
    if DELTA_FROM_O:  # O of the tile (loaded on q_bar with Q / dO), read by the consumer's row sums only
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [BLOCK_M, HEAD_DIM], o_desc.layout)
    else:
        o_smem = do_smem  # (unused)
    _partitions((dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_dq_row,
                 stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
                 window_left, window_right, chunk_size, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, zero_bar,
                 HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, o_smem, DELTA_FROM_O),
                (q_desc, k_desc, v_desc, do_desc, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                 num_heads_q, group_size, heads_per_section, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty,
                 HEAD_DIM, BLOCK_N, STAGES, o_desc, o_smem, DELTA_FROM_O),
                CONSUMERS, CONSUMER_REGS, PRODUCER_REGS)
