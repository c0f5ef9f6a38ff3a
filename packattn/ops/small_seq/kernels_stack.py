"""Small-sequence attention on tensor cores with the query rows of ``STACK`` items stacked into one tile
(configs with ``items > 1``); arguments, results and conventions those of
`packattn.ops.small_seq.kernels_mma`, one kv head a unit, whose unit pieces (`_fwd_probs`, `_fwd_out`,
`_bwd_scores`, `_bwd_store`) work on the stacked tiles as on one kv head's 2-D tiles.

A unit is ``STACK`` consecutive items and one kv head: its query tile holds ``BLOCK_G`` rows per item
(the item's query heads of that kv head, padded), ``STACK * BLOCK_G`` rows in all, its K/V tiles 16 key
rows per item, ``STACK * 16`` rows. Scores are one ``(rows, keys)`` dot under a block-diagonal mask (a
query row sees its own item's keys only), so every product of the unit is one dot: the backward's dK/dV
products reduce over the stacked rows (>= 16: `configs.block_g` pads an item's rows to ``16 / STACK``)
instead of padding one item's group to 16 rows, and at group 1 they are dots, not outer products. The
masked-out scores give P = 0 and dS = 0, so the off-diagonal blocks add nothing.

Row addresses are gathered per row (the item table loaded once per row of a tile); key rows past an
item's keys are not loaded (zeros) and their dK/dV rows are exact zeros.
"""

import triton
import triton.language as tl

from packattn.ops.small_seq.kernels_mma import (
    _bwd_scores,
    _bwd_store,
    _fwd_out,
    _fwd_probs,
    _unit_range,
)


