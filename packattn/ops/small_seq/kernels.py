"""Small-sequence cross-attention on CUDA cores: one query per item over at most ``BLOCK_S = 16``
keys. The tensor-core kernels (`packattn.ops.small_seq.kernels_mma`) are the default; these run where
`packattn.ops.small_seq.configs` names ``kernel="fma"``, with the same arguments and results.

One program per (item, kv head): it loads the item's K and V rows of that kv head once (``BLOCK_S``
rows, masked by the item's key count) and loops over the ``group = heads_q // heads_kv`` query heads
that read them (GQA/MQA), so K/V are never repeated and the loop keeps one query head in registers at a
time. K/V are held as float32 ``(BLOCK_S, BLOCK_D)`` tiles, so registers bound the occupancy (ptxas:
255 registers at head dim 256 with one warp).

Items are described by three int32 arrays (see `packattn.ops.small_seq.op`):
``q_rows[b]`` the physical row of the item's query (``-1``: the item has no query),
``kv_starts[b]`` the physical row of its first key, ``kv_lens[b]`` its number of keys (0..16).

Arithmetic: every product is a plain float32 multiply-add (inputs converted to float32; no
``tl.dot``). Softmax in base 2 with ``scale * log2(e)`` folded into the scores. A query with no key
gives ``out = 0`` and ``lse = -inf`` (never NaN).

The backward recomputes the softmax as the forward does (it loads q and K anyway)::

    P[h]  = softmax_s(scale Q[h] . K[s])
    dV[s] = sum_h P[h, s] dO[h]          dP[h, s] = dO[h] . V[s]
    dS    = P * (dP - rowsum(P * dP) + dlse)
    dQ[h] = scale * sum_s dS[h, s] K[s]   dK[s] = scale * sum_h dS[h, s] Q[h]

Every key row belongs to one item and every program owns its rows, so there are no atomics and
the backward is deterministic. Offsets are int64 (K of 30k items x 16 keys x 16 heads x 512 is
past 2**31 elements).
"""

import triton
import triton.language as tl

from packattn.ops.runtime import launch

LN2 = tl.constexpr(launch.LN2)  # a constexpr: used inside the kernels


@triton.jit
def _item(q_rows, kv_starts, kv_lens, item):
    """``(q_row, kv_start, kv_len)`` of ``item``, rows as int64."""
    q_row = tl.load(q_rows + item).to(tl.int64)
    kv_start = tl.load(kv_starts + item).to(tl.int64)
    kv_len = tl.load(kv_lens + item)
    return q_row, kv_start, kv_len


