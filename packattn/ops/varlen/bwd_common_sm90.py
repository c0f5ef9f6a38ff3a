"""Gluon helpers shared by the Hopper (sm_90a) backward kernels of the varlen and tree families.

Contract of every Gluon backward kernel (as `packattn.ops.varlen.bwd_triton`): tile-table rows ``[seq, start,
lo, mid_lo, mid_hi, hi]``, masks, GQA, ``lse`` float32 natural log with ``-inf`` for rows that see no key
(P = 0 there), ``delta`` from the preprocess (or computed, DELTA_FROM_O), outputs in the input dtype, only rows
inside a sequence written, no atomics (each output element is summed by one program in a fixed order:
deterministic). With ``P = exp2(S * scale * log2e - lse * log2e)``: ``dV = P^T dO``, ``dS = P * (dO V^T -
delta)``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.

Helpers: `_aligned_range_of_keys` (the per-key dual of `common_sm90._key_range`), `_row_vector` / `_lse_log2` (lse /
delta of a row block from one 64-bit scalar base plus 32-bit offsets: a vector of 64-bit pointers would double
their registers at the register peak), `_store_tile` (store through a free operand buffer, 16 B per thread),
`_probs` (``P = exp2(S c - lse log2e)`` of a key block under the varlen masks), `_query_bounds` (per key, the
queries that see it: the varlen masks or the tree's ``key_end``, for the dK/dV kernel).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from packattn.ops.runtime import launch
from packattn.ops.runtime.gluon_compat import thread_barrier
from packattn.ops.varlen.common_sm90 import _aligned_shift, _visible, row_store_layout

LOG2E = gl.constexpr(launch.LOG2E)


@gluon.jit
def _aligned_range_of_keys(offs_k, len_kv, window_left, window_right, chunk_size,
                           HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr):
    """The dual of `common_sm90._key_range`: key ``k`` (``0 <= k < len_kv``) is visible to the
    queries aligned at ``a`` in ``[a_lo(k), a_hi(k))``, because ``k < a + right + 1 <=> a >= k - right``,
    ``k >= a - left <=> a < k + left + 1`` and, for a chunk ``c``, ``S(a) <= k < S(a) + c <=> a in
    [floor(k / c) * c, floor(k / c) * c + c)`` (``k >= 0``, so ``a < 0`` never qualifies, as there).
    Per key, not per query: a handful of registers per thread in the transposed tiles, where the
    per-query form costs two full vectors and a division per query."""
    a_lo = offs_k * 0 - (1 << 30)
    a_hi = offs_k * 0 + (1 << 30)
    if HAS_RIGHT:
        a_lo = gl.maximum(a_lo, offs_k - window_right)
    if HAS_LEFT:
        a_hi = gl.minimum(a_hi, offs_k + window_left + 1)
    if HAS_CHUNK:
        chunk_start = (gl.maximum(offs_k, 0) // chunk_size) * chunk_size
        a_lo = gl.maximum(a_lo, chunk_start)
        a_hi = gl.minimum(a_hi, chunk_start + chunk_size)
    a_hi = gl.where(offs_k < len_kv, a_hi, a_lo)  # keys past the sequence see no query
    return a_lo, a_hi


@gluon.jit
def _row_vector(X, head, stride_head, row0_q, first, len_q, BLOCK: gl.constexpr, layout: gl.constexpr,
                other: gl.constexpr):
    """``X[head, row0_q + first + i]`` for ``i < BLOCK`` (float32 ``(heads_q, rows)``: lse or delta) in
    ``layout``, ``other`` past ``len_q``. One 64-bit scalar base plus 32-bit offsets: a vector of
    64-bit pointers would cost twice the registers, and these vectors are live at the register peak."""
    base = X + (head.to(gl.int64) * stride_head + row0_q.to(gl.int64) + first)
    offs = gl.arange(0, BLOCK, layout=layout)
    return gl.load(base + offs, mask=offs < len_q - first, other=other)


@gluon.jit
def _lse_log2(Lse, head, stride_lse_head, row0_q, first, len_q, BLOCK: gl.constexpr, layout: gl.constexpr):
    """``lse * log2e`` of `_row_vector`; a row that sees no key (lse = -inf) and a row past ``len_q``
    get ``+inf``, so that P = exp2(. - inf) = 0 there, as in `varlen_bwd`."""
    lse = _row_vector(Lse, head, stride_lse_head, row0_q, first, len_q, BLOCK, layout, float("inf"))
    return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@gluon.jit
def _store_tile(acc, stage, base, first_row, end_row, stride_row, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                num_warps: gl.constexpr):
    """Store rows ``first_row + i < end_row`` of ``acc`` (cast to the input dtype) to
    ``base[row * stride_row + d]``, through the shared buffer ``stage`` (an operand buffer nobody
    reads any more) so each thread writes 16 contiguous bytes."""
    thread_barrier()  # every warp group is done with ``stage``
    stage.store(acc.to(stage.dtype))
    thread_barrier()
    layout: gl.constexpr = row_store_layout(num_warps, HEAD_DIM)
    vals = stage.load(layout)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows.to(gl.int64)[:, None] * stride_row + cols[None, :]
    gl.store(ptrs, vals, mask=(rows < end_row)[:, None])


@gluon.jit
def _store_direct(acc, base, first_row, end_row, stride_row, ROWS: gl.constexpr, COLS: gl.constexpr,
                  layout: gl.constexpr):
    """Store rows ``first_row + i < end_row`` of ``acc`` (layout ``layout``, cast to ``base``'s type) to
    ``base[row * stride_row + c]`` straight from registers (no staging buffer: for a kernel whose shared
    operand buffers may still be read by another warp group)."""
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows.to(gl.int64)[:, None] * stride_row + cols[None, :]
    gl.store(ptrs, acc.to(base.dtype.element_ty), mask=(rows < end_row)[:, None])


@gluon.jit
def _probs(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left,
           window_right, chunk_size, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, HAS_LEFT: gl.constexpr,
           HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr):
    """``P = exp2(S c - lse log2e)`` of key block ``n_start``; masked outside ``[mid_lo, mid_hi)``."""
    p = gl.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if (n_start < n_mid_lo) | (n_start >= n_mid_hi):
        keys = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = _visible(offs_m, keys, len_q, len_kv, window_left, window_right, chunk_size,
                      HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
        p = gl.where(ok, p, 0.0)
    return p


@gluon.jit
def _query_range_of_keys(offs_k, len_q, len_kv, window_left, window_right, chunk_size, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr):
    """Queries ``q`` in ``[q_lo(k), q_hi(k))`` see key ``k``: the visibility of `_aligned_range_of_keys` solved for
    ``q`` once per consumer (``aligned = q + shift`` with ``shift = 0`` top-left, ``len_kv - len_q``
    bottom-right; ``q < len_q``), so that a masked block compares its query positions with two
    per-key bounds: no per-block key arithmetic, no loop-invariant per-query vectors for LLVM to
    hoist (each costs 16 registers across the loop)."""
    a_lo, a_hi = _aligned_range_of_keys(offs_k, len_kv, window_left, window_right, chunk_size, HAS_LEFT, HAS_RIGHT,
                                        HAS_CHUNK)
    shift = _aligned_shift(len_q, len_kv, TOP_LEFT)
    return a_lo - shift, gl.minimum(a_hi - shift, len_q)


@gluon.jit
def _query_range_of_tree_keys(offs_k, KeyEnd, len_q, len_kv):
    """The tree mask's `_query_range_of_keys` (`packattn.ops.tree.kernels_triton`): key ``k`` is visible to the
    queries ``[k, key_end[k])`` (``KeyEnd``: int32 `Tree.row_subtree_end`, indexed by position in the
    tree, which is one sequence), clipped to ``len_q``; a key at or past ``len_kv`` gets ``q_hi = 0
    <= q_lo`` (no query). One load per key, once per consumer: the loop compares with the two bounds
    as for the other masks."""
    ends = gl.load(KeyEnd + offs_k, mask=offs_k < len_kv, other=0)
    return offs_k, gl.minimum(ends, len_q)


@gluon.jit
def _query_bounds(offs_k, KeyEnd, len_q, len_kv, window_left, window_right, chunk_size, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, TREE: gl.constexpr):
    """``(q_lo, q_hi)`` per key: `_query_range_of_tree_keys` with ``TREE``, else `_query_range_of_keys`."""
    if TREE:
        q_lo, q_hi = _query_range_of_tree_keys(offs_k, KeyEnd, len_q, len_kv)
    else:
        q_lo, q_hi = _query_range_of_keys(offs_k, len_q, len_kv, window_left, window_right, chunk_size, HAS_LEFT,
                                          HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
    return q_lo, q_hi
