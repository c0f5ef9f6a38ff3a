"""Forward and dQ kernels of tree attention (`packattn.Tree`: a trie of sequences packed in DFS
pre-order). Key ``s`` is visible to queries ``s <= t < key_end[s]`` (``key_end`` =
`Tree.row_subtree_end`), so the visible keys of a query tile are a few intervals (its ancestors'
runs and its own node), not one range as in `varlen_fwd`.

Tables from `packattn.backends.triton_tree`:

* ``tiles``: ``int32 (num_query_tiles, 3)`` rows ``[q_start, first_interval, num_intervals]``,
  longest work first;
* ``intervals``: ``int32 (n, 3)`` rows ``[lo, hi, kind]`` in key rows, block aligned: ``kind`` 0 = no
  key visible (skipped), 1 = some pairs visible (element mask), 2 = every pair visible (no mask).

The inner loops are the varlen ones (`varlen_fwd._attend_key_blocks`,
`varlen_bwd._dq_from_key_blocks`, value head dim = ``HEAD_DIM``: trees take no MLA) with the tree mask; dK/dV uses `varlen_bwd.bwd_dkdv_kernel`
with ``TREE=True`` (the queries that see a key block form one contiguous range: its subtree).
"""

import triton
import triton.language as tl

from packattn.ops.varlen.bwd_triton import LOG2E, _dq_from_key_blocks
from packattn.ops.varlen.common_triton import finish_softmax, load_rows, store_rows
from packattn.ops.varlen.fwd_triton import _attend_key_blocks


@triton.jit
def _tile(tiles, num_heads_q, group_size):
    """This program's query head, kv head, and its tile row ``[q_start, first_interval, count]``."""
    pid = tl.program_id(0)
    tile = pid // num_heads_q
    head = pid % num_heads_q
    q_start = tl.load(tiles + tile * 3)
    first = tl.load(tiles + tile * 3 + 1)
    count = tl.load(tiles + tile * 3 + 2)
    return head, head // group_size, q_start, first, count


@triton.jit
def _interval(intervals, index):
    """Interval row ``[lo, hi, kind]``."""
    at = intervals + index * 3
    return tl.load(at), tl.load(at + 1), tl.load(at + 2)


@triton.jit
def tree_fwd_kernel(
    Q, K, V, Out, Lse, tiles, intervals, key_end,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_head,
    total, num_heads_q, group_size, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    head, kv_head, q_start, first, count = _tile(tiles, num_heads_q, group_size)
    offs_m = q_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < total
    q = load_rows(Q + head * stride_q_head, q_start, stride_q_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    k_base = K + kv_head * stride_k_head
    v_base = V + kv_head * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(count):
        lo, hi, kind = _interval(intervals, first + i)
        if kind == 1:
            acc, m_i, l_i = _attend_key_blocks(acc, m_i, l_i, q, k_base, v_base, stride_k_row, stride_v_row,
                                               lo, hi, offs_m, total, total, qk_scale_log2, 0, 0, 0, key_end,
                                               HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, BLOCK_N, True, False, False, False, False,
                                               True, INPUT_PRECISION)
        elif kind == 2:
            acc, m_i, l_i = _attend_key_blocks(acc, m_i, l_i, q, k_base, v_base, stride_k_row, stride_v_row,
                                               lo, hi, offs_m, total, total, qk_scale_log2, 0, 0, 0, key_end,
                                               HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, BLOCK_N, False, False, False, False, False,
                                               True, INPUT_PRECISION)
    out, lse = finish_softmax(acc, m_i, l_i)
    store_rows(Out + head * stride_o_head, q_start, stride_o_row, row_ok, out, HEAD_DIM, BLOCK_D, BLOCK_M)
    tl.store(Lse + head.to(tl.int64) * stride_lse_head + offs_m, lse, mask=row_ok)


@triton.jit
def tree_dq_kernel(
    Q, K, V, dOut, Lse, Delta, dQ, tiles, intervals, key_end,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dq_row, stride_dq_head, stride_lse_head,
    total, num_heads_q, group_size, qk_scale_log2, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    head, kv_head, q_start, first, count = _tile(tiles, num_heads_q, group_size)
    offs_m = q_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < total
    q = load_rows(Q + head * stride_q_head, q_start, stride_q_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    do = load_rows(dOut + head * stride_do_head, q_start, stride_do_row, row_ok, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    at_rows = head.to(tl.int64) * stride_lse_head + offs_m
    lse = tl.load(Lse + at_rows, mask=row_ok, other=float("inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(Delta + at_rows, mask=row_ok, other=0.0)
    k_base = K + kv_head * stride_k_head
    v_base = V + kv_head * stride_v_head
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(count):
        lo, hi, kind = _interval(intervals, first + i)
        if kind == 1:
            dq = _dq_from_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_k_row, stride_v_row,
                                     lo, hi, offs_m, total, total, qk_scale_log2, 0, 0, 0, key_end,
                                     HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, BLOCK_N, True, False, False, False, False, True,
                                     INPUT_PRECISION)
        elif kind == 2:
            dq = _dq_from_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_k_row, stride_v_row,
                                     lo, hi, offs_m, total, total, qk_scale_log2, 0, 0, 0, key_end,
                                     HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, BLOCK_N, False, False, False, False, False, True,
                                     INPUT_PRECISION)
    store_rows(dQ + head * stride_dq_head, q_start, stride_dq_row, row_ok, dq * scale, HEAD_DIM, BLOCK_D, BLOCK_M)
