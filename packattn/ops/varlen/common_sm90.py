"""Forward flash attention over packed (THD) sequences for Hopper (sm_90a), written in Gluon.

Same contract as `packattn.ops.varlen.fwd_triton.varlen_fwd_kernel` (tile table rows
``[seq, q_start, lo, mid_lo, mid_hi, hi]``, ``cu_seqlens`` / ``row_offsets`` meaning, masks, GQA,
``out`` in the input dtype, ``lse`` float32 natural log, ``out = 0`` / ``lse = -inf`` for a row that
sees no key), but scheduled by hand so that the tensor cores and the softmax overlap. Triton 3.6
puts a ``wgmma.wait_group 0`` right after every ``tl.dot``, so there the QK^T wgmma, the softmax and
the PV wgmma of a warp group run strictly one after another.

Layout of one program (one query tile of ``BLOCK_M = 128`` rows x one query head, 8 warps; the
kernel also runs ``BLOCK_M = 64`` with 4 warps, one warp group):

* two warp groups, each owning 64 query rows: the accumulator layouts are ``NVMMADistributedLayout``
  version 3 with ``warps_per_cta = [8, 1]`` (rows split over the warps, never the columns, so the
  row max / row sum are reductions inside a quad of threads: no shared memory);
* Q (``BLOCK_M x HEAD_DIM``) and ``STAGES`` ring slots of K and V (``BLOCK_N x HEAD_DIM`` each)
  live in NVMMA-swizzled shared memory, filled by TMA through 2-D descriptors over the
  ``(rows, heads * head_dim)`` views of q / k / v; one mbarrier per slot (K and V of a block land
  on the same barrier);
* S = Q K^T reads both operands from shared memory; O += P V takes P from registers (the S
  accumulator layout converts to the wgmma A-operand layout in registers) and V from shared memory.

Pipeline of one warp group, iteration ``j`` (FlashAttention-3's intra-warpgroup overlap); it
enters with P[j] and alpha[j] in registers and no wgmma in flight::

    issue  S[j+1] = Q K[j+1]^T               (async, after K[j+1]'s barrier)
    O *= alpha[j]; issue O += P[j] V[j]       (async; two wgmma groups in flight)
    wait   until 1 group is pending          (S[j+1] done, PV[j] still runs)
    softmax of S[j+1] -> P[j+1], alpha[j+1]  (overlaps PV[j] on the tensor cores)
    wait   until 0 groups are pending        (PV[j] done)
    CTA barrier; TMA block j+STAGES into block j's ring slot

No wgmma is in flight across the loop's back edge: a variant that carried PV[j] in flight into
the next iteration (overlapping the softmax with S[j+1] *and* PV[j]) made ptxas serialise every
wgmma of the kernel (warning C7514, "non wgmma instructions reading accumulator registers").
The CTA barrier before the refill makes slot reuse safe with two warp groups (the other group
may still be reading V[j]); block ``j+STAGES`` is first needed in iteration ``j+STAGES-1``, so
``STAGES = 3`` prefetches two iterations ahead. The two warp groups are not explicitly
ping-ponged (no named barriers in Gluon 3.6); the per-iteration barrier keeps them in step, and
each keeps its own wgmma's in flight during its softmax.

Rows past a sequence's end are read by TMA as they are (the next sequence's rows, padding, or
zeros past the tensor): the element mask makes their scores -inf, and V rows past ``len_kv``
in the (at most one) block per tile that crosses the sequence end are zeroed in shared memory
before the PV wgmma, so uninitialised padding (NaN/Inf) cannot leak into ``0 * v``. Q rows past
``len_q`` only produce output rows that are never stored.

`packattn.ops.varlen.fwd_sm90.varlen_fwd_gluon_ws_kernel` is the warp-specialised variant of the same
contract: a TMA producer warp and one partition per consumer warp group, synchronised only by
mbarriers (see the comment above `_work_item`).

The mask helpers below are the Gluon twins of `packattn.ops.varlen.common_triton.aligned_offset` /
`key_range` (same formulas, see `packattn.mask`); the softmax is the base-2 online softmax of
`varlen_common.online_softmax_step` (unmasked blocks: ``m = max(m, rowmax(S) * c)``,
``p = exp2(S * c - m)``; masked blocks: scale, mask, then max).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = gl.constexpr(0.6931471805599453)


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


# ---------------------------------------------------------------- mask (twin of varlen_common)
@gluon.jit
def _tile_row(tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv):
    """Tile-table row ``tile`` (``[seq, start, lo, mid_lo, mid_hi, hi]``) and its sequence's lengths
    and first rows: ``(seq, start, lo, mid_lo, mid_hi, hi, len_q, len_kv, row0_q, row0_kv)``. A
    surplus row (``seq < 0``) reads sequence 0's values (in bounds, meaningless). The Gluon twin of
    `varlen_common.tile_header`."""
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
    `varlen_common.key_range` (``floor(a / c)`` only for ``a >= 0``; ``S = -c`` otherwise)."""
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
    (`varlen_common.aligned_offset`'s Gluon twin)."""
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
                   HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr):
    """Fold the raw scores ``s`` of one key block into the running base-2 softmax: returns
    ``(p, alpha, m_new, l_new)`` with ``p`` unnormalised probabilities (float32) and ``alpha`` the
    factor the output accumulator must be rescaled by before ``p @ v`` is added."""
    if MASKED:
        ok = _visible(offs_m, keys, len_q, len_kv, window_left, window_right, chunk_size,
                      HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
        p, alpha, m_new, l_new = _softmax_masked(s, ok, m_i, l_i, qk_scale_log2)
    else:
        p, alpha, m_new, l_new = _softmax_full(s, m_i, l_i, qk_scale_log2)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax_masked(s, ok, m_i, l_i, qk_scale_log2):
    """`_softmax_block` of a block whose visible scores are where ``ok`` (any boolean mask of ``s``'s
    shape and layout): scale, mask to -inf, then max."""
    s = gl.where(ok, s * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # rows that have seen no key yet keep m = -inf: subtract 0 instead (p = 0, no NaN)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax_full(s, m_i, l_i, qk_scale_log2):
    """`_softmax_block` of a block whose every score is visible (no element mask)."""
    # all scores finite, scale >= 0: max(s) * c is the scaled row max, one FMA per score
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
    p = gl.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax_any(s, m_i, l_i, offs_m, offs_n, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2,
                 window_left, window_right, chunk_size, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                 HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr):
    """`_softmax_block` with the element mask only outside the fully visible band
    ``[mid_lo, mid_hi)`` (a uniform branch: one software-pipelined loop serves both kinds of block)."""
    if (n_start < n_mid_lo) | (n_start >= n_mid_hi):
        p, alpha, m_new, l_new = _softmax_block(s, m_i, l_i, offs_m, n_start + offs_n, len_q, len_kv, qk_scale_log2,
                                                window_left, window_right, chunk_size, True, HAS_LEFT, HAS_RIGHT,
                                                HAS_CHUNK, TOP_LEFT)
    else:
        p, alpha, m_new, l_new = _softmax_block(s, m_i, l_i, offs_m, n_start + offs_n, len_q, len_kv, qk_scale_log2,
                                                window_left, window_right, chunk_size, False, HAS_LEFT, HAS_RIGHT,
                                                HAS_CHUNK, TOP_LEFT)
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
    tma.async_copy_global_to_shared(k_desc, [row, col_kv], bar, k_bufs.index(slot), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, col_kv], bar, v_bufs.index(slot), pred=pred)


@gluon.jit
def _issue_qk(q_smem, k_bufs, ready, block, s_zero, STAGES: gl.constexpr):
    """Wait for block ``block``'s K to land, then start ``S = Q K^T`` asynchronously (returns the token)."""
    slot = block % STAGES
    mbarrier.wait(ready.index(slot), (block // STAGES) & 1)
    return warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _zero_v_tail(v_buf, first_row, len_kv, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """Zero the rows of one V slot that lie past the sequence end (positions ``>= len_kv``), in
    32-row chunks (few registers), then fence and synchronise the CTA so both warp groups' wgmma
    see the zeros. Their probabilities are 0 already, but 0 * NaN from padding would not be."""
    CHUNK: gl.constexpr = 32
    layout: gl.constexpr = row_store_layout(num_warps, HEAD_DIM)
    for c in gl.static_range(BLOCK_N // CHUNK):
        part = v_buf.slice(c * CHUNK, CHUNK, dim=0)
        rows = first_row + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        vals = part.load(layout)
        part.store(gl.where((rows < len_kv)[:, None], vals, gl.zeros_like(vals)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _issue_pv(acc, p_op, alpha, v_bufs, block, n_start, len_kv, o_layout: gl.constexpr, STAGES: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """Rescale O by ``alpha`` (O is not in flight here) and start ``O += P V`` of block ``block``
    asynchronously; a block that crosses the sequence end first gets its V tail zeroed."""
    v_buf = v_bufs.index(block % STAGES)
    if n_start + BLOCK_N > len_kv:
        _zero_v_tail(v_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, num_warps)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return warpgroup_mma(p_op, v_buf, acc, is_async=True)


@gluon.jit
def _to_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    """Probabilities (S accumulator layout, float32) -> the wgmma A operand in registers."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


# ---------------------------------------------------------------- the loop over key blocks
@gluon.jit
def _attend(q_smem, k_desc, v_desc, k_bufs, v_bufs, ready, m_i, l_i, acc, row0_kv, col_kv, offs_m, offs_n,
            n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, qk_scale_log2, window_left, window_right,
            chunk_size, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
            HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, num_warps: gl.constexpr):
    """All ``num_blocks >= 1`` key blocks of the tile, software-pipelined (module docstring);
    the first ``min(STAGES, num_blocks)`` blocks are already in flight. Returns ``(acc, m, l)``.

    Iteration ``j`` enters with P[j] / alpha[j] computed and O not in flight, and leaves with
    P[j+1] / alpha[j+1] and O complete again: no wgmma is in flight across the loop's back edge
    (ptxas serialises every wgmma of the kernel when one is, warning C7514)."""
    dtype: gl.constexpr = q_smem.dtype
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma_wait(0, deps=(_issue_qk(q_smem, k_bufs, ready, 0, s_zero, STAGES), ))
    p, alpha, m_i, l_i = _softmax_any(s, m_i, l_i, offs_m, offs_n, n_lo, n_mid_lo, n_mid_hi, len_q, len_kv,
                                      qk_scale_log2, window_left, window_right, chunk_size, HAS_LEFT, HAS_RIGHT,
                                      HAS_CHUNK, TOP_LEFT)
    p_op = _to_operand(p, dtype, o_layout)
    for j in range(0, num_blocks - 1):
        s_tok = _issue_qk(q_smem, k_bufs, ready, j + 1, s_zero, STAGES)
        acc_tok = _issue_pv(acc, p_op, alpha, v_bufs, j, n_lo + j * BLOCK_N, len_kv, o_layout, STAGES, BLOCK_N,
                            HEAD_DIM, num_warps)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S[j+1] done; PV[j] keeps the tensor cores busy
        p, alpha, m_i, l_i = _softmax_any(s, m_i, l_i, offs_m, offs_n, n_lo + (j + 1) * BLOCK_N, n_mid_lo, n_mid_hi,
                                          len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size,
                                          HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        p_op = _to_operand(p, dtype, o_layout)
        # both warp groups are done with block j (K by S[j], V by PV[j]): its slot takes block j+STAGES
        gl.thread_barrier()
        _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, j + STAGES, row0_kv, n_lo, col_kv, num_blocks,
                       STAGES, BLOCK_N)
    last = num_blocks - 1
    acc_tok = _issue_pv(acc, p_op, alpha, v_bufs, last, n_lo + last * BLOCK_N, len_kv, o_layout, STAGES, BLOCK_N,
                        HEAD_DIM, num_warps)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
    return acc, m_i, l_i


# ---------------------------------------------------------------- epilogue
@gluon.jit
def _store_out(acc, m_i, l_i, stage, Out, Lse, row0_q, q_start, len_q, head, stride_o_row, stride_o_head,
               stride_lse_head, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
               num_warps: gl.constexpr):
    """Normalise and store the tile's rows that belong to the sequence: ``out`` through the shared
    buffer ``stage`` (Q's, free by now) so the global stores are 16 B per thread; ``lse`` in
    natural log. A row that saw no key gets ``out = 0``, ``lse = -inf``."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    empty = l_o == 0.0
    l_safe = gl.where(empty, 1.0, l_o)
    out = acc * (1.0 / l_safe)[:, None]
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    lse = gl.where(empty, float("-inf"), (m_o + gl.log2(l_safe)) * LN2)
    offs_l = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    gl.store(Lse + head.to(gl.int64) * stride_lse_head + row0_q + offs_l, lse, mask=offs_l < len_q)

    gl.thread_barrier()  # every warp group is done reading Q
    stage.store(out.to(stage.dtype))
    gl.thread_barrier()
    layout: gl.constexpr = row_store_layout(num_warps, HEAD_DIM)
    vals = stage.load(layout)
    rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    base = Out + row0_q * stride_o_row + head.to(gl.int64) * stride_o_head
    ptrs = base + rows.to(gl.int64)[:, None] * stride_o_row + cols[None, :]
    gl.store(ptrs, vals, mask=(rows < len_q)[:, None])


# ---------------------------------------------------------------- kernel
@gluon.jit
def varlen_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, Out, Lse, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_o_row, stride_o_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, window_left, window_right, chunk_size,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One program per (query tile, query head); see the module docstring. ``q_desc``/``k_desc``/
    ``v_desc``: TMA descriptors over the ``(rows, heads * HEAD_DIM)`` views, blocks
    ``[BLOCK_M, HEAD_DIM]`` (q) and ``[BLOCK_N, HEAD_DIM]`` (k, v)."""
    gl.static_assert(BLOCK_M == 16 * num_warps, "one warp group per 64 query rows (4 or 8 warps)")
    gl.static_assert(STAGES >= 2, "block j+STAGES is loaded at the end of iteration j")
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)

    pid = gl.program_id(0)
    tile = pid // num_heads_q  # heads vary fastest: the longest tiles of every head start first
    head = pid % num_heads_q
    seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi, len_q, len_kv, row0_q, row0_kv = _tile_row(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    col_kv = (head // group_size) * HEAD_DIM
    num_blocks = (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N

    # shared memory: Q, the K/V ring, one barrier for Q and one per ring slot
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, i, row0_kv, n_lo, col_kv, num_blocks, STAGES, BLOCK_N)

    offs_m = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    if num_blocks > 0:
        acc, m_i, l_i = _attend(q_smem, k_desc, v_desc, k_bufs, v_bufs, ready, m_i, l_i, acc, row0_kv, col_kv,
                                offs_m, offs_n, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, qk_scale_log2,
                                window_left, window_right, chunk_size, s_layout, o_layout, BLOCK_M, BLOCK_N,
                                HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, num_warps)

    _store_out(acc, m_i, l_i, q_smem, Out, Lse, row0_q.to(gl.int64), q_start, len_q, head, stride_o_row,
               stride_o_head, stride_lse_head, o_layout, BLOCK_M, HEAD_DIM, num_warps)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
