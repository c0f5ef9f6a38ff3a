"""Backward flash attention over packed (THD) sequences, deterministic by construction.

Three kernels, none with atomics, each output element written by exactly one program that sums
its contributions in a fixed order, so two runs give bitwise-equal gradients:

* `bwd_preprocess_kernel`: ``delta = rowsum(dO * O) - dlse`` (float32, ``(heads_q, rows)``);
  the ``dlse`` term carries a gradient that flows into the returned log-sum-exp.
* `bwd_dkdv_kernel`: one program per (key tile, kv head) holds dK, dV of its keys in float32
  and loops over the query heads of its GQA group, then over the query blocks that can see the
  tile (`packattn.mask.block_query_range`).
* `bwd_dq_kernel`: one program per (query tile, query head) loops over its visible key blocks.

Tile tables are the launcher's ``int32 (num_tiles, 6)`` rows ``[seq, start, lo, mid_lo, mid_hi, hi]``
(see `varlen_fwd`): for dK/dV, ``start`` is the first key of the tile and the ranges are query
positions; blocks in ``[mid_lo, mid_hi)`` skip the element mask. With ``P = exp2(S * scale * log2e
- lse * log2e)`` recomputed from the saved ``lse``: ``dV = P^T dO``, ``dS = P * (dO V^T - delta)``,
``dK = scale * dS^T Q``, ``dQ = scale * dS K``. Rows with ``lse = -inf`` (no visible key) get P = 0.
Q, K, dQ, dK have head dim ``HEAD_DIM`` (tiles ``BLOCK_D`` wide); V, dO, dV ``HEAD_DIM_V`` (``BLOCK_DV``), MLA
when they differ; the preprocess runs over the value head dim (its ``HEAD_DIM`` is O's).
"""

import triton
import triton.language as tl

from packattn.ops.runtime import launch

from packattn.ops.varlen.common_triton import (load_rows, store_rows, tile_header, visible_tile,
                                            visible_tile_keys_by_queries)

LOG2E = tl.constexpr(launch.LOG2E)