@triton.jit
def _load_keys(base, kv_start, stride_row, offs_s, offs_d, key_ok, HEAD_DIM: tl.constexpr):
    """``(BLOCK_S, BLOCK_D)`` float32 rows ``kv_start + offs_s`` (zeros where masked)."""
    ptrs = base + (kv_start + offs_s)[:, None] * stride_row + offs_d[None, :]
    ok = key_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def small_seq_fwd_kernel(
    Q, K, V, Out, Lse, q_rows, kv_starts, kv_lens,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_head, heads_kv, group, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    item = pid // heads_kv  # kv heads vary fastest: neighbouring programs read neighbouring bytes
    kv_head = pid % heads_kv
    q_row, kv_start, kv_len = _item(q_rows, kv_starts, kv_lens, item)
    if q_row < 0:
        return  # no query: nothing to write

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = offs_s < kv_len
    d_ok = offs_d < HEAD_DIM
    k = _load_keys(K + kv_head * stride_k_head, kv_start, stride_k_row, offs_s, offs_d, key_ok, HEAD_DIM)
    v = _load_keys(V + kv_head * stride_v_head, kv_start, stride_v_row, offs_s, offs_d, key_ok, HEAD_DIM)

    for h in range(group):
        head = kv_head * group + h
        q = tl.load(Q + q_row * stride_q_row + head * stride_q_head + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * qk_scale_log2  # (BLOCK_S,), base 2
        scores = tl.where(key_ok, scores, float("-inf"))
        m = tl.max(scores, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # no key: keep exp2 away from -inf - -inf
        p = tl.where(key_ok, tl.exp2(scores - m), 0.0)
        denom = tl.sum(p, axis=0)
        has_key = denom > 0.0
        p = p / tl.where(has_key, denom, 1.0)
        out = tl.sum(p[:, None] * v, axis=0)  # (BLOCK_D,)
        lse = tl.where(has_key, (m + tl.log2(tl.where(has_key, denom, 1.0))) * LN2, float("-inf"))
        tl.store(Out + q_row * stride_o_row + head * stride_o_head + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
        tl.store(Lse + head * stride_lse_head + q_row, lse)


@triton.jit
def small_seq_bwd_kernel(
    Q, K, V, dOut, dLse, dQ, dK, dV, q_rows, kv_starts, kv_lens,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_do_row, stride_do_head, stride_dlse_head,
    stride_dq_row, stride_dq_head, stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head,
    heads_kv, group, scale, qk_scale_log2, kv_fill,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """dQ for the item's query rows, dK/dV for its key rows. ``kv_fill``: dK/dV rows
    ``[kv_len, kv_fill)`` are written as zeros too (a dense batch's unused key slots; 0 = none).
    An item with no query writes zeros on its key rows."""
    pid = tl.program_id(0)
    item = pid // heads_kv
    kv_head = pid % heads_kv
    q_row, kv_start, kv_len = _item(q_rows, kv_starts, kv_lens, item)
    has_q = q_row >= 0
    q_row = tl.maximum(q_row, 0)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = offs_s < kv_len
    d_ok = offs_d < HEAD_DIM
    # (tl.where, not ``&``: Triton 3.9's interpreter turns a block mask & a scalar one into int32, which
    # tl.load refuses as a mask; compiled code is the same either way)
    q_ok = tl.where(has_q, d_ok, False)
    seen = tl.where(has_q, key_ok, False)
    k = _load_keys(K + kv_head * stride_k_head, kv_start, stride_k_row, offs_s, offs_d, key_ok, HEAD_DIM)
    v = _load_keys(V + kv_head * stride_v_head, kv_start, stride_v_row, offs_s, offs_d, key_ok, HEAD_DIM)
    dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)

    for h in range(group):
        head = kv_head * group + h
        q = tl.load(Q + q_row * stride_q_row + head * stride_q_head + offs_d, mask=q_ok, other=0.0).to(tl.float32)
        scores = tl.where(seen, tl.sum(k * q[None, :], axis=1) * qk_scale_log2, float("-inf"))
        m = tl.max(scores, axis=0)
        p = tl.exp2(scores - tl.where(m == float("-inf"), 0.0, m))
        denom = tl.sum(p, axis=0)
        p = p / tl.where(denom > 0.0, denom, 1.0)
        do = tl.load(dOut + q_row * stride_do_row + head * stride_do_head + offs_d, mask=q_ok, other=0.0)
        do = do.to(tl.float32)
        dv += p[:, None] * do[None, :]
        dp = tl.sum(v * do[None, :], axis=1)  # (BLOCK_S,)
        delta = tl.sum(p * dp, axis=0)
        if HAS_DLSE:
            delta -= tl.load(dLse + head * stride_dlse_head + q_row, mask=has_q, other=0.0)
        ds = tl.where(key_ok, p * (dp - delta), 0.0)
        dq = tl.sum(ds[:, None] * k, axis=0) * scale
        tl.store(dQ + q_row * stride_dq_row + head * stride_dq_head + offs_d, dq.to(dQ.dtype.element_ty), mask=q_ok)
        dk += ds[:, None] * q[None, :]

    # rows past the keys hold exact zeros (p = 0 there), written only where they are ours
    write = (offs_s < tl.maximum(kv_len, kv_fill))[:, None] & d_ok[None, :]
    dk_ptrs = dK + kv_head * stride_dk_head + (kv_start + offs_s)[:, None] * stride_dk_row + offs_d[None, :]
    dv_ptrs = dV + kv_head * stride_dv_head + (kv_start + offs_s)[:, None] * stride_dv_row + offs_d[None, :]
    tl.store(dk_ptrs, (dk * scale).to(dK.dtype.element_ty), mask=write)
    tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=write)
