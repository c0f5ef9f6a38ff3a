"""Warp-specialised dQ of tree attention for Hopper (sm_90a), written in Gluon.

The tree (`packattn.Tree`) is one sequence of ``total`` rows; key ``s`` is visible to the queries
``s <= t < key_end[s]`` (``KeyEnd``: int32 `Tree.row_subtree_end`). Same contract as
`packattn.ops.tree.kernels_triton.tree_dq_kernel` (``dQ = scale * dS K``, ``lse`` float32 natural log, ``delta``
from the preprocess (`packattn.ops.varlen.launch_triton.bwd_delta`), no atomics: deterministic) with the tables of
`packattn.ops.tree.tables.build_query_tiles` built for ``BLOCK_M = 128`` queries and ``BLOCK_N``
keys: ``tiles`` rows ``[q_start, first_interval, num_intervals]``, ``intervals`` rows ``[lo, hi, kind]``
(block-aligned key rows; kind 0 skipped, 1 element mask, 2 every pair visible). One program per
(query tile, query head) in head sections (`packattn.ops.varlen.common_sm90_ws._section_order`); kv head
``head // group_size``.

The partitions, ring, barriers, tail rendezvous and register split are those of
`packattn.ops.varlen.bwd_dq_sm90` (read its module docstring): a 1-warp producer and two
consumer warp groups of 64 queries. The difference is the walk: instead of one key range, the
visible intervals of the tile in order, and in each the key blocks ``lo, lo + BLOCK_N, ... < hi``.
The producer walks them interval by interval; the consumers with the tree forward's cursor
(`packattn.ops.tree.common_sm90._first_block` / `_next_block`: interval index, block start, interval end, kind),
which yields the same blocks in the same order (`build_query_tiles` stores maximal runs: a kind-0
row is always followed by a visible one, every visible row holds at least one block). All three
partitions count the same ring steps ``j`` (all blocks of the tile so far), so slot ``j % STAGES``
and parity ``(j // STAGES) & 1`` agree.

The consumers run the tile's blocks as ONE software pipeline (`_tree_dq_blocks`): each block is a
`packattn.ops.varlen.bwd_dq_sm90._dq_ws_step` with the tree mask in a masked block (kind 1) and the block as
its own unmasked band in a full one (kind 2), and with ``STAGES >= 3`` dS of block ``j`` is carried
into step ``j + 1`` (its ``dQ += dS K`` runs under block ``j + 1``'s S / dP wgmma and softmax) also
when block ``j + 1`` opens the next interval: one exposed dQ product per tile, as in the varlen
kernel, instead of one per interval. The cursor reads interval rows only when a block opens a new
interval (a uniform branch, L1 hits: `_count_blocks` read the same rows before the loop); the
block's kind lives in a register and picks the mask per block. The tail rendezvous is per step as
in varlen (``n + BLOCK_N > total``: at most one block of the tile, the same step in both consumers).

The mask of a masked block needs ``key_end`` of its ``BLOCK_N`` keys. The producer cp.async's them
into a per-slot ring (``key_ends``, ``STAGES x BLOCK_N`` int32, 1 KB at 4 x 64) next to K and V,
tracked by the slot's ``ready`` barrier through ``cp.async.mbarrier.arrive`` (which adds its own
pending arrival, issued before the TMA ``expect``), as `packattn.ops.varlen.bwd_dkdv_sm90` does with lse / delta;
only for masked blocks (kind 1). Chosen over loads by the consumers: the copy is issued one to
``STAGES - 1`` blocks ahead, so its latency is hidden behind the ring like K / V, while a consumer
load would be issued after the block's S wgmma at best and its global latency (a few hundred
cycles on an L2 hit) sits on the consumer's critical path in every masked block; the consumers
keep no 64-bit addresses for it either. Keys past ``total`` land as 0 (cp.async zero fill): no
query sees them. The consumers read the slot in masked blocks only
(`packattn.ops.varlen.bwd_dq_sm90._probs_tree`).

Rows past ``total``: K / V rows of the tail block are zeroed in shared memory (the varlen tail
rendezvous, ``len_kv = total``), query rows past ``total`` get P = 0 (lse ``+inf``) and are not stored.
Every query tile has at least one visible block (a query sees its own key).

Budget (contract with `packattn.ops.tree.launch_sm90.tree_dq_resources`): the varlen two-consumer dQ's
shared memory plus the ``key_end`` ring; at d = 128 with 128 x 64 blocks and 4 stages one CTA per SM, 240
registers per consumer thread, no spills. ``BLOCK_N = 128`` spills at d = 128 and is not in the tables.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from packattn.ops.runtime.gluon_compat import tma_load
from packattn.ops.tree.common_sm90 import _count_blocks, _ends_copy, _first_block, _next_block
from packattn.ops.varlen.bwd_common_sm90 import _lse_log2, _row_vector, _store_tile
# the varlen warp-specialised dQ kernel's step and buffers: the tree dQ is that kernel with the tree's block walk
from packattn.ops.varlen.bwd_dq_sm90 import WG_ROWS, _dq_ws_buffers, _dq_ws_step
from packattn.ops.varlen.common_sm90 import _load_kv_block, mma_layout
from packattn.ops.varlen.common_sm90_ws import _program_id, _section_order

MASKED = gl.constexpr(1)  # interval kinds of `packattn.ops.tree.tables.build_query_tiles` (0: no key visible)
FULL = gl.constexpr(2)


@gluon.jit
def _tree_dq_tile(tiles, num_heads_q, group_size, heads_per_section, OPAQUE_PID: gl.constexpr = False):
    """``(head, kv_head, q_start, first_interval, num_intervals)`` of this program (one program per
    work item, in `packattn.ops.varlen.common_sm90_ws._section_order`); ``OPAQUE_PID``: see
    `packattn.ops.varlen.common_sm90_ws._program_id`."""
    pid = _program_id(num_heads_q, OPAQUE_PID)
    tile, head = _section_order(pid, heads_per_section, gl.num_programs(0) // num_heads_q * heads_per_section)
    q_start = gl.load(tiles + tile * 3)
    first = gl.load(tiles + tile * 3 + 1)
    count = gl.load(tiles + tile * 3 + 2)
    return head, head // group_size, q_start, first, count


@gluon.jit
def _interval(intervals, index):
    """Interval row ``[lo, hi, kind]``."""
    at = intervals + index * 3
    return gl.load(at), gl.load(at + 1), gl.load(at + 2)


# ---------------------------------------------------------------- producer
@gluon.jit
def _tree_dq_producer(q_desc, k_desc, v_desc, do_desc, KeyEnd, tiles, intervals, total, num_heads_q, group_size,
                      heads_per_section, q_smem, do_smem, k_bufs, v_bufs, key_ends, q_bar, ready, empty,
                      HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Load partition (one warp): Q and dO of the tile once (``q_bar``), then every key block of the
    tile's intervals, block ``j`` into ring slot ``j % STAGES`` once both consumers released block
    ``j - STAGES`` there: ``key_end`` of its keys first (masked blocks only, cp.async on ``ready``),
    then K and V (TMA)."""
    head, kv_head, q_start, first, count = _tree_dq_tile(tiles, num_heads_q, group_size, heads_per_section)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma_load(q_desc, [q_start, head * HEAD_DIM], q_bar, q_smem)
    tma_load(do_desc, [q_start, head * HEAD_DIM], q_bar, do_smem)
    j = q_start * 0  # ring steps so far
    for i in range(0, count):
        lo, hi, kind = _interval(intervals, first + i)
        if kind != 0:
            for n_start in range(lo, hi, BLOCK_N):
                slot = j % STAGES
                mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
                if kind == MASKED:
                    _ends_copy(KeyEnd, n_start, total, key_ends.index(slot), BLOCK_N)
                    async_copy.mbarrier_arrive(ready.index(slot))
                # K / V rows n_start ...: `_load_kv_block` loads block j of the range at n_start - j * BLOCK_N
                _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, j, n_start - j * BLOCK_N, 0,
                               kv_head * HEAD_DIM, j + 1, STAGES, BLOCK_N)
                j += 1


