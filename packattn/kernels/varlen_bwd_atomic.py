"""Backward with dQ fused into the dK/dV pass through float32 atomics (not deterministic).

Same geometry as `varlen_bwd.bwd_dkdv_kernel` (one program per (key tile, kv head), looping over
the query heads of its GQA group and the query blocks that can see the tile), but each query
block's ``dS K`` is added into a float32 dQ buffer with atomics instead of being recomputed by a
separate dQ pass: 5 matmuls per (query block, key block) pair instead of 7. The order of the
atomic additions varies between runs, so `deterministic=True` uses `varlen_bwd` instead.
"""

import triton
import triton.language as tl

from packattn.kernels.varlen_bwd import LOG2E, _tile_header
from packattn.kernels.varlen_common import load_rows, store_rows, visible_tile_keys_by_queries


@triton.jit
def _fused_from_query_blocks(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base,
                             stride_q_row, stride_do_row, stride_dq_row,
                             m_from, m_to, offs_n, len_q, len_kv, qk_scale_log2, scale,
                             window_left, window_right, chunk_size,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                             HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    for m_start in range(m_from, m_to, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < len_q
        q = load_rows(q_base, m_start, stride_q_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, MASKED)
        do = load_rows(do_base, m_start, stride_do_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, MASKED)
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale_log2
        p_t = tl.math.exp2(s_t - lse_log2[None, :])
        if MASKED:
            ok = visible_tile_keys_by_queries(offs_n, offs_m, len_q, len_kv, window_left, window_right,
                                              chunk_size, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
            p_t = tl.where(ok, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q, input_precision=INPUT_PRECISION)
        dq_part = tl.dot(tl.trans(ds_t), k, input_precision=INPUT_PRECISION) * scale  # (BLOCK_M, BLOCK_D)
        ptrs = dq_base + tl.cast(m_start, tl.int64) * stride_dq_row + (tl.arange(0, BLOCK_M)[:, None] * stride_dq_row + offs_d[None, :])
        tl.atomic_add(ptrs, dq_part, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def bwd_fused_kernel(
    Q, K, V, dOut, Lse, Delta, dQacc, dK, dV, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dq_row, stride_dq_head, stride_dk_row, stride_dk_head,
    stride_dv_row, stride_dv_head, stride_lse_head,
    num_heads_kv, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid // num_heads_kv
    kv_head = pid % num_heads_kv
    seq, k_start, m_lo, m_mid_lo, m_mid_hi, m_hi, len_q, len_kv, row0_q, row0_kv = _tile_header(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    offs_n = k_start + tl.arange(0, BLOCK_N)
    key_ok = offs_n < len_kv
    k = load_rows(K + row0_kv * stride_k_row + kv_head * stride_k_head, k_start, stride_k_row, key_ok,
                  HEAD_DIM, BLOCK_D, BLOCK_N, True)
    v = load_rows(V + row0_kv * stride_v_row + kv_head * stride_v_head, k_start, stride_v_row, key_ok,
                  HEAD_DIM, BLOCK_D, BLOCK_N, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(group_size):
        head = kv_head * group_size + g
        q_base = Q + row0_q * stride_q_row + head * stride_q_head
        do_base = dOut + row0_q * stride_do_row + head * stride_do_head
        dq_base = dQacc + row0_q * stride_dq_row + head * stride_dq_head
        lse_base = Lse + head.to(tl.int64) * stride_lse_head + row0_q
        delta_base = Delta + head.to(tl.int64) * stride_lse_head + row0_q
        dk, dv = _fused_from_query_blocks(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base,
                                          stride_q_row, stride_do_row, stride_dq_row, m_lo, m_mid_lo, offs_n,
                                          len_q, len_kv, qk_scale_log2, scale, window_left, window_right,
                                          chunk_size, HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
                                          HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)
        dk, dv = _fused_from_query_blocks(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base,
                                          stride_q_row, stride_do_row, stride_dq_row, m_mid_lo, m_mid_hi, offs_n,
                                          len_q, len_kv, qk_scale_log2, scale, window_left, window_right,
                                          chunk_size, HEAD_DIM, BLOCK_D, BLOCK_M, False, HAS_LEFT, HAS_RIGHT,
                                          HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)
        dk, dv = _fused_from_query_blocks(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base,
                                          stride_q_row, stride_do_row, stride_dq_row, m_mid_hi, m_hi, offs_n,
                                          len_q, len_kv, qk_scale_log2, scale, window_left, window_right,
                                          chunk_size, HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
                                          HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)
    store_rows(dK + row0_kv * stride_dk_row + kv_head * stride_dk_head, k_start, stride_dk_row, key_ok, dk * scale,
               HEAD_DIM, BLOCK_D, BLOCK_N)
    store_rows(dV + row0_kv * stride_dv_row + kv_head * stride_dv_head, k_start, stride_dv_row, key_ok, dv,
               HEAD_DIM, BLOCK_D, BLOCK_N)
