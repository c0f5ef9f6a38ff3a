"""Gluon dQ backward for Hopper (sm_90a) without warp specialisation (`varlen_bwd_dq_gluon_kernel`, the Gluon
dQ at head dim 64), under the contract of `packattn.ops.varlen.bwd_common_sm90` (module docstring).

`varlen_bwd_dq_gluon_kernel`: one program per (query tile of ``BLOCK_M = 16 * num_warps`` queries, query head);
Q and dO loaded once, (K, V) blocks through a ``STAGES``-slot TMA ring (one mbarrier per slot). Step ``j``
enters with dS[j-1] as a register A operand and no wgmma in flight::

    issue  S[j] = Q K[j]^T, dP[j] = dO V[j]^T, dQ += dS[j-1] K[j-1]   (async; three groups in flight)
    wait   until 2 pending                 (S[j] done)
    P[j] = exp2(S c - lse log2e), masked off the band   (dP[j], dQ[j-1] run)
    wait   until 1 pending                 (dP[j] done)
    dS[j] = P (dP - delta) -> A operand    (dQ[j-1] runs)
    wait   until 0 pending; CTA barrier; TMA block j-1+STAGES into block j-1's slot

The last block's dQ product is issued after the loop. ``STAGES >= 3`` keeps one block of prefetch. K and V
rows past ``len_kv`` in the (at most one) block that crosses the sequence end are zeroed in shared memory
before any wgmma reads them (0 * NaN from padding would poison valid rows); query rows past ``len_q`` only
produce dQ rows that are never stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from packattn.ops.varlen.bwd_common_sm90 import _lse_log2, _probs, _row_vector, _store_tile
from packattn.ops.varlen.common_sm90 import _load_kv_block, _tile_row, _to_operand, _zero_v_tail, mma_layout

# ---------------------------------------------------------------- shared pieces
# ---------------------------------------------------------------- dQ
@gluon.jit
def _dq_step(j, ds_prev, dq, q_smem, do_smem, k_bufs, v_bufs, ready, lse_log2, delta, offs_m, n_lo, n_mid_lo,
             n_mid_hi, len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size,
             s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
             HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, WITH_PREV: gl.constexpr, num_warps: gl.constexpr):
    """Key block ``j`` of the dQ loop (module docstring). ``WITH_PREV``: also issue the previous
    block's ``dQ += dS K`` (operand ``ds_prev``). Returns ``(dq, ds)``, no wgmma in flight."""
    slot = j % STAGES
    mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
    n_start = n_lo + j * BLOCK_N
    k_buf = k_bufs.index(slot)
    v_buf = v_bufs.index(slot)
    if n_start + BLOCK_N > len_kv:  # keys past the sequence: zeros, not NaN, enter dQ
        _zero_v_tail(k_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, num_warps)
        _zero_v_tail(v_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, num_warps)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_smem, v_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if WITH_PREV:
        dq_tok = warpgroup_mma(ds_prev, k_bufs.index((j + STAGES - 1) % STAGES), dq, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p = _probs(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left,
               window_right, chunk_size, BLOCK_N, s_layout, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
    if WITH_PREV:
        dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    else:
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = _to_operand(p * (dp - delta[:, None]), q_smem.dtype, o_layout)
    if WITH_PREV:
        dq, ds_prev = warpgroup_mma_wait(0, deps=(dq_tok, ds_prev))
    return dq, ds


@gluon.jit
def _dq_loop(q_smem, do_smem, k_desc, v_desc, k_bufs, v_bufs, ready, dq, lse_log2, delta, row0_kv, col_kv, offs_m,
             n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, qk_scale_log2, window_left, window_right,
             chunk_size, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
             HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, num_warps: gl.constexpr):
    """All ``num_blocks >= 1`` key blocks of one query tile, software-pipelined; the first
    ``min(STAGES, num_blocks)`` blocks are already being loaded."""
    dq, ds = _dq_step(0, None, dq, q_smem, do_smem, k_bufs, v_bufs, ready, lse_log2, delta, offs_m, n_lo, n_mid_lo,
                      n_mid_hi, len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                      o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, False,
                      num_warps)
    for j in range(1, num_blocks):
        dq, ds = _dq_step(j, ds, dq, q_smem, do_smem, k_bufs, v_bufs, ready, lse_log2, delta, offs_m, n_lo,
                          n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size,
                          s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                          TOP_LEFT, True, num_warps)
        # both warp groups are done with block j-1 (K by dQ[j-1], V by dP[j-1]): refill its slot
        gl.thread_barrier()
        _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, j - 1 + STAGES, row0_kv, n_lo, col_kv, num_blocks,
                       STAGES, BLOCK_N)
    last_k = k_bufs.index((num_blocks - 1) % STAGES)
    dq, ds = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, last_k, dq, is_async=True), ds))
    return dq


@gluon.jit
def varlen_bwd_dq_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, Lse, Delta, dQ, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_dq_row, stride_dq_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dQ of one (query tile, query head); see the module docstring. Descriptors: ``q_desc`` /
    ``do_desc`` blocks ``[BLOCK_M, HEAD_DIM]``, ``k_desc`` / ``v_desc`` blocks ``[BLOCK_N, HEAD_DIM]``.
    Tile rows ``[seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi]`` (key ranges on the grid
    ``n_lo + i * BLOCK_N``). Queries that see no key get dQ = 0."""
    gl.static_assert(BLOCK_M == 16 * num_warps, "one warp group per 64 queries (4 or 8 warps)")
    gl.static_assert(STAGES >= 2, "block j-1+STAGES is loaded at the end of iteration j")
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)  # S, dP: (BLOCK_M, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)  # dQ: (BLOCK_M, HEAD_DIM)

    pid = gl.program_id(0)
    tile = pid // num_heads_q
    head = pid % num_heads_q
    seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi, len_q, len_kv, row0_q, row0_kv = _tile_row(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    col_kv = (head // group_size) * HEAD_DIM
    num_blocks = (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, do_smem)
    for i in gl.static_range(STAGES):
        _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, i, row0_kv, n_lo, col_kv, num_blocks, STAGES, BLOCK_N)

    row0_q64 = row0_q.to(gl.int64)
    offs_m = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    lse_log2 = _lse_log2(Lse, head, stride_lse_head, row0_q, q_start, len_q, BLOCK_M, gl.SliceLayout(1, s_layout))
    delta = _row_vector(Delta, head, stride_lse_head, row0_q, q_start, len_q, BLOCK_M, gl.SliceLayout(1, s_layout),
                        0.0)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    if num_blocks > 0:
        dq = _dq_loop(q_smem, do_smem, k_desc, v_desc, k_bufs, v_bufs, ready, dq, lse_log2, delta, row0_kv, col_kv,
                      offs_m, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, qk_scale_log2, window_left,
                      window_right, chunk_size, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT,
                      HAS_RIGHT, HAS_CHUNK, TOP_LEFT, num_warps)

    _store_tile(dq * scale, q_smem, dQ + row0_q64 * stride_dq_row + head.to(gl.int64) * stride_dq_head, q_start,
                len_q, stride_dq_row, BLOCK_M, HEAD_DIM, num_warps)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