# ---------------------------------------------------------------- consumers
@gluon.jit
def _tree_dq_step(j, n, kind, ds_prev, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready, empty, zero_bar,
                  lse_log2, delta, offs_m, total, qk_scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  CARRY_DS: gl.constexpr, WITH_PREV: gl.constexpr):
    """Ring step ``j``: `_dq_ws_step` on the tree block at ``n`` of interval kind ``kind``. Its unmasked
    band is the block itself in a full block (kind 2) and empty in a masked one (kind 1: the tree mask
    from the slot's ``key_end`` copy); rows past ``total`` as the varlen tail (``len_q = len_kv =
    total``). Returns ``(dq, ds, ntail)`` as `_dq_ws_step`."""
    band_lo = gl.where(kind == FULL, n, n + BLOCK_N)  # band [band_lo, n + BLOCK_N)
    return _dq_ws_step(j, n, ds_prev, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready, empty, zero_bar,
                       lse_log2, delta, offs_m, band_lo, n + BLOCK_N, total, total, qk_scale_log2, 0, 0, 0, s_layout,
                       o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, False, False, False, False, True, CARRY_DS, WITH_PREV)


@gluon.jit
def _tree_dq_blocks(intervals, first, last, num_blocks, dq, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready, empty,
                    zero_bar, lse_log2, delta, offs_m, total, qk_scale_log2, s_layout: gl.constexpr,
                    o_layout: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr):
    """The tile's ``num_blocks >= 1`` visible key blocks (interval rows ``[first, last]``) as ring steps
    ``0 .. num_blocks - 1`` of one consumer warp group, one software pipeline across all intervals:
    with ``CARRY_DS`` (``STAGES >= 3``) dS of block ``j`` enters step ``j + 1`` wherever that block
    lies, and only the tile's last dQ product is finished (its slot released) after the loop;
    otherwise every step finishes its own. Returns ``dq``, no wgmma in flight."""
    CARRY_DS: gl.constexpr = STAGES >= 3
    ntail = num_blocks * 0  # tail steps so far (an i32 value: it changes inside a branch)
    index, n, hi, kind = _first_block(intervals, first, last)
    dq, ds, ntail = _tree_dq_step(0, n, kind, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready,
                                  empty, zero_bar, lse_log2, delta, offs_m, total, qk_scale_log2, s_layout, o_layout,
                                  WG, BLOCK_N, HEAD_DIM, STAGES, CARRY_DS, False)
    for j in range(1, num_blocks):
        index, n, hi, kind = _next_block(intervals, index, n, hi, kind, first, last, BLOCK_N)
        dq, ds, ntail = _tree_dq_step(j, n, kind, ds, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready,
                                      empty, zero_bar, lse_log2, delta, offs_m, total, qk_scale_log2, s_layout,
                                      o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, CARRY_DS, True)
    if CARRY_DS:  # the tile's one exposed dQ product
        last_slot = (num_blocks - 1) % STAGES
        dq, ds = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, k_bufs.index(last_slot), dq, is_async=True), ds))
        mbarrier.arrive(empty.index(last_slot), count=1)
    return dq