@triton.jit
def _stack_unit(q_rows, kv_starts, kv_lens, unit, num_items, group, HEAD_BLOCKS: tl.constexpr,
                STACK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Where unit ``unit`` lives: ``(head, q_row, heads, g_ok, kv_row, s, kv_len, key_ok, col_ok)``;
    ``q_row`` / ``heads`` / ``g_ok``: per query row (``(rows, 1)``) its item's query row, its query head
    and whether it is real; ``kv_row`` / ``s`` / ``kv_len`` / ``key_ok``: per key row (``(keys, 1)``) its
    physical row, its index within the item, the item's key count (-1 past the last item) and whether it
    is a key; ``col_ok``: ``(rows, keys)``, the keys a query row sees."""
    item0 = (unit // HEAD_BLOCKS) * STACK
    head = unit % HEAD_BLOCKS
    r = tl.arange(0, STACK * BLOCK_G)
    j = tl.arange(0, STACK * BLOCK_S)
    r_item = item0 + r // BLOCK_G
    j_item = item0 + j // BLOCK_S
    g = r % BLOCK_G
    q_row = tl.load(q_rows + r_item, mask=r_item < num_items, other=-1).to(tl.int64)
    kv_len = tl.load(kv_lens + j_item, mask=j_item < num_items, other=-1)  # -1: no item
    kv_row = tl.load(kv_starts + j_item, mask=j_item < num_items, other=0).to(tl.int64) + (j % BLOCK_S)
    s = j % BLOCK_S
    g_ok = (q_row >= 0) & (g < group)
    key_ok = s < kv_len
    col_ok = g_ok[:, None] & key_ok[None, :] & ((r // BLOCK_G)[:, None] == (j // BLOCK_S)[None, :])
    heads = head * group + g
    q_row = tl.maximum(q_row, 0)
    return head, q_row[:, None], heads[:, None], g_ok[:, None], kv_row[:, None], s[:, None], kv_len[:, None], \
        key_ok[:, None], col_ok


@triton.jit
def _rows(base, row, stride_row, head, stride_head, offs_d):
    """Row addresses of ``base``: per tile row its physical row ``row`` and head ``head``."""
    return base + row * stride_row + head * stride_head + offs_d


@triton.jit
def small_seq_fwd_stack_kernel(
    Q, K, V, Out, Lse, q_rows, kv_starts, kv_lens,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_head, num_units, units, num_items, group, qk_scale_log2,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
    STACK: tl.constexpr, HEAD_BLOCKS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):
    first, last = _unit_range(num_units, units)
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    for unit in tl.range(first, last, num_stages=STAGES):
        head, q_row, heads, g_ok, kv_row, _, _, key_ok, col_ok = _stack_unit(
            q_rows, kv_starts, kv_lens, unit, num_items, group, HEAD_BLOCKS, STACK, BLOCK_G, BLOCK_S)
        q_ptrs = _rows(Q, q_row, stride_q_row, heads, stride_q_head, offs_d)
        k_ptrs = _rows(K, kv_row, stride_k_row, head, stride_k_head, offs_d)
        v_ptrs = _rows(V, kv_row, stride_v_row, head, stride_v_head, offs_d)
        p, m, denom, has_key, inv = _fwd_probs(q_ptrs, k_ptrs, g_ok, key_ok, col_ok, qk_scale_log2, STACK * BLOCK_G,
                                               STACK * BLOCK_S, BLOCK_D, D_CHUNKS, 1, PRECISION)
        o_ptrs = _rows(Out, q_row, stride_o_row, heads, stride_o_head, offs_d)
        _fwd_out(p, m, denom, has_key, inv, v_ptrs, key_ok, o_ptrs, g_ok, Lse, heads, q_row, stride_lse_head,
                 BLOCK_D, D_CHUNKS, PRECISION)


@triton.jit
def small_seq_bwd_stack_kernel(
    Q, K, V, dOut, dLse, dQ, dK, dV, q_rows, kv_starts, kv_lens,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dlse_head,
    stride_dq_row, stride_dq_head, stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head,
    num_units, units, num_items, group, scale, qk_scale_log2, kv_fill,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
    STACK: tl.constexpr, HEAD_BLOCKS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """As `kernels_mma.small_seq_bwd_mma_kernel`; an item's dK/dV rows ``[kv_len, kv_fill)`` are zeros."""
    first, last = _unit_range(num_units, units)
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    for unit in tl.range(first, last, num_stages=STAGES):
        head, q_row, heads, g_ok, kv_row, s_idx, kv_len, key_ok, col_ok = _stack_unit(
            q_rows, kv_starts, kv_lens, unit, num_items, group, HEAD_BLOCKS, STACK, BLOCK_G, BLOCK_S)
        q_ptrs = _rows(Q, q_row, stride_q_row, heads, stride_q_head, offs_d)
        do_ptrs = _rows(dOut, q_row, stride_do_row, heads, stride_do_head, offs_d)
        k_ptrs = _rows(K, kv_row, stride_k_row, head, stride_k_head, offs_d)
        v_ptrs = _rows(V, kv_row, stride_v_row, head, stride_v_head, offs_d)
        q, k, do, p, ds = _bwd_scores(q_ptrs, do_ptrs, k_ptrs, v_ptrs, g_ok, key_ok, col_ok,
                                      dLse, heads, q_row, stride_dlse_head, qk_scale_log2,
                                      STACK * BLOCK_G, STACK * BLOCK_S, BLOCK_D, D_CHUNKS, 1, PRECISION, HAS_DLSE)
        p_t = tl.trans(p).to(Q.dtype.element_ty)  # rounded once (`_kv_grad` rounds again per chunk: a no-op)
        ds_t = tl.trans(ds).to(Q.dtype.element_ty)
        ds = ds.to(Q.dtype.element_ty)
        # an item's rows past its keys hold exact zeros (P = 0 there); no rows of items past the last
        kv_rows = (kv_len >= 0) & (s_idx < tl.maximum(kv_len, kv_fill))
        dq_ptrs = _rows(dQ, q_row, stride_dq_row, heads, stride_dq_head, offs_d)
        dk_ptrs = _rows(dK, kv_row, stride_dk_row, head, stride_dk_head, offs_d)
        dv_ptrs = _rows(dV, kv_row, stride_dv_row, head, stride_dv_head, offs_d)
        _bwd_store(q, k, do, ds, ds_t, p_t, q_ptrs, k_ptrs, do_ptrs, g_ok, key_ok, dq_ptrs, dk_ptrs, dv_ptrs,
                   kv_rows, scale, STACK * BLOCK_G, BLOCK_D, D_CHUNKS, PRECISION)
