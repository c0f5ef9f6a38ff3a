"""Small-sequence attention on tensor cores: one query per item over at most ``BLOCK_S = 16`` keys.

Memory-bound: every byte of q, k, v, out (backward: q, k, v, dout in, dq, dk, dv out) moves once,
and the kernels keep enough of them in flight per SM.

* A *unit* is one item and ``BLOCK_H`` of its kv heads (all of their ``group`` query heads): K/V
  rows are read once per unit, whatever the GQA group, and each key row of a kv head belongs to
  exactly one unit, so dK/dV are plain stores (no atomics; the backward is deterministic).
* A program runs ``units`` consecutive units in a ``tl.range`` loop with ``num_stages=STAGES``:
  Triton's pipeliner copies the next units' Q/K/V (and dO) tiles into shared memory
  (``cp.async``) while the current one computes, so bytes in flight do not cost registers.
* Scores and products are ``tl.dot``: QK^T and dO V^T are ``(group, 16)`` tiles, the group
  padded to ``BLOCK_G`` rows, a power of two (the backward pads a group > 1 to >= 16 rows: the
  dK/dV products reduce over it, and a dot's reduction is >= 16 long; one row: outer products).
  Inputs stay in their dtype (bf16/fp16 on tensor cores, fp32 accumulation); P and dS are
  rounded to the input dtype before their products, as in FlashAttention. fp32 inputs use
  ``input_precision="ieee"`` (exact fp32 products).
* The head dim is cut into ``D_CHUNKS`` chunks of ``BLOCK_D`` columns: each chunk's tiles are
  their own loads and dots, so the dot operands and accumulators in registers are those of one
  chunk (head dim 512 in registers would spill). The backward loads a chunk's q, k, dout tiles again
  for its gradient products (L2 hits); with one chunk it keeps them.
* ``BLOCK_H == 1``: 2-D tiles, warps split the dots' columns. ``BLOCK_H > 1``: 3-D tiles with the
  kv heads as the dots' batch, one warp per kv head (launch with ``num_warps == BLOCK_H``).

The backward recomputes P from q and k as the forward does (it reads q and k anyway, so P costs
no bytes; a saved P would be 64 bytes written and read per query head, and P from lse loses bits at
large scores)::

    P = softmax(scale q K^T)   dP = dO V^T   delta = rowsum(P * dP) - dlse   dS = P (dP - delta)
    dQ = scale dS K            dK = scale dS^T Q                         dV = P^T dO

A query with no key gives ``out = 0`` and ``lse = -inf`` (never NaN); an item with no query
reads no keys and writes zero dK/dV on its key rows. Row offsets are int64 (scalars), offsets
within a unit's rows int32.

The work on a unit's tiles is shared with `packattn.ops.small_seq.kernels_stack`: a kernel finds its unit
(`_unit`) and computes its row addresses, and `_fwd_probs` / `_fwd_out` (forward), `_bwd_scores` /
`_bwd_store` (backward) do the rest. Each address is computed between those pieces where it is first
used (an address computed ahead of them changes the generated code).
"""

import triton
import triton.language as tl

from packattn.ops.runtime import launch

LN2 = tl.constexpr(launch.LN2)