@triton.jit
def bwd_preprocess_kernel(Out, dOut, Lse, dLse, Delta, total_rows,
                          stride_o_row, stride_o_head, stride_do_row, stride_do_head, stride_delta_head,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          HAS_DLSE: tl.constexpr):
    """``delta[h, r] = sum_d dO[r, h, d] * O[r, h, d] - dlse[h, r]``; grid (row blocks, heads)."""
    head = tl.program_id(1)
    first_row = tl.program_id(0) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < total_rows
    o = load_rows(Out + head * stride_o_head, first_row, stride_o_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    do = load_rows(dOut + head * stride_do_head, first_row, stride_do_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    at = head.to(tl.int64) * stride_delta_head + rows
    if HAS_DLSE:
        dlse = tl.load(dLse + at, mask=row_ok, other=0.0)
        sees_nothing = tl.load(Lse + at, mask=row_ok, other=0.0) == float("-inf")
        delta -= tl.where(sees_nothing, 0.0, dlse)  # P = 0 on such rows: their dlse (even NaN) plays no part
    tl.store(Delta + at, delta, mask=row_ok)


@triton.jit
def _dkdv_from_query_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_q_row, stride_do_row,
                            m_from, m_to, offs_n, len_q, len_kv, qk_scale_log2,
                            window_left, window_right, chunk_size, key_end,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                            BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                            HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr, TREE: tl.constexpr,
                            INPUT_PRECISION: tl.constexpr):
    """Add the contributions of query blocks ``m_from, m_from + BLOCK_M, ... < m_to`` of one head."""
    for m_start in range(m_from, m_to, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < len_q  # unmasked blocks lie inside [0, len_q): no row check there
        q = load_rows(q_base, m_start, stride_q_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, MASKED)
        do = load_rows(do_base, m_start, stride_do_row, row_ok, HEAD_DIM_V, BLOCK_DV, BLOCK_M, MASKED)
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # no visible key: P = 0
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale_log2  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse_log2[None, :])
        if MASKED:
            ok = visible_tile_keys_by_queries(offs_n, offs_m, len_q, len_kv, window_left, window_right,
                                              chunk_size, key_end, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
            p_t = tl.where(ok, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, key_end,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head,
    stride_lse_head,
    num_heads_kv, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TREE: tl.constexpr = False,
):
    """``TREE``: one sequence that is a packed trie, ``key_end`` its `Tree.row_subtree_end`; the
    tile table then comes from `packattn.backends.triton_tree` (same row format)."""
    pid = tl.program_id(0)
    tile = pid // num_heads_kv
    kv_head = pid % num_heads_kv
    seq, k_start, m_lo, m_mid_lo, m_mid_hi, m_hi, len_q, len_kv, row0_q, row0_kv = tile_header(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    offs_n = k_start + tl.arange(0, BLOCK_N)
    key_ok = offs_n < len_kv
    k = load_rows(K + row0_kv * stride_k_row + kv_head * stride_k_head, k_start, stride_k_row, key_ok,
                  HEAD_DIM, BLOCK_D, BLOCK_N, True)
    v = load_rows(V + row0_kv * stride_v_row + kv_head * stride_v_head, k_start, stride_v_row, key_ok,
                  HEAD_DIM_V, BLOCK_DV, BLOCK_N, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(group_size):  # fixed order over the query heads sharing this kv head
        head = kv_head * group_size + g
        q_base = Q + row0_q * stride_q_row + head * stride_q_head
        do_base = dOut + row0_q * stride_do_row + head * stride_do_head
        lse_base = Lse + head.to(tl.int64) * stride_lse_head + row0_q
        delta_base = Delta + head.to(tl.int64) * stride_lse_head + row0_q
        dk, dv = _dkdv_from_query_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                         stride_q_row, stride_do_row, m_lo, m_mid_lo, offs_n, len_q, len_kv,
                                         qk_scale_log2, window_left, window_right, chunk_size, key_end,
                                         HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                         TOP_LEFT, TREE, INPUT_PRECISION)
        dk, dv = _dkdv_from_query_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                         stride_q_row, stride_do_row, m_mid_lo, m_mid_hi, offs_n, len_q, len_kv,
                                         qk_scale_log2, window_left, window_right, chunk_size, key_end,
                                         HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                         TOP_LEFT, TREE, INPUT_PRECISION)
        dk, dv = _dkdv_from_query_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                         stride_q_row, stride_do_row, m_mid_hi, m_hi, offs_n, len_q, len_kv,
                                         qk_scale_log2, window_left, window_right, chunk_size, key_end,
                                         HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                         TOP_LEFT, TREE, INPUT_PRECISION)
    store_rows(dK + row0_kv * stride_dk_row + kv_head * stride_dk_head, k_start, stride_dk_row, key_ok, dk * scale,
               HEAD_DIM, BLOCK_D, BLOCK_N)
    store_rows(dV + row0_kv * stride_dv_row + kv_head * stride_dv_head, k_start, stride_dv_row, key_ok, dv,
               HEAD_DIM_V, BLOCK_DV, BLOCK_N)


@triton.jit
def _dq_from_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_k_row, stride_v_row,
                        n_from, n_to, offs_m, len_q, len_kv, qk_scale_log2,
                        window_left, window_right, chunk_size, key_end,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr, TREE: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr):
    """Add the contributions of key blocks ``n_from, n_from + BLOCK_N, ... < n_to`` to dQ."""
    offs_n = tl.arange(0, BLOCK_N)
    for n_start in range(n_from, n_to, BLOCK_N):
        keys = n_start + offs_n
        key_ok = keys < len_kv  # unmasked blocks lie inside [0, len_kv): no row check there
        k = load_rows(k_base, n_start, stride_k_row, key_ok, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED)
        v = load_rows(v_base, n_start, stride_v_row, key_ok, HEAD_DIM_V, BLOCK_DV, BLOCK_N, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale_log2
        p = tl.math.exp2(s - lse_log2[:, None])
        if MASKED:
            ok = visible_tile(offs_m, keys, len_q, len_kv, window_left, window_right, chunk_size, key_end,
                              HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def bwd_dq_kernel(
    Q, K, V, dOut, Lse, Delta, dQ, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dq_row, stride_dq_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid // num_heads_q
    head = pid % num_heads_q
    seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi, len_q, len_kv, row0_q, row0_kv = tile_header(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    kv_head = head // group_size
    offs_m = q_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < len_q
    q = load_rows(Q + row0_q * stride_q_row + head * stride_q_head, q_start, stride_q_row, row_ok,
                  HEAD_DIM, BLOCK_D, BLOCK_M, True)
    do = load_rows(dOut + row0_q * stride_do_row + head * stride_do_head, q_start, stride_do_row, row_ok,
                   HEAD_DIM_V, BLOCK_DV, BLOCK_M, True)
    at = head.to(tl.int64) * stride_lse_head + row0_q + offs_m
    lse = tl.load(Lse + at, mask=row_ok, other=float("inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # no visible key: P = 0
    delta = tl.load(Delta + at, mask=row_ok, other=0.0)

    k_base = K + row0_kv * stride_k_row + kv_head * stride_k_head
    v_base = V + row0_kv * stride_v_row + kv_head * stride_v_head
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_from_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_k_row, stride_v_row,
                             n_lo, n_mid_lo, offs_m, len_q, len_kv, qk_scale_log2, window_left, window_right,
                             chunk_size, tiles, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                             HAS_CHUNK, TOP_LEFT, False, INPUT_PRECISION)
    dq = _dq_from_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_k_row, stride_v_row,
                             n_mid_lo, n_mid_hi, offs_m, len_q, len_kv, qk_scale_log2, window_left, window_right,
                             chunk_size, tiles, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                             HAS_CHUNK, TOP_LEFT, False, INPUT_PRECISION)
    dq = _dq_from_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_k_row, stride_v_row,
                             n_mid_hi, n_hi, offs_m, len_q, len_kv, qk_scale_log2, window_left, window_right,
                             chunk_size, tiles, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                             HAS_CHUNK, TOP_LEFT, False, INPUT_PRECISION)
    store_rows(dQ + row0_q * stride_dq_row + head * stride_dq_head, q_start, stride_dq_row, row_ok, dq * scale,
               HEAD_DIM, BLOCK_D, BLOCK_M)
