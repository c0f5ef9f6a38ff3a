"""dK/dV from stored probabilities: the second pass of the STORED backward for short causal batches.

The dQ pass (`varlen_bwd.bwd_dq_kernel` or the one-consumer Gluon dQ, both with ``STORE_PDS``) already
computes, for every (query block, key block) pair it visits, the probabilities ``P`` and the score
gradients ``dS = P * (dP - delta)`` of 64 x 64 elements. With ``STORE_PDS`` it writes them, in the input
dtype (the precision the dK/dV products use anyway), to a scratch buffer, so that the dK/dV pass is two
products per pair, ``dV += P^T dO`` and ``dK += dS^T Q``, instead of four (no recomputed ``S^T`` and
``dP^T``, no lse / delta, no element mask: the mask is in the stored ``P``). Host side, and when the
backward takes this path: `packattn.backends.triton_stored`.

Scratch layout (``PdS``, contiguous, input dtype): ``[2, heads_q, pairs, 64, 64]``, half 0 ``P`` and
half 1 ``dS``, each pair tile row-major ``[query, key]``. The pairs of one sequence of ``T = cdiv(len,
64)`` blocks are the causal lower triangle of its blocks, row by row: query block ``i``, key block ``j
<= i`` is pair ``pair_base[seq] + i (i + 1) / 2 + j`` (`pair_tile`), ``pair_base`` the exclusive prefix
sum of ``T (T + 1) / 2`` over the sequences. Only causal self-attention (equal query and key lengths,
no window, no chunks) visits exactly these pairs, in the dQ pass (key blocks ``0 .. i``) and here
(query blocks ``j .. T - 1``); the host allows nothing else.

Rows past ``len_q`` and columns past ``len_kv`` of a stored tile are whatever the dQ pass computed
there (possibly NaN from padding rows): they are masked to zero on load, and Q / dO rows past
``len_q`` are loaded as zeros, so they add nothing. Deterministic: each dK / dV row is written by one
program that sums its pairs in a fixed order.
"""

import triton
import triton.language as tl

from packattn.kernels.varlen_common import load_rows, store_rows, tile_header

PAIR = tl.constexpr(64)  # rows and columns of a stored pair tile


@triton.jit
def pair_tile(pair_base, seq, q_block, k_block):
    """Index (per head) of the stored tile of query block ``q_block`` and key block ``k_block <= q_block``
    of sequence ``seq`` (module docstring)."""
    return tl.load(pair_base + seq).to(tl.int64) + q_block * (q_block + 1) // 2 + k_block


@triton.jit
def _dkdv_from_stored_pairs(dk, dv, q_base, do_base, p_pairs, ds_pairs, pair_base, seq, k_block, m_from, m_to, stride_q_row,
                            stride_do_row, key_ok, len_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Add the pairs of query blocks ``m_from, m_from + 64, ... < m_to`` (``p_pairs`` / ``ds_pairs``: this
    head's stored ``P`` / ``dS`` tiles)."""
    offs = tl.arange(0, PAIR)
    in_tile = offs[:, None] * PAIR + offs[None, :]
    for m_start in range(m_from, m_to, PAIR):
        row_ok = (m_start + offs) < len_q
        q = load_rows(q_base, m_start, stride_q_row, row_ok, HEAD_DIM, BLOCK_D, PAIR, MASKED)
        do = load_rows(do_base, m_start, stride_do_row, row_ok, HEAD_DIM, BLOCK_D, PAIR, MASKED)
        at = pair_tile(pair_base, seq, m_start // PAIR, k_block) * (PAIR * PAIR) + in_tile
        if MASKED:
            ok = row_ok[:, None] & key_ok[None, :]
            p = tl.load(p_pairs + at, mask=ok, other=0.0)
            ds = tl.load(ds_pairs + at, mask=ok, other=0.0)
        else:
            p = tl.load(p_pairs + at)
            ds = tl.load(ds_pairs + at)
        dv += tl.dot(tl.trans(p), do, input_precision=INPUT_PRECISION)
        dk += tl.dot(tl.trans(ds), q, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def bwd_dkdv_stored_kernel(
    Q, dOut, P, dS, dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, pair_base,
    stride_q_row, stride_q_head, stride_do_row, stride_do_head, stride_dk_row, stride_dk_head, stride_dv_row,
    stride_dv_head, num_pairs, num_tiles, group_size, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One program per (key tile of 64 keys, kv head), kv head major (the programs running together share
    one head's Q / dO in L2); ``tiles``: ``tile_table(seqs, mask, True, 64, 64)`` rows. ``P`` / ``dS``: the
    two halves of the scratch (module docstring), ``num_pairs`` tiles per head each."""
    pid = tl.program_id(0)
    kv_head = pid // num_tiles
    tile = pid % num_tiles
    seq, k_start, m_lo, _mid_lo, _mid_hi, m_hi, len_q, len_kv, row0_q, row0_kv = tile_header(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    if seq < 0:
        return
    offs_n = k_start + tl.arange(0, PAIR)
    key_ok = offs_n < len_kv
    k_block = k_start // PAIR
    # blocks with every row inside the sequence, and a full key tile: no mask
    m_full = tl.where(k_start + PAIR <= len_kv, m_lo + tl.maximum(tl.minimum(m_hi, len_q) - m_lo, 0) // PAIR * PAIR,
                      m_lo)
    dk = tl.zeros([PAIR, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([PAIR, BLOCK_D], dtype=tl.float32)
    for g in range(group_size):  # fixed order over the query heads sharing this kv head
        head = kv_head * group_size + g
        q_base = Q + row0_q * stride_q_row + head * stride_q_head
        do_base = dOut + row0_q * stride_do_row + head * stride_do_head
        head_at = head.to(tl.int64) * num_pairs * (PAIR * PAIR)
        dk, dv = _dkdv_from_stored_pairs(dk, dv, q_base, do_base, P + head_at, dS + head_at, pair_base, seq, k_block, m_lo, m_full,
                                         stride_q_row, stride_do_row, key_ok, len_q, HEAD_DIM, BLOCK_D, False,
                                         INPUT_PRECISION)
        dk, dv = _dkdv_from_stored_pairs(dk, dv, q_base, do_base, P + head_at, dS + head_at, pair_base, seq, k_block, m_full, m_hi,
                                         stride_q_row, stride_do_row, key_ok, len_q, HEAD_DIM, BLOCK_D, True,
                                         INPUT_PRECISION)
    store_rows(dK + row0_kv * stride_dk_row + kv_head * stride_dk_head, k_start, stride_dk_row, key_ok, dk * scale,
               HEAD_DIM, BLOCK_D, PAIR)
    store_rows(dV + row0_kv * stride_dv_row + kv_head * stride_dv_head, k_start, stride_dv_row, key_ok, dv,
               HEAD_DIM, BLOCK_D, PAIR)
