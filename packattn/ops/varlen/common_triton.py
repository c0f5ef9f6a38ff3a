"""Helpers shared by the varlen kernels: tile loads, and the in-kernel twin of
`packattn.mask.key_range` (its formulas must stay identical to mask.py).

A query aligned at key position ``a`` (``a = i + offset``, offset ``len_kv - len_q`` for
bottom-right alignment, 0 for top-left) sees keys ``[lo, hi)``::

    lo = 0,       hi = len_kv
    right >= 0:   hi = min(hi, a + right + 1)      (causal is right == 0)
    left  >= 0:   lo = max(lo, a - left)
    chunk c:      S = floor(a / c) * c;  lo = max(lo, S);  hi = min(hi, S + c)

One deliberate difference in *form*, not in result: Triton's integer ``//`` truncates toward zero
on GPU, so ``floor(a / c)`` is only evaluated for ``a >= 0``; for ``a < 0`` we use ``S = -c``.
Both give ``hi <= 0 <= lo`` there (nothing visible), exactly as mask.py does.
"""

import triton
import triton.language as tl

from packattn.ops.runtime import launch

LN2 = tl.constexpr(launch.LN2)


@triton.jit
def aligned_offset(len_q, len_kv, TOP_LEFT: tl.constexpr):
    """``a(i) = i + aligned_offset``: bottom-right ``len_kv - len_q``, top-left 0."""
    off = len_kv - len_q
    if TOP_LEFT:
        off = off * 0
    return off