@triton.jit
def _offsets(BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Index tiles ``(head, group row, key row, key column, head-dim column)``, broadcastable to the
    ``(BLOCK_H, rows, columns)`` tiles (no head axis when ``BLOCK_H == 1``)."""
    if BLOCK_H == 1:
        offs_h = 0
        offs_g = tl.arange(0, BLOCK_G)[:, None]
        offs_s = tl.arange(0, BLOCK_S)[:, None]
        offs_c = tl.arange(0, BLOCK_S)[None, :]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
    else:
        offs_h = tl.arange(0, BLOCK_H)[:, None, None]
        offs_g = tl.arange(0, BLOCK_G)[None, :, None]
        offs_s = tl.arange(0, BLOCK_S)[None, :, None]
        offs_c = tl.arange(0, BLOCK_S)[None, None, :]
        offs_d = tl.arange(0, BLOCK_D)[None, None, :]
    return offs_h, offs_g, offs_s, offs_c, offs_d


@triton.jit
def _zeros(BLOCK_H: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    if BLOCK_H == 1:
        return tl.zeros([M, N], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_H, M, N], dtype=tl.float32)


@triton.jit
def _t(x, BLOCK_H: tl.constexpr):
    """``x`` with its last two axes swapped."""
    if BLOCK_H == 1:
        return tl.trans(x)
    else:
        return tl.permute(x, (0, 2, 1))


@triton.jit
def _unit_range(num_units, units):
    """``(first, last)``: this program's units, ``units`` consecutive ones (fewer in the last program)."""
    first = tl.program_id(0) * units
    return first, tl.minimum(first + units, num_units)


@triton.jit
def _unit(q_rows, kv_starts, kv_lens, unit, heads_kv, group, offs_h, offs_g, offs_s, offs_c,
          BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr):
    """Where unit ``unit`` lives: ``(head0, q_row, kv_start, kv_len, heads, g_ok, key_ok, col_ok, h_ok)``;
    ``head0``: its first kv head; ``heads``: its query heads; ``g_ok``: real query heads of an item with
    a query; ``key_ok`` / ``col_ok``: its keys as rows / columns; ``h_ok``: real kv heads (whether or not
    the item has a query). ``HEAD_BLOCKS``: units per item (a constexpr: no integer division at run time)."""
    item = unit // HEAD_BLOCKS
    head0 = (unit % HEAD_BLOCKS) * BLOCK_H
    q_row = tl.load(q_rows + item).to(tl.int64)
    kv_start = tl.load(kv_starts + item).to(tl.int64)
    kv_len = tl.load(kv_lens + item)
    has_q = q_row >= 0
    q_row = tl.maximum(q_row, 0)
    h_ok = head0 + offs_h < heads_kv
    seen = h_ok & has_q
    heads = (head0 + offs_h) * group + offs_g
    # tl.where, not `seen & tile`: with BLOCK_H == 1 `seen` is a scalar, and Triton's interpreter makes scalar &
    # tensor an integer mask, which its masked loads refuse from Triton 3.7 on
    g_ok = tl.where(seen, offs_g < group, False)
    key_ok = tl.where(seen, offs_s < kv_len, False)
    col_ok = tl.where(seen, offs_c < kv_len, False)
    return head0, q_row, kv_start, kv_len, heads, g_ok, key_ok, col_ok, h_ok


@triton.jit
def _q_ptrs(base, q_row, head0, group, stride_row, stride_head, offs_h, offs_g, offs_d):
    """The unit's query-head rows of ``base``: a scalar 64-bit row address plus int32 offsets within the
    row that do not change from unit to unit (hoisted out of the loop)."""
    return (base + q_row * stride_row) + (((head0 + offs_h) * group + offs_g) * stride_head + offs_d)


@triton.jit
def _kv_ptrs(base, kv_start, head0, stride_row, stride_head, offs_h, offs_s, offs_d):
    """The unit's key rows of ``base``, as `_q_ptrs`."""
    return (base + kv_start * stride_row) + ((head0 + offs_h) * stride_head + offs_s * stride_row + offs_d)


@triton.jit
def _chunk(ptrs, c: tl.constexpr, ok, BLOCK_D: tl.constexpr):
    """Head-dim chunk ``c`` of the rows ``ptrs`` (zeros where not ``ok``)."""
    return tl.load(ptrs + c * BLOCK_D, mask=ok, other=0.0)


@triton.jit
def _dot_chunk(a_ptrs, a_ok, b_ptrs, b_ok, acc, c: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
               PRECISION: tl.constexpr):
    """``(a, b, acc + a b^T)`` with ``a`` / ``b`` head-dim chunk ``c`` of the rows ``a_ptrs`` / ``b_ptrs``."""
    a = _chunk(a_ptrs, c, a_ok, BLOCK_D)
    b = _chunk(b_ptrs, c, b_ok, BLOCK_D)
    return a, b, tl.dot(a, _t(b, BLOCK_H), acc, input_precision=PRECISION)


@triton.jit
def _softmax(s, ok, qk_scale_log2):
    """``(P, m, denom)``: the unnormalised softmax of the scores ``s`` (unscaled) over the keys ``ok``,
    its base-2 row maximum and row sum (0 where a row has no key: P = 0 there)."""
    s = tl.where(ok, s * qk_scale_log2, float("-inf"))
    m = tl.max(s, axis=-1, keep_dims=True)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key: keep exp2 away from -inf - -inf
    p = tl.exp2(s - m)
    return p, m, tl.sum(p, axis=-1, keep_dims=True)


@triton.jit
def _fwd_probs(q_ptrs, k_ptrs, g_ok, key_ok, col_ok, qk_scale_log2, ROWS: tl.constexpr, KEYS: tl.constexpr,
               BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """The forward's softmax of one unit from its row addresses and masks (`_unit` / `kernels_stack._stack_unit`):
    ``(P, m, denom, has_key, 1 / denom)`` over the ``(ROWS, KEYS)`` scores (per kv head when ``BLOCK_H > 1``);
    P unnormalised in the inputs' dtype, denom 1 where a row has no key."""
    s = _zeros(BLOCK_H, ROWS, KEYS)
    for c in tl.static_range(D_CHUNKS):
        _, _, s = _dot_chunk(q_ptrs, g_ok, k_ptrs, key_ok, s, c, BLOCK_D, BLOCK_H, PRECISION)
    p, m, denom = _softmax(s, col_ok, qk_scale_log2)
    has_key = denom > 0.0
    denom = tl.where(has_key, denom, 1.0)
    inv = 1.0 / denom
    return p.to(k_ptrs.dtype.element_ty), m, denom, has_key, inv


@triton.jit
def _fwd_out(p, m, denom, has_key, inv, v_ptrs, key_ok, o_ptrs, g_ok, Lse, heads, q_row, stride_lse_head,
             BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, PRECISION: tl.constexpr):
    """Out (``P V / denom``, chunk by chunk) and lse of one unit from `_fwd_probs`; lse -inf without keys."""
    for c in tl.static_range(D_CHUNKS):
        v = _chunk(v_ptrs, c, key_ok, BLOCK_D)
        out = tl.dot(p, v, input_precision=PRECISION) * inv
        tl.store(o_ptrs + c * BLOCK_D, out.to(o_ptrs.dtype.element_ty), mask=g_ok)
    lse = tl.where(has_key, (m + tl.log2(denom)) * LN2, float("-inf"))
    tl.store(Lse + heads * stride_lse_head + q_row, lse, mask=g_ok)


@triton.jit
def small_seq_fwd_mma_kernel(
    Q, K, V, Out, Lse, q_rows, kv_starts, kv_lens,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_head, num_units, units, heads_kv, group, qk_scale_log2,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):
    first, last = _unit_range(num_units, units)
    offs_h, offs_g, offs_s, offs_c, offs_d = _offsets(BLOCK_H, BLOCK_G, BLOCK_S, BLOCK_D)
    for unit in tl.range(first, last, num_stages=STAGES):
        head0, q_row, kv_start, _, heads, g_ok, key_ok, col_ok, _ = _unit(
            q_rows, kv_starts, kv_lens, unit, heads_kv, group, offs_h, offs_g, offs_s, offs_c, BLOCK_H, HEAD_BLOCKS)
        q_ptrs = _q_ptrs(Q, q_row, head0, group, stride_q_row, stride_q_head, offs_h, offs_g, offs_d)
        k_ptrs = _kv_ptrs(K, kv_start, head0, stride_k_row, stride_k_head, offs_h, offs_s, offs_d)
        v_ptrs = _kv_ptrs(V, kv_start, head0, stride_v_row, stride_v_head, offs_h, offs_s, offs_d)
        p, m, denom, has_key, inv = _fwd_probs(q_ptrs, k_ptrs, g_ok, key_ok, col_ok, qk_scale_log2, BLOCK_G, BLOCK_S,
                                               BLOCK_D, D_CHUNKS, BLOCK_H, PRECISION)
        o_ptrs = _q_ptrs(Out, q_row, head0, group, stride_o_row, stride_o_head, offs_h, offs_g, offs_d)
        _fwd_out(p, m, denom, has_key, inv, v_ptrs, key_ok, o_ptrs, g_ok, Lse, heads, q_row, stride_lse_head,
                 BLOCK_D, D_CHUNKS, PRECISION)


@triton.jit
def _kv_grad(a_t, x, PRECISION: tl.constexpr, ROWS: tl.constexpr):
    """``a_t (.., keys, ROWS) @ x (.., ROWS, BLOCK_D)`` in float32: a dot (``a_t`` rounded to x's dtype), or
    with one query row per kv head an outer product (a dot reduces over >= 16 rows)."""
    if ROWS == 1:
        return a_t * x.to(tl.float32)
    else:
        return tl.dot(a_t.to(x.dtype), x, input_precision=PRECISION)


@triton.jit
def _bwd_scores(q_ptrs, do_ptrs, k_ptrs, v_ptrs, g_ok, key_ok, col_ok, dLse, heads, q_row, stride_dlse_head,
                qk_scale_log2, ROWS: tl.constexpr, KEYS: tl.constexpr, BLOCK_D: tl.constexpr,
                D_CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``(q, k, dout, P, dS)`` of one unit, as `_fwd_probs` (q, k, dout: the last chunk's tiles): P from the
    scores recomputed the forward's way (from the row maximum, not from lse: at large scores ``s - lse``
    loses bits), dS from ``dP = dO V^T`` and the gradient into lse (``HAS_DLSE``: ``dLse``, as ``Lse``)."""
    s = _zeros(BLOCK_H, ROWS, KEYS)
    dp = _zeros(BLOCK_H, ROWS, KEYS)
    for c in tl.static_range(D_CHUNKS):
        q, k, s = _dot_chunk(q_ptrs, g_ok, k_ptrs, key_ok, s, c, BLOCK_D, BLOCK_H, PRECISION)
        do, _, dp = _dot_chunk(do_ptrs, g_ok, v_ptrs, key_ok, dp, c, BLOCK_D, BLOCK_H, PRECISION)
    p, _, denom = _softmax(s, col_ok & g_ok, qk_scale_log2)
    p = p / tl.where(denom > 0.0, denom, 1.0)
    delta = tl.sum(p * dp, axis=-1, keep_dims=True)
    if HAS_DLSE:
        delta -= tl.load(dLse + heads * stride_dlse_head + q_row, mask=g_ok, other=0.0)
    return q, k, do, p, p * (dp - delta)


@triton.jit
def _bwd_store(q, k, do, ds, ds_t, p_t, q_ptrs, k_ptrs, do_ptrs, g_ok, key_ok, dq_ptrs, dk_ptrs, dv_ptrs, kv_rows,
               scale, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, PRECISION: tl.constexpr):
    """dQ (``ds`` in the inputs' dtype), dK and dV (`_kv_grad` over the ``ROWS`` query rows; ``ds_t`` / ``p_t``
    transposed) of one unit, chunk by chunk; dK/dV on the key rows ``kv_rows``. q, k, dout: `_bwd_scores`'
    tiles, used as they are with one chunk."""
    for c in tl.static_range(D_CHUNKS):
        if D_CHUNKS > 1:  # loaded again (L2 hits): a chunk's tiles die with its dots
            q = _chunk(q_ptrs, c, g_ok, BLOCK_D)
            k = _chunk(k_ptrs, c, key_ok, BLOCK_D)
            do = _chunk(do_ptrs, c, g_ok, BLOCK_D)
        dq = tl.dot(ds, k, input_precision=PRECISION) * scale
        tl.store(dq_ptrs + c * BLOCK_D, dq.to(dq_ptrs.dtype.element_ty), mask=g_ok)
        dk = _kv_grad(ds_t, q, PRECISION, ROWS) * scale
        tl.store(dk_ptrs + c * BLOCK_D, dk.to(dk_ptrs.dtype.element_ty), mask=kv_rows)
        dv = _kv_grad(p_t, do, PRECISION, ROWS)
        tl.store(dv_ptrs + c * BLOCK_D, dv.to(dv_ptrs.dtype.element_ty), mask=kv_rows)


@triton.jit
def small_seq_bwd_mma_kernel(
    Q, K, V, dOut, dLse, dQ, dK, dV, q_rows, kv_starts, kv_lens,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dlse_head,
    stride_dq_row, stride_dq_head, stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head,
    num_units, units, heads_kv, group, scale, qk_scale_log2, kv_fill,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """dQ of the unit's query heads, dK/dV of its key rows. ``kv_fill``: dK/dV rows ``[kv_len,
    kv_fill)`` are written as zeros too (a dense batch's unused key slots; 0 = none)."""
    first, last = _unit_range(num_units, units)
    offs_h, offs_g, offs_s, offs_c, offs_d = _offsets(BLOCK_H, BLOCK_G, BLOCK_S, BLOCK_D)
    for unit in tl.range(first, last, num_stages=STAGES):
        head0, q_row, kv_start, kv_len, heads, g_ok, key_ok, col_ok, h_ok = _unit(
            q_rows, kv_starts, kv_lens, unit, heads_kv, group, offs_h, offs_g, offs_s, offs_c, BLOCK_H, HEAD_BLOCKS)
        q_ptrs = _q_ptrs(Q, q_row, head0, group, stride_q_row, stride_q_head, offs_h, offs_g, offs_d)
        do_ptrs = _q_ptrs(dOut, q_row, head0, group, stride_do_row, stride_do_head, offs_h, offs_g, offs_d)
        k_ptrs = _kv_ptrs(K, kv_start, head0, stride_k_row, stride_k_head, offs_h, offs_s, offs_d)
        v_ptrs = _kv_ptrs(V, kv_start, head0, stride_v_row, stride_v_head, offs_h, offs_s, offs_d)
        q, k, do, p, ds = _bwd_scores(q_ptrs, do_ptrs, k_ptrs, v_ptrs, g_ok, key_ok, col_ok,
                                      dLse, heads, q_row, stride_dlse_head, qk_scale_log2,
                                      BLOCK_G, BLOCK_S, BLOCK_D, D_CHUNKS, BLOCK_H, PRECISION, HAS_DLSE)
        p_t = _t(p, BLOCK_H)
        ds_t = _t(ds, BLOCK_H)
        ds = ds.to(Q.dtype.element_ty)
        # rows past the keys hold exact zeros (P = 0 there), written only where they are ours
        kv_rows = tl.where(h_ok, offs_s < tl.maximum(kv_len, kv_fill), False)  # (see `_unit`)
        dq_ptrs = _q_ptrs(dQ, q_row, head0, group, stride_dq_row, stride_dq_head, offs_h, offs_g, offs_d)
        dk_ptrs = _kv_ptrs(dK, kv_start, head0, stride_dk_row, stride_dk_head, offs_h, offs_s, offs_d)
        dv_ptrs = _kv_ptrs(dV, kv_start, head0, stride_dv_row, stride_dv_head, offs_h, offs_s, offs_d)
        _bwd_store(q, k, do, ds, ds_t, p_t, q_ptrs, k_ptrs, do_ptrs, g_ok, key_ok, dq_ptrs, dk_ptrs, dv_ptrs,
                   kv_rows, scale, BLOCK_G, BLOCK_D, D_CHUNKS, PRECISION)
