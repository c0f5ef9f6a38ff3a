"""Gluon helpers shared by the Hopper (sm_90a) kernels of the varlen and tree families.

* Layouts: `mma_layout` (wgmma accumulator, ``NVMMADistributedLayout`` v3, warps split the rows, a warp group
  per 64 rows, so row max / row sum reduce inside a quad: no shared memory), `row_store_layout` (16-byte
  vector stores of whole rows), `quad_vec_layout` (the accumulator's rows with 16 bytes a thread).
* Tile table and masks: `_tile_row` (a row ``[seq, start, lo, mid_lo, mid_hi, hi]`` and its sequence's lengths
  and first rows), `_aligned_shift`, `_key_range`, `_visible`: the Gluon twins of
  `packattn.ops.varlen.common_triton` (same formulas, see `packattn.mask`).
* Base-2 online softmax of one key block (`_softmax_any`: element mask only outside the fully visible band
  ``[mid_lo, mid_hi)``, a uniform branch; unmasked blocks ``m = max(m, rowmax(S) c)``, ``p = exp2(S c - m)``;
  masked blocks scale, mask to -inf, then max; a row that has seen no key keeps ``m = -inf`` and ``p = 0``).
  The forward's lazy rescaling (None: off, the code then as without it): `_new_max`, `_alpha`, `_rows_any`,
  `_scale_acc`.
* Pipeline pieces: `_load_kv_block` (K and V of a block by TMA onto the slot's one mbarrier), `_issue_qk`
  (wait for the slot, start ``S = Q K^T`` asynchronously), `_zero_v_tail` (zero the rows of a ring slot past
  the sequence end, fence, barrier over the calling warp group: rows TMA read from the next sequence or from
  padding may hold NaN, and ``0 * NaN`` inside a product would poison valid rows), `_to_operand` (float32
  accumulator -> wgmma A operand in registers).

Rule every kernel follows: no wgmma is in flight across a loop's back edge (ptxas serialises every wgmma of
the kernel otherwise, warning C7514).

Warp-specialisation plumbing (work split, ring barriers, the ws forward's pieces) is in
`packattn.ops.varlen.common_sm90_ws`, the backward's helpers in `packattn.ops.varlen.bwd_common_sm90`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from packattn.ops.runtime.gluon_compat import thread_barrier, tma_load


# ---------------------------------------------------------------- layouts (compile-time helpers)
@gluon.constexpr_function
def mma_layout(num_warps, n):
    """wgmma accumulator layout of a ``(BLOCK_M, n)`` tile: the warps split the rows (a warp group
    per 64 rows), the instruction covers ``n`` columns and ``k = 16`` (16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def row_store_layout(num_warps, head_dim):
    """Blocked layout for the output store: 8 contiguous 16-bit elements (16 B) per thread, a
    warp covering whole rows, so every row segment is written by one vectorised store."""
    cols = head_dim // 8
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def quad_vec_layout(head_dim):
    """A consumer's 64 x ``head_dim`` output as the wgmma accumulator holds it (warp w: rows ``16 w ...``; lanes
    ``4 i ...``: rows ``i`` and ``i + 8``), but each thread with 8 contiguous 16-bit columns (16 bytes) instead of
    column pairs: the conversion stays inside each warp (Triton 3.6 goes through a 512-byte scratch a warp, with warp
    syncs only), and each store instruction writes 64 contiguous bytes of 8 rows. ``head_dim``: a power of 2 >= 32
    (ValueError otherwise)."""
    head_dim = int(head_dim)
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"quad_vec_layout: head_dim {head_dim} is not a power of 2 >= 32")
    regs = [[0, 1], [0, 2], [0, 4], [8, 0]]
    col = 32
    while col < head_dim:  # the columns past the first 32 in registers
        regs.append([0, col])
        col *= 2
    return gl.DistributedLinearLayout(regs, [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                      [64, head_dim])


# ---------------------------------------------------------------- mask (twin of common_triton)
@gluon.jit
def _tile_row(tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv):
    """Tile-table row ``tile`` (``[seq, start, lo, mid_lo, mid_hi, hi]``) and its sequence's lengths
    and first rows: ``(seq, start, lo, mid_lo, mid_hi, hi, len_q, len_kv, row0_q, row0_kv)``. A
    surplus row (``seq < 0``) reads sequence 0's values (in bounds, meaningless). The Gluon twin of
    `common_triton.tile_header`."""
    seq = gl.load(tiles + tile * 6)
    seq_ok = gl.maximum(seq, 0)
    start = gl.load(tiles + tile * 6 + 1)
    lo = gl.load(tiles + tile * 6 + 2)
    mid_lo = gl.load(tiles + tile * 6 + 3)
    mid_hi = gl.load(tiles + tile * 6 + 4)
    hi = gl.load(tiles + tile * 6 + 5)
    len_q = gl.load(cu_seqlens_q + seq_ok + 1) - gl.load(cu_seqlens_q + seq_ok)
    len_kv = gl.load(cu_seqlens_kv + seq_ok + 1) - gl.load(cu_seqlens_kv + seq_ok)
    row0_q = gl.load(row_offsets_q + seq_ok)
    row0_kv = gl.load(row_offsets_kv + seq_ok)
    return seq, start, lo, mid_lo, mid_hi, hi, len_q, len_kv, row0_q, row0_kv


@gluon.jit
def _key_range(aligned, len_kv, window_left, window_right, chunk_size,
               HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr):
    """Visible keys ``[lo, hi)`` of queries aligned at ``aligned``; formulas of
    `common_triton.key_range` (``floor(a / c)`` only for ``a >= 0``; ``S = -c`` otherwise)."""
    lo = aligned * 0
    hi = lo + len_kv
    if HAS_RIGHT:
        hi = gl.minimum(hi, aligned + window_right + 1)
    if HAS_LEFT:
        lo = gl.maximum(lo, aligned - window_left)
    if HAS_CHUNK:
        chunk_start = gl.where(aligned < 0, -chunk_size, (gl.maximum(aligned, 0) // chunk_size) * chunk_size)
        lo = gl.maximum(lo, chunk_start)
        hi = gl.minimum(hi, chunk_start + chunk_size)
    return lo, hi


@gluon.jit
def _aligned_shift(len_q, len_kv, TOP_LEFT: gl.constexpr):
    """``a(q) = q + shift`` (`packattn.mask`'s alignment): 0 top-left, ``len_kv - len_q`` bottom-right
    (`common_triton.aligned_offset`'s Gluon twin)."""
    if TOP_LEFT:
        shift = len_q * 0
    else:
        shift = len_kv - len_q
    return shift


@gluon.jit
def _visible(offs_q, offs_k, len_q, len_kv, window_left, window_right, chunk_size,
             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr):
    """``(len(offs_q), len(offs_k))`` booleans: query ``offs_q[i]`` sees key ``offs_k[j]`` (positions
    inside the sequence; queries past ``len_q`` and keys past ``len_kv`` see nothing)."""
    aligned = offs_q + _aligned_shift(len_q, len_kv, TOP_LEFT)
    lo, hi = _key_range(aligned, len_kv, window_left, window_right, chunk_size, HAS_LEFT, HAS_RIGHT, HAS_CHUNK)
    ok = (offs_k[None, :] >= lo[:, None]) & (offs_k[None, :] < hi[:, None])
    return ok & (offs_q < len_q)[:, None]


# ---------------------------------------------------------------- softmax of one key block
@gluon.jit
def _softmax_block(s, m_i, l_i, offs_m, keys, len_q, len_kv, qk_scale_log2, window_left, window_right,
                   chunk_size, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr = None):
    """Fold the raw scores ``s`` of one key block into the running base-2 softmax: returns
    ``(p, alpha, m_new, l_new)`` with ``p`` unnormalised probabilities (float32) and ``alpha`` the
    factor the output accumulator must be rescaled by before ``p @ v`` is added. ``RESCALE_THRESHOLD``
    (`_new_max`): the forward's lazy rescaling (None: off)."""
    if MASKED:
        ok = _visible(offs_m, keys, len_q, len_kv, window_left, window_right, chunk_size,
                      HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
        p, alpha, m_new, l_new = _softmax_masked(s, ok, m_i, l_i, qk_scale_log2, RESCALE_THRESHOLD)
    else:
        p, alpha, m_new, l_new = _softmax_full(s, m_i, l_i, qk_scale_log2, RESCALE_THRESHOLD)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax_masked(s, ok, m_i, l_i, qk_scale_log2, RESCALE_THRESHOLD: gl.constexpr = None):
    """`_softmax_block` of a block whose visible scores are where ``ok`` (any boolean mask of ``s``'s
    shape and layout): scale, mask to -inf, then max."""
    s = gl.where(ok, s * qk_scale_log2, float("-inf"))
    m_new = _new_max(m_i, gl.max(s, 1), RESCALE_THRESHOLD)
    # rows that have seen no key yet keep m = -inf: subtract 0 instead (p = 0, no NaN)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_sub[:, None])
    alpha = _alpha(m_i, m_sub, m_new, RESCALE_THRESHOLD)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax_full(s, m_i, l_i, qk_scale_log2, RESCALE_THRESHOLD: gl.constexpr = None):
    """`_softmax_block` of a block whose every score is visible (no element mask)."""
    # all scores finite, scale >= 0: max(s) * c is the scaled row max, one FMA per score
    m_new = _new_max(m_i, gl.max(s, 1) * qk_scale_log2, RESCALE_THRESHOLD)
    p = gl.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = _alpha(m_i, m_new, m_new, RESCALE_THRESHOLD)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


# ---------------------------------------------------------------- lazy rescaling (forward)
@gluon.jit
def _new_max(m_i, m_blk, RESCALE_THRESHOLD: gl.constexpr):
    """The running max after a block whose scaled row max is ``m_blk``: ``max(m_i, m_blk)``; with a
    ``RESCALE_THRESHOLD`` (lazy rescaling, log2 units) ``m_i`` unless ``m_blk`` exceeds it by more than the
    threshold, so the block's ``p = exp2(s - m) <= 2^threshold`` (a row with ``m_i = -inf`` takes any finite
    ``m_blk``). ``out = acc / l`` and ``lse = m + log2 l`` stay exact: ``l`` sums the ``p`` of the ``m`` used."""
    if RESCALE_THRESHOLD is None:
        m_new = gl.maximum(m_i, m_blk)
    else:
        m_new = gl.where(m_blk > m_i + RESCALE_THRESHOLD, m_blk, m_i)
    return m_new


@gluon.jit
def _alpha(m_i, m_sub, m_new, RESCALE_THRESHOLD: gl.constexpr):
    """The output's rescale factor ``exp2(m_i - m_sub)``; with lazy rescaling exactly 1 where the max did not
    move (not left to ex2.approx of 0)."""
    alpha = gl.exp2(m_i - m_sub)
    if RESCALE_THRESHOLD is not None:
        alpha = gl.where(m_new == m_i, 1.0, alpha)
    return alpha


@gluon.jit
def _rows_any(flag):
    """Is ``flag`` (a boolean per row of a warp group's tile) true on some row: a scalar, uniform over the warp
    group (a reduction across its warps: shared memory and a barrier over the group's threads)."""
    return gl.max(flag.to(gl.int32), 0) > 0


@gluon.jit
def _scale_acc(acc, alpha, rescale, o_layout: gl.constexpr):
    """``acc * alpha`` by rows if ``rescale``: the constant True (the multiplies as unconditional code), or a
    warp-group-uniform flag, False when every row's ``alpha`` is 1 (or its ``acc`` still 0): lazy rescaling
    skips the multiplies then."""
    if rescale:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc


@gluon.jit
def _softmax_any(s, m_i, l_i, offs_m, offs_n, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2,
                 window_left, window_right, chunk_size, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                 HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr = None):
    """`_softmax_block` with the element mask only outside the fully visible band
    ``[mid_lo, mid_hi)`` (a uniform branch: one software-pipelined loop serves both kinds of block)."""
    if (n_start < n_mid_lo) | (n_start >= n_mid_hi):
        p, alpha, m_new, l_new = _softmax_block(s, m_i, l_i, offs_m, n_start + offs_n, len_q, len_kv, qk_scale_log2,
                                                window_left, window_right, chunk_size, True, HAS_LEFT, HAS_RIGHT,
                                                HAS_CHUNK, TOP_LEFT, RESCALE_THRESHOLD)
    else:
        p, alpha, m_new, l_new = _softmax_block(s, m_i, l_i, offs_m, n_start + offs_n, len_q, len_kv, qk_scale_log2,
                                                window_left, window_right, chunk_size, False, HAS_LEFT, HAS_RIGHT,
                                                HAS_CHUNK, TOP_LEFT, RESCALE_THRESHOLD)
    return p, alpha, m_new, l_new


# ---------------------------------------------------------------- shared-memory pipeline pieces
@gluon.jit
def _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, block, row0_kv, n_lo, col_kv, num_blocks,
                   STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA K and V rows ``n_lo + block * BLOCK_N ...`` of the kv head at column ``col_kv`` into ring
    slot ``block % STAGES``; both land on that slot's barrier. Skipped when ``block >= num_blocks``."""
    slot = block % STAGES
    pred = block < num_blocks
    bar = ready.index(slot)
    row = row0_kv + n_lo + block * BLOCK_N
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma_load(k_desc, [row, col_kv], bar, k_bufs.index(slot), pred=pred)
    tma_load(v_desc, [row, col_kv], bar, v_bufs.index(slot), pred=pred)


@gluon.jit
def _issue_qk(q_smem, k_bufs, ready, block, s_zero, STAGES: gl.constexpr):
    """Wait for block ``block``'s K to land, then start ``S = Q K^T`` asynchronously (returns the token)."""
    slot = block % STAGES
    mbarrier.wait(ready.index(slot), (block // STAGES) & 1)
    return warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _zero_v_tail(v_buf, first_row, len_kv, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr,
                 CHUNK: gl.constexpr = 32):
    """Zero the rows of one V slot that lie past the sequence end (positions ``>= len_kv``), in
    ``CHUNK``-row chunks (few registers; ``CHUNK`` divides ``BLOCK_N``, `tail_chunk`), then fence and
    synchronise the CTA so both warp groups' wgmma see the zeros. Their probabilities are 0 already,
    but 0 * NaN from padding would not be."""
    gl.static_assert(BLOCK_N % CHUNK == 0, "whole chunks")
    layout: gl.constexpr = row_store_layout(num_warps, HEAD_DIM)
    for c in gl.static_range(BLOCK_N // CHUNK):
        part = v_buf.slice(c * CHUNK, CHUNK, dim=0)
        rows = first_row + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        vals = part.load(layout)
        part.store(gl.where((rows < len_kv)[:, None], vals, gl.zeros_like(vals)))
    fence_async_shared()
    thread_barrier()


@gluon.constexpr_function
def tail_chunk(rows, head_dim):
    """Rows per step of `_zero_v_tail` over ``rows`` rows of ``head_dim`` columns (4 warps): 32, fewer where the
    part has fewer rows (a 32-row step would zero nothing) or where 32 rows would take more than 16 registers a
    thread (d = 256: the forward's tail is zeroed with its 64 x 256 output accumulator live)."""
    chunk = min(int(rows), 32, 4096 // int(head_dim))
    return 1 << (chunk.bit_length() - 1)  # a power of two: it divides a power-of-two part's rows


@gluon.jit
def _to_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    """Probabilities (S accumulator layout, float32) -> the wgmma A operand in registers."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