@triton.jit
def key_range(aligned, len_kv, window_left, window_right, chunk_size,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Visible keys ``[lo, hi)`` of queries aligned at ``aligned`` (a block of int32)."""
    lo = aligned * 0
    hi = lo + len_kv
    if HAS_RIGHT:
        hi = tl.minimum(hi, aligned + window_right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, aligned - window_left)
    if HAS_CHUNK:
        chunk_start = tl.where(aligned < 0, -chunk_size, (tl.maximum(aligned, 0) // chunk_size) * chunk_size)
        lo = tl.maximum(lo, chunk_start)
        hi = tl.minimum(hi, chunk_start + chunk_size)
    return lo, hi


@triton.jit
def visible_tile(offs_q, offs_k, len_q, len_kv, window_left, window_right, chunk_size, key_end,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                 TOP_LEFT: tl.constexpr, TREE: tl.constexpr):
    """``(len(offs_q), len(offs_k))`` booleans: query ``offs_q[i]`` sees key ``offs_k[j]``
    (positions within the sequence; queries past ``len_q`` and keys past ``len_kv`` see nothing).

    ``TREE``: the sequence is a packed trie (`packattn.Tree`): key ``s`` is visible to queries
    ``s <= t < key_end[s]`` (``key_end`` = `Tree.row_subtree_end`, the end of the key's subtree);
    the window/chunk arguments are then unused."""
    if TREE:
        ends = tl.load(key_end + offs_k, mask=offs_k < len_kv, other=0)
        ok = (offs_k[None, :] <= offs_q[:, None]) & (offs_q[:, None] < ends[None, :])
    else:
        aligned = offs_q + aligned_offset(len_q, len_kv, TOP_LEFT)
        lo, hi = key_range(aligned, len_kv, window_left, window_right, chunk_size, HAS_LEFT, HAS_RIGHT, HAS_CHUNK)
        ok = (offs_k[None, :] >= lo[:, None]) & (offs_k[None, :] < hi[:, None])
    return ok & (offs_q < len_q)[:, None]


@triton.jit
def visible_tile_keys_by_queries(offs_k, offs_q, len_q, len_kv, window_left, window_right, chunk_size, key_end,
                                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                                 TOP_LEFT: tl.constexpr, TREE: tl.constexpr):
    """`visible_tile` transposed: ``(len(offs_k), len(offs_q))``, for kernels that hold keys as rows."""
    if TREE:
        ends = tl.load(key_end + offs_k, mask=offs_k < len_kv, other=0)
        ok = (offs_k[:, None] <= offs_q[None, :]) & (offs_q[None, :] < ends[:, None])
    else:
        aligned = offs_q + aligned_offset(len_q, len_kv, TOP_LEFT)
        lo, hi = key_range(aligned, len_kv, window_left, window_right, chunk_size, HAS_LEFT, HAS_RIGHT, HAS_CHUNK)
        ok = (offs_k[:, None] >= lo[None, :]) & (offs_k[:, None] < hi[None, :])
    return ok & (offs_q < len_q)[None, :]


@triton.jit
def _tile_pointers(base, first_row, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pointers to rows ``first_row ...`` of a row-major tile: one 64-bit base per tile, 32-bit
    offsets inside it (fewer registers than 64-bit offsets per element)."""
    rows = tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    return base + tl.cast(first_row, tl.int64) * stride_row + (rows[:, None] * stride_row + offs_d[None, :])


@triton.jit
def load_rows(base, first_row, stride_row, row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_ROWS: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The ``(BLOCK_ROWS, BLOCK_D)`` tile of rows ``first_row + i`` (``base[row * stride_row + d]``), zero
    past ``HEAD_DIM`` and, when ``CHECK_ROWS``, where ``row_ok`` is False. Unchecked full-width tiles
    load without a mask."""
    ptrs = _tile_pointers(base, first_row, stride_row, BLOCK_ROWS, BLOCK_D)
    d_ok = tl.arange(0, BLOCK_D) < HEAD_DIM
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tile


@triton.jit
def store_rows(base, first_row, stride_row, row_ok, tile, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_ROWS: tl.constexpr):
    """Store ``tile`` (cast to the element type of ``base``) to the rows of `load_rows` where ``row_ok``."""
    ptrs = _tile_pointers(base, first_row, stride_row, BLOCK_ROWS, BLOCK_D)
    mask = row_ok[:, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def online_softmax_step(acc, m_i, l_i, q, k, v, offs_m, keys, len_q, len_kv, qk_scale_log2,
                        window_left, window_right, chunk_size, key_end, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                        HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, TOP_LEFT: tl.constexpr,
                        TREE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold one key block (``k``, ``v`` at positions ``keys``) into the running base-2 softmax of the
    forward kernels; the element mask is applied only when ``MASKED``."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if MASKED:
        ok = visible_tile(offs_m, keys, len_q, len_kv, window_left, window_right, chunk_size, key_end,
                          HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
        s = tl.where(ok, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no key yet keep m = -inf: subtract 0 instead (p = 0, no NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        # every score is finite and the scale is >= 0 (the launcher flips q for a negative one), so
        # max(s) * scale is the scaled row max and the tile needs one fused multiply-add per score
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
        m_sub = m_new
        p = tl.math.exp2(s * qk_scale_log2 - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def finish_softmax(acc, m_i, l_i):
    """``(out, lse)`` from the running state; a row that saw no key gives ``out = 0``, ``lse = -inf``
    (natural log)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    return acc / l_safe[:, None], lse


@triton.jit
def tile_header(tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv):
    """Sequence geometry of one tile-table row ``[seq, start, lo, mid_lo, mid_hi, hi]`` (``seq < 0``:
    a surplus tile; the other values are then in bounds but meaningless)."""
    seq = tl.load(tiles + tile * 6)
    start = tl.load(tiles + tile * 6 + 1)
    lo = tl.load(tiles + tile * 6 + 2)
    mid_lo = tl.load(tiles + tile * 6 + 3)
    mid_hi = tl.load(tiles + tile * 6 + 4)
    hi = tl.load(tiles + tile * 6 + 5)
    seq_c = tl.maximum(seq, 0)
    len_q = tl.load(cu_seqlens_q + seq_c + 1) - tl.load(cu_seqlens_q + seq_c)
    len_kv = tl.load(cu_seqlens_kv + seq_c + 1) - tl.load(cu_seqlens_kv + seq_c)
    row0_q = tl.load(row_offsets_q + seq_c).to(tl.int64)
    row0_kv = tl.load(row_offsets_kv + seq_c).to(tl.int64)
    return seq, start, lo, mid_lo, mid_hi, hi, len_q, len_kv, row0_q, row0_kv