@gluon.jit
def _tree_dq_consumer(dQ, Lse, Delta, tiles, intervals, total, stride_dq_row, stride_dq_head, stride_lse_head,
                      num_heads_q, group_size, heads_per_section, qk_scale_log2, scale, q_smem, do_smem, k_bufs, v_bufs,
                      key_ends, q_bar, ready, empty, zero_bar, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warp group ``WG`` (4 warps): queries ``[64 WG, 64 WG + 64)`` of the tile, their dQ."""
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)  # S, dP: (64 queries, BLOCK_N keys)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)  # dQ: (64 queries, HEAD_DIM)
    head, kv_head, q_start, first, count = _tree_dq_tile(tiles, num_heads_q, group_size, heads_per_section)
    q_wg = q_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    do_wg = do_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    dq = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
    first_row = q_start + WG * WG_ROWS
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = first_row + gl.arange(0, WG_ROWS, layout=row_layout)
    row0 = q_start * 0  # the tree is one sequence starting at row 0
    lse_log2 = _lse_log2(Lse, head, stride_lse_head, row0, first_row, total, WG_ROWS, row_layout)
    delta = _row_vector(Delta, head, stride_lse_head, row0, first_row, total, WG_ROWS, row_layout, 0.0)
    num_blocks = _count_blocks(intervals, first, count, BLOCK_N)  # as many as the producer loads
    mbarrier.wait(q_bar, 0)
    if num_blocks > 0:  # always (a query sees its own key); an empty tile would store zeros
        dq = _tree_dq_blocks(intervals, first, first + count - 1, num_blocks, dq, q_wg, do_wg, k_bufs, v_bufs,
                             key_ends, ready, empty, zero_bar, lse_log2, delta, offs_m, total, qk_scale_log2,
                             s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES)

    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    head, kv_head, q_start, first, count = _tree_dq_tile(tiles, num_heads_q, group_size, heads_per_section, True)
    # staged through this warp group's own Q rows (nobody else reads them; its wgmma are done)
    _store_tile(dq * scale, q_wg, dQ + head.to(gl.int64) * stride_dq_head, q_start + WG * WG_ROWS, total,
                stride_dq_row, WG_ROWS, HEAD_DIM, 4)


@gluon.jit
def _tree_dq_consumer_worker(dQ, Lse, Delta, tiles, intervals, total, stride_dq_row, stride_dq_head, stride_lse_head,
                             num_heads_q, group_size, heads_per_section, qk_scale_log2, scale, q_smem, do_smem, k_bufs,
                             v_bufs, key_ends, q_bar, ready, empty, zero_bar, HEAD_DIM: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The second consumer warp group (queries 64..127) as a worker partition."""
    _tree_dq_consumer(dQ, Lse, Delta, tiles, intervals, total, stride_dq_row, stride_dq_head, stride_lse_head,
                      num_heads_q, group_size, heads_per_section, qk_scale_log2, scale, q_smem, do_smem, k_bufs, v_bufs,
                      key_ends, q_bar, ready, empty, zero_bar, 1, HEAD_DIM, BLOCK_N, STAGES)


# ---------------------------------------------------------------- kernel
@gluon.jit
def tree_dq_gluon_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, Lse, Delta, dQ, tiles, intervals, KeyEnd,
    stride_dq_row, stride_dq_head, stride_lse_head,
    total, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """dQ of tree attention (module docstring); launch with ``num_warps = 4`` and ``maxnreg`` as
    `packattn.ops.tree.launch_sm90.tree_dq_resources` says. Descriptors over the ``(rows, heads * HEAD_DIM)``
    views: ``q_desc`` / ``do_desc`` blocks ``[BLOCK_M, HEAD_DIM]``, ``k_desc`` / ``v_desc`` blocks
    ``[BLOCK_N, HEAD_DIM]``. ``Lse`` / ``Delta``: float32 ``(heads_q, total)`` with row stride 1."""
    q_smem, do_smem, k_bufs, v_bufs, q_bar, zero_bar, ready, empty = _dq_ws_buffers(
        q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, num_warps)
    # per ring slot: key_end of the slot's keys (masked blocks only)
    key_ends = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))

    gl.warp_specialize([
        (_tree_dq_consumer, (dQ, Lse, Delta, tiles, intervals, total, stride_dq_row, stride_dq_head, stride_lse_head,
                             num_heads_q, group_size, heads_per_section, qk_scale_log2, scale, q_smem, do_smem, k_bufs,
                             v_bufs, key_ends, q_bar, ready, empty, zero_bar, 0, HEAD_DIM, BLOCK_N, STAGES)),
        (_tree_dq_consumer_worker, (dQ, Lse, Delta, tiles, intervals, total, stride_dq_row, stride_dq_head,
                                    stride_lse_head, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
                                    q_smem, do_smem, k_bufs, v_bufs, key_ends, q_bar, ready, empty, zero_bar, HEAD_DIM,
                                    BLOCK_N, STAGES)),
        (_tree_dq_producer, (q_desc, k_desc, v_desc, do_desc, KeyEnd, tiles, intervals, total, num_heads_q, group_size,
                             heads_per_section, q_smem, do_smem, k_bufs, v_bufs, key_ends, q_bar, ready, empty,
                             HEAD_DIM, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
