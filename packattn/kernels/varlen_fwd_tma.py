"""Experimental: `packattn.kernels.varlen_fwd.varlen_fwd_kernel` with Q, K and V tiles loaded
through device-side TMA tensor descriptors (``tl.make_tensor_descriptor``) instead of pointer loads.

Same arguments, same semantics, same tile table (see `packattn.kernels.varlen_fwd`). Per program,
one descriptor per tensor is built in the kernel over the rows of its sequence and head::

    K: base = K + row0_kv * stride_k_row + kv_head * stride_k_head,
       shape = [len_kv, HEAD_DIM], strides = [stride_k_row, 1], block = [BLOCK_N, BLOCK_D]

(V likewise, Q with ``[len_q, HEAD_DIM]`` and ``[BLOCK_M, BLOCK_D]``). Rows past the sequence's real
length come back as zeros (TMA bounds check), so neither the next sequence's rows nor padding
rows are read; the element mask of the boundary blocks then handles them as in the pointer kernel.
The output is still stored with pointers (masked rows).

Restrictions, checked by the launcher (`packattn.backends.triton_varlen.varlen_fwd`), which
falls back to the pointer kernel otherwise: ``HEAD_DIM == BLOCK_D`` (head dims 32/64/128/256; the
descriptor block must cover the whole row), bases 16-byte aligned and row/head strides multiples of
16 bytes (true for contiguous THD tensors), a CUDA device (descriptors built on the device need a
global scratch buffer: ``triton.set_allocator``). Selected only with ``PACKATTN_TRITON_FWD=tma``.
"""

import triton
import triton.language as tl

from packattn.kernels.varlen_common import finish_softmax, online_softmax_step, store_rows, tile_header

@triton.jit
def _attend_key_blocks_tma(acc, m_i, l_i, q, k_desc, v_desc, n_from, n_to, offs_m, len_q, len_kv, qk_scale_log2,
                           window_left, window_right, chunk_size, BLOCK_N: tl.constexpr,
                           MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                           HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold key blocks starting at ``n_from, n_from + BLOCK_N, ... < n_to`` into the running softmax."""
    offs_n = tl.arange(0, BLOCK_N)
    for n_start in range(n_from, n_to, BLOCK_N):
        k = k_desc.load([n_start, 0])  # rows >= len_kv are zeros
        v = v_desc.load([n_start, 0])
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, offs_m, n_start + offs_n, len_q, len_kv, qk_scale_log2,
                                            window_left, window_right, chunk_size, MASKED, HAS_LEFT, HAS_RIGHT,
                                            HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def varlen_fwd_tma_kernel(
    Q, K, V, Out, Lse, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tl.static_assert(HEAD_DIM == BLOCK_D, "the TMA forward needs HEAD_DIM == BLOCK_D")
    pid = tl.program_id(0)
    tile = pid // num_heads_q  # heads vary fastest: the longest tiles of every head start first
    head = pid % num_heads_q
    seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi, len_q, len_kv, row0_q, row0_kv = tile_header(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    kv_head = head // group_size

    # descriptor extents >= 1 (a TMA dimension of 0 is not valid); with len_kv == 0 no key block
    # is loaded anyway (the tile table gives lo = hi = 0), and a tile exists only when len_q > 0
    q_desc = tl.make_tensor_descriptor(Q + row0_q * stride_q_row + head * stride_q_head,
                                       shape=[tl.maximum(len_q, 1), HEAD_DIM], strides=[stride_q_row, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K + row0_kv * stride_k_row + kv_head * stride_k_head,
                                       shape=[tl.maximum(len_kv, 1), HEAD_DIM], strides=[stride_k_row, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V + row0_kv * stride_v_row + kv_head * stride_v_head,
                                       shape=[tl.maximum(len_kv, 1), HEAD_DIM], strides=[stride_v_row, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])

    offs_m = q_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < len_q
    q = q_desc.load([q_start, 0])  # rows >= len_q are zeros

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # boundary blocks before the fully visible band, the band itself, boundary blocks after it
    acc, m_i, l_i = _attend_key_blocks_tma(acc, m_i, l_i, q, k_desc, v_desc, n_lo, n_mid_lo, offs_m, len_q, len_kv,
                                           qk_scale_log2, window_left, window_right, chunk_size, BLOCK_N,
                                           True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)
    acc, m_i, l_i = _attend_key_blocks_tma(acc, m_i, l_i, q, k_desc, v_desc, n_mid_lo, n_mid_hi, offs_m, len_q,
                                           len_kv, qk_scale_log2, window_left, window_right, chunk_size, BLOCK_N,
                                           False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)
    acc, m_i, l_i = _attend_key_blocks_tma(acc, m_i, l_i, q, k_desc, v_desc, n_mid_hi, n_hi, offs_m, len_q, len_kv,
                                           qk_scale_log2, window_left, window_right, chunk_size, BLOCK_N,
                                           True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, INPUT_PRECISION)

    out, lse = finish_softmax(acc, m_i, l_i)  # a row that saw no key: out = 0, lse = -inf
    store_rows(Out + row0_q * stride_o_row + head * stride_o_head, q_start, stride_o_row, row_ok, out,
               HEAD_DIM, BLOCK_D, BLOCK_M)
    tl.store(Lse + head.to(tl.int64) * stride_lse_head + row0_q + offs_m, lse, mask=row_ok)
