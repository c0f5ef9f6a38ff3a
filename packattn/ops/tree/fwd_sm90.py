"""Warp-specialised Gluon tree forward for Hopper (sm_90a): `tree_fwd_gluon_kernel`.

Same contract as `packattn.ops.tree.kernels_triton.tree_fwd_kernel` (the Triton tree forward): the tree is
one sequence of ``total`` rows, key ``s`` is visible to queries ``s <= t < key_end[s]``; tables of
`packattn.ops.tree.tables.build_query_tiles` built with this kernel's ``BLOCK_M`` /
``BLOCK_N`` (`packattn.ops.tree.configs.fwd_blocks`): ``tiles`` rows ``[q_start,
first_interval, num_intervals]`` (longest first), ``intervals`` rows ``[lo, hi, kind]`` (kind 0: no
key visible, skipped; 1: element mask; 2: every pair visible); ``out`` in the input dtype, ``lse``
float32 natural log ``(heads_q, total)``; GQA by ``head // group_size``.

Partitions, barriers, persistent grid and direct store are those of
`packattn.ops.varlen.fwd_sm90` (read its docstring): a 1-warp TMA producer, one consumer
partition per 64 query rows (``BLOCK_M // 64``), K/V ring slots handed over by ``ready`` /
``empty`` mbarriers, Q by ``q_bar`` / ``q_empty``; work items ``(tile, head)`` with heads varying
fastest, ``pid, pid + nprog, ...``. What differs is the walk over key blocks:

* **Block walk.** A work item's key blocks are the ``BLOCK_N``-key blocks of its visible intervals
  in order (kind 0 skipped). Every partition walks them with the same cursor (`_first_block`,
  `_next_block`: interval index, block start, interval end, kind) in the same order, so ring slot
  ``g % STAGES`` and parity ``(g // STAGES) & 1`` of global block ``g`` agree. ``build_query_tiles``
  stores maximal runs, so two consecutive intervals differ in kind and a skipped kind-0 interval
  is always followed by a visible one: advancing reads at most two interval rows, and only when
  the current interval is exhausted (a uniform branch with L1-resident scalar loads, issued
  while the consumer's PV / S wgmma run). `_count_blocks` sums the blocks first: the consumer
  pipeline peels the first and the last block, the producer loads Q after the first block.
  The consumer's loop is `packattn.ops.varlen.fwd_sm90._ws_attend`'s (S[j+1] and PV[j] in flight during the
  softmax of S[j+1], no wgmma across the back edge) and does not drain between intervals.

* **key_end reaches the consumers through the ring.** For a kind-1 block the producer cp.asyncs
  ``key_end[n : n + BLOCK_N]`` into ``ends[slot]`` (int32, next to the slot's K / V), then
  ``cp.async.mbarrier.arrive`` on ``ready[slot]`` (it adds its own pending arrival, so ``ready``
  keeps count 1) before the ``expect`` + TMA of K / V: the consumer's one wait on ``ready`` covers
  all three, as `packattn.ops.varlen.bwd_dkdv_sm90` does with lse / delta. Keys past ``total`` are not read and
  land as 0 (cp.async zero fill): ``t < 0`` is false, so they are invisible. Kind-2 blocks copy
  nothing. The consumer reads ``ends[slot]`` from shared memory only inside a kind-1 block's
  softmax (a broadcast ``ld.shared``: the four threads of a quad read distinct 8-byte pairs, the
  other lanes the same words) and masks ``n + c <= t < ends[c]``.

  Register budget: a consumer thread (d = 128, BLOCK_N = 128) has 240 registers; at the softmax of S[j+1]
  it holds O (64, pinned by the in-flight PV[j]), P[j] as the A operand (32), S[j+1] (64), the row state and
  the cursor. The tree mask adds the 32 ``key_end`` values of the thread's columns (16 ``ld.shared.v2``),
  live only while S is masked; the key side of ``n + c <= t`` is compared as ``c <= t - n`` (the column
  offsets stay constants). The producer warp does the global traffic, so the consumers hold no 64-bit
  addresses and no global latency sits between S[j+1] and P[j+1].

* **Rows past ``total``.** The TMA descriptors cover exactly ``total`` rows, so Q / K / V rows past
  it read as zeros (no V-tail zeroing as in varlen, where those rows belong to the next sequence).
  Only kind-1 blocks can reach past ``total`` (kind 2 needs a complete block); their keys there
  have ``key_end = 0``. Query rows past ``total`` are never stored. Every query row sees at least
  its own key; a row that saw none would get ``out = 0``, ``lse = -inf`` (`_ws_epilogue`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from packattn.ops.tree.common_sm90 import _count_blocks, _ends_copy, _first_block, _next_block
from packattn.ops.varlen.common_sm90 import (_issue_qk, _load_kv_block, _softmax_full, _softmax_masked, _to_operand,
                                               mma_layout)
from packattn.ops.varlen.common_sm90_ws import _section_order, _ws_buffers, _ws_epilogue, _ws_load_q, _ws_tile_start


# ---------------------------------------------------------------- work item (every partition)
@gluon.jit
def _tree_item(tiles, intervals, w, num_heads_q, group_size, num_work, heads_per_section, HEAD_DIM: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """Decode work item ``w`` (`packattn.ops.varlen.common_sm90_ws._section_order`): ``(head, col_kv, q_start, first,
    last, num_blocks)`` with ``[first, last]`` the tile's interval rows."""
    tile, head = _section_order(w, heads_per_section, num_work // num_heads_q * heads_per_section)
    q_start = gl.load(tiles + tile * 3)
    first = gl.load(tiles + tile * 3 + 1)
    count = gl.load(tiles + tile * 3 + 2)
    num_blocks = _count_blocks(intervals, first, count, BLOCK_N)
    return head, (head // group_size) * HEAD_DIM, q_start, first, first + count - 1, num_blocks


# ---------------------------------------------------------------- producer
@gluon.jit
def _load_tree_block(k_desc, v_desc, key_end, k_bufs, v_bufs, ends_bufs, ready, empty, g, n, kind, col_kv, total,
                     STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """Global block ``g`` (keys ``n ...``) into ring slot ``g % STAGES`` once both consumers released
    it: key_end first for a kind-1 block (cp.async, tracked by ``ready``), then K and V (TMA)."""
    slot = g % STAGES
    mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
    if kind == 1:
        _ends_copy(key_end, n, total, ends_bufs.index(slot), BLOCK_N)
        async_copy.mbarrier_arrive(ready.index(slot))
    # rows n ... into slot g % STAGES (`_load_kv_block` counts rows from row0 + n_lo + g * BLOCK_N)
    _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, g, n - g * BLOCK_N, 0, col_kv, g + 1, STAGES, BLOCK_N)


@gluon.jit
def _tree_producer(q_desc, k_desc, v_desc, key_end, tiles, intervals, total, num_heads_q, group_size, num_work,
                   heads_per_section, q_smem, k_bufs, v_bufs, ends_bufs, q_bar, q_empty, ready, empty,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA partition (one warp): per work item the first block (if any), then Q
    (once the consumers released the previous one), then the remaining blocks."""
    block = 0  # ring blocks issued so far (all work items of this program)
    loads_q = 0
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        head, col_kv, q_start, first, last, num_blocks = _tree_item(tiles, intervals, w, num_heads_q, group_size,
                                                                    num_work, heads_per_section, HEAD_DIM, BLOCK_N)
        index, n, hi, kind = _first_block(intervals, first, last)
        before_q = gl.minimum(num_blocks, 1)
        for b in range(0, before_q):
            _load_tree_block(k_desc, v_desc, key_end, k_bufs, v_bufs, ends_bufs, ready, empty, block + b, n, kind,
                             col_kv, total, STAGES, BLOCK_N)
            index, n, hi, kind = _next_block(intervals, index, n, hi, kind, first, last, BLOCK_N)
        _ws_load_q(q_desc, q_smem, q_bar, q_empty, loads_q, q_start, head * HEAD_DIM)
        for b in range(before_q, num_blocks):
            _load_tree_block(k_desc, v_desc, key_end, k_bufs, v_bufs, ends_bufs, ready, empty, block + b, n, kind,
                             col_kv, total, STAGES, BLOCK_N)
            index, n, hi, kind = _next_block(intervals, index, n, hi, kind, first, last, BLOCK_N)
        block += num_blocks
        loads_q += 1


# ---------------------------------------------------------------- consumers
@gluon.jit
def _tree_softmax(s, m_i, l_i, offs_m, offs_n, n, kind, ends, qk_scale_log2, s_layout: gl.constexpr):
    """Fold block ``n ...`` (raw scores ``s``) into the running softmax: the tree mask
    ``n + c <= t < ends[c]`` in a kind-1 block (``ends``: the slot's key_end copy), none in kind 2."""
    if kind == 1:
        key_end = ends.load(gl.SliceLayout(0, s_layout))
        # n + c <= t as c <= t - n: one subtraction per row instead of one addition per column
        ok = (offs_n[None, :] <= (offs_m - n)[:, None]) & (offs_m[:, None] < key_end[None, :])
        p, alpha, m_new, l_new = _softmax_masked(s, ok, m_i, l_i, qk_scale_log2)
    else:
        p, alpha, m_new, l_new = _softmax_full(s, m_i, l_i, qk_scale_log2)
    return p, alpha, m_new, l_new


@gluon.jit
def _tree_attend(q_wg, k_bufs, v_bufs, ends_bufs, ready, empty, q_empty, intervals, base, first, last, num_blocks,
                 m_i, l_i, acc, offs_m, offs_n, qk_scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """`packattn.ops.varlen.fwd_sm90._ws_attend` over the work item's ``num_blocks >= 1`` visible blocks (ring
    blocks ``base ...``), the cursor giving each block's start and kind; slot ``j`` goes back to
    the producer on ``empty`` once PV[j] is done, Q on ``q_empty`` after the last S. Returns ``(acc, m, l)`` with no wgmma in flight."""
    dtype: gl.constexpr = q_wg.dtype
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    index, n, hi, kind = _first_block(intervals, first, last)
    s = warpgroup_mma_wait(0, deps=(_issue_qk(q_wg, k_bufs, ready, base, s_zero, STAGES), ))
    p, alpha, m_i, l_i = _tree_softmax(s, m_i, l_i, offs_m, offs_n, n, kind, ends_bufs.index(base % STAGES),
                                       qk_scale_log2, s_layout)
    p_op = _to_operand(p, dtype, o_layout)
    for j in range(0, num_blocks - 1):
        s_tok = _issue_qk(q_wg, k_bufs, ready, base + j + 1, s_zero, STAGES)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc_tok = warpgroup_mma(p_op, v_bufs.index((base + j) % STAGES), acc, is_async=True)
        index, n, hi, kind = _next_block(intervals, index, n, hi, kind, first, last, BLOCK_N)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S[j+1] done; PV[j] keeps the tensor cores busy
        p, alpha, m_i, l_i = _tree_softmax(s, m_i, l_i, offs_m, offs_n, n, kind,
                                           ends_bufs.index((base + j + 1) % STAGES), qk_scale_log2, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        mbarrier.arrive(empty.index((base + j) % STAGES), count=1)  # this warp group is done with block j
        p_op = _to_operand(p, dtype, o_layout)
    mbarrier.arrive(q_empty, count=1)  # every S of the work item is done: Q may be reloaded
    last_slot = (base + num_blocks - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_op, v_bufs.index(last_slot), acc, is_async=True), ))
    mbarrier.arrive(empty.index(last_slot), count=1)
    return acc, m_i, l_i


@gluon.jit
def _tree_consumer(Out, Lse, tiles, intervals, stride_o_row, stride_o_head, stride_lse_head, total, num_heads_q,
                   group_size, qk_scale_log2, num_work, heads_per_section, q_smem, k_bufs, v_bufs, ends_bufs, q_bar,
                   q_empty, ready, empty, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr):
    """Consumer warp group ``WG`` (4 warps): query rows ``[64 WG, 64 WG + 64)`` of every work item of
    this program."""
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
    q_wg = q_smem.slice(WG * 64, 64, dim=0)
    block = 0
    loads_q = 0
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        head, col_kv, q_start, first, last, num_blocks = _tree_item(tiles, intervals, w, num_heads_q, group_size,
                                                                    num_work, heads_per_section, HEAD_DIM, BLOCK_N)
        q_wg_start = q_start + WG * 64
        offs_m, offs_n, m_i, l_i, acc = _ws_tile_start(q_wg_start, s_layout, o_layout, BLOCK_N, HEAD_DIM)
        mbarrier.wait(q_bar, loads_q & 1)
        if num_blocks > 0:
            acc, m_i, l_i = _tree_attend(q_wg, k_bufs, v_bufs, ends_bufs, ready, empty, q_empty, intervals, block,
                                         first, last, num_blocks, m_i, l_i, acc, offs_m, offs_n, qk_scale_log2,
                                         s_layout, o_layout, BLOCK_N, STAGES)
        else:
            mbarrier.arrive(q_empty, count=1)
        # the warp group's first row as the 64-bit row offset (total * heads * d may pass 2**31), rows 0..63
        _ws_epilogue(acc, m_i, l_i, Out, Lse, q_wg_start.to(gl.int64), 0, total - q_wg_start, head,
                     stride_o_row, stride_o_head, stride_lse_head, o_layout, HEAD_DIM)
        block += num_blocks
        loads_q += 1


@gluon.jit
def _tree_consumer_worker(Out, Lse, tiles, intervals, stride_o_row, stride_o_head, stride_lse_head, total, num_heads_q,
                          group_size, qk_scale_log2, num_work, heads_per_section, q_smem, k_bufs, v_bufs, ends_bufs,
                          q_bar, q_empty, ready, empty, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr):
    """The second consumer warp group (rows 64..127) as a worker partition."""
    _tree_consumer(Out, Lse, tiles, intervals, stride_o_row, stride_o_head, stride_lse_head, total, num_heads_q,
                   group_size, qk_scale_log2, num_work, heads_per_section, q_smem, k_bufs, v_bufs, ends_bufs, q_bar,
                   q_empty, ready, empty, 1, HEAD_DIM, BLOCK_N, STAGES)


# ---------------------------------------------------------------- kernel
@gluon.jit
def tree_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, Out, Lse, key_end, tiles, intervals,
    stride_o_row, stride_o_head, stride_lse_head,
    total, num_heads_q, group_size, qk_scale_log2, num_work, heads_per_section,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Warp-specialised tree forward (module docstring). Descriptors over the ``(total, heads *
    HEAD_DIM)`` views of q / k / v, blocks ``[BLOCK_M, HEAD_DIM]`` (q) and ``[BLOCK_N, HEAD_DIM]`` (k,
    v); ``key_end`` int32 ``(total,)``; ``num_work = tiles.shape[0] * num_heads_q``. Launch with
    ``num_warps = 4`` and ``maxnreg`` / register split of `packattn.ops.tree.launch_sm90.tree_fwd_resources`."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((BLOCK_M == 64) | (BLOCK_M == 128), "one consumer warp group per 64 query rows")
    gl.static_assert(BLOCK_N % 32 == 0, "the producer warp copies key_end in BLOCK_N // 32 values per thread")
    gl.static_assert(STAGES >= 2, "ring of at least two K/V slots")

    q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty = _ws_buffers(q_desc, k_desc, v_desc, BLOCK_M, BLOCK_N,
                                                                       STAGES, HEAD_DIM)
    # per ring slot: key_end of the slot's keys (kind-1 blocks only)
    ends_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))

    if BLOCK_M == 128:
        gl.warp_specialize([
            (_tree_consumer, (Out, Lse, tiles, intervals, stride_o_row, stride_o_head, stride_lse_head, total,
                              num_heads_q, group_size, qk_scale_log2, num_work, heads_per_section, q_smem, k_bufs,
                              v_bufs, ends_bufs, q_bar, q_empty, ready, empty, 0, HEAD_DIM, BLOCK_N, STAGES)),
            (_tree_consumer_worker, (Out, Lse, tiles, intervals, stride_o_row, stride_o_head, stride_lse_head, total,
                                     num_heads_q, group_size, qk_scale_log2, num_work, heads_per_section, q_smem,
                                     k_bufs, v_bufs, ends_bufs, q_bar, q_empty, ready, empty, HEAD_DIM, BLOCK_N, STAGES)),
            (_tree_producer, (q_desc, k_desc, v_desc, key_end, tiles, intervals, total, num_heads_q, group_size,
                              num_work, heads_per_section, q_smem, k_bufs, v_bufs, ends_bufs, q_bar, q_empty, ready,
                              empty, HEAD_DIM, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_tree_consumer, (Out, Lse, tiles, intervals, stride_o_row, stride_o_head, stride_lse_head, total,
                              num_heads_q, group_size, qk_scale_log2, num_work, heads_per_section, q_smem, k_bufs,
                              v_bufs, ends_bufs, q_bar, q_empty, ready, empty, 0, HEAD_DIM, BLOCK_N, STAGES)),
            (_tree_producer, (q_desc, k_desc, v_desc, key_end, tiles, intervals, total, num_heads_q, group_size,
                              num_work, heads_per_section, q_smem, k_bufs, v_bufs, ends_bufs, q_bar, q_empty, ready,
                              empty, HEAD_DIM, BLOCK_N, STAGES)),
        ], [1], [PRODUCER_REGS])
