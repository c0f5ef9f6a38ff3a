"""Forward flash attention over packed (THD) sequences.

One program per (query tile, query head). A query tile is one row of the launcher's tile table
(``int32 (num_tiles, 6)``, see `packattn.ops.varlen.tiles`)::

    [seq, q_start, lo, mid_lo, mid_hi, hi]

``seq < 0`` marks a surplus tile (the grid is sized by a host bound): the program exits. Keys
``[lo, hi)`` of sequence ``seq`` are the only ones any query of the tile may see
(`packattn.mask.block_key_range`); blocks ``[mid_lo, mid_hi)`` (``BLOCK_N`` steps from ``lo``)
lie inside the range every query of the tile sees and skip the element mask, the blocks before
and after them apply it. Rows are physical: sequence ``seq`` starts at ``row_offsets_q[seq]``
(``cu_seqlens_q_padded`` when there is padding between sequences, else ``cu_seqlens_q``), its
real length is ``cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]``.

Online softmax in base 2: scores are multiplied once by ``scale * log2(e)`` and ``exp2`` is used;
accumulation in float32. Writes ``out`` (input dtype) and ``lse`` (float32, natural log,
``(heads_q, rows)``). A row that sees no key writes ``out = 0`` and ``lse = -inf``.
GQA/MQA: query head ``h`` reads kv head ``h // group_size``; K/V are never repeated. Q and K have head dim
``HEAD_DIM`` (tiles ``BLOCK_D`` wide), V and ``out`` ``HEAD_DIM_V`` (``BLOCK_DV``): MLA when they differ.
"""

import triton
import triton.language as tl

from packattn.ops.varlen.common_triton import finish_softmax, load_rows, online_softmax_step, store_rows, tile_header

@triton.jit
def _attend_key_blocks(acc, m_i, l_i, q, k_base, v_base, stride_k_row, stride_v_row,
                       n_from, n_to, offs_m, len_q, len_kv, qk_scale_log2,
                       window_left, window_right, chunk_size, key_end,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr, TREE: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr):
    """Fold key blocks starting at ``n_from, n_from + BLOCK_N, ... < n_to`` into the running softmax."""
    offs_n = tl.arange(0, BLOCK_N)
    for n_start in range(n_from, n_to, BLOCK_N):
        keys = n_start + offs_n
        key_ok = keys < len_kv  # unmasked blocks lie inside [0, len_kv): no row check there
        k = load_rows(k_base, n_start, stride_k_row, key_ok, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED)
        v = load_rows(v_base, n_start, stride_v_row, key_ok, HEAD_DIM_V, BLOCK_DV, BLOCK_N, MASKED)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, offs_m, keys, len_q, len_kv, qk_scale_log2,
                                            window_left, window_right, chunk_size, key_end, MASKED, HAS_LEFT,
                                            HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE, INPUT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def varlen_fwd_kernel(
    Q, K, V, Out, Lse, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid // num_heads_q  # heads vary fastest: the longest tiles of every head start first
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

    k_base = K + row0_kv * stride_k_row + kv_head * stride_k_head
    v_base = V + row0_kv * stride_v_row + kv_head * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # boundary blocks before the fully visible band, the band itself, boundary blocks after it
    acc, m_i, l_i = _attend_key_blocks(acc, m_i, l_i, q, k_base, v_base, stride_k_row, stride_v_row,
                                       n_lo, n_mid_lo, offs_m, len_q, len_kv, qk_scale_log2,
                                       window_left, window_right, chunk_size, tiles, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
                                       True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, False, INPUT_PRECISION)
    acc, m_i, l_i = _attend_key_blocks(acc, m_i, l_i, q, k_base, v_base, stride_k_row, stride_v_row,
                                       n_mid_lo, n_mid_hi, offs_m, len_q, len_kv, qk_scale_log2,
                                       window_left, window_right, chunk_size, tiles, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
                                       False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, False, INPUT_PRECISION)
    acc, m_i, l_i = _attend_key_blocks(acc, m_i, l_i, q, k_base, v_base, stride_k_row, stride_v_row,
                                       n_mid_hi, n_hi, offs_m, len_q, len_kv, qk_scale_log2,
                                       window_left, window_right, chunk_size, tiles, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
                                       True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, False, INPUT_PRECISION)

    out, lse = finish_softmax(acc, m_i, l_i)  # a row that saw no key: out = 0, lse = -inf
    store_rows(Out + row0_q * stride_o_row + head * stride_o_head, q_start, stride_o_row, row_ok, out,
               HEAD_DIM_V, BLOCK_DV, BLOCK_M)
    tl.store(Lse + head.to(tl.int64) * stride_lse_head + row0_q + offs_m, lse, mask=row_ok)
