"""Warp-specialised dK/dV backward for Hopper (sm_90a) at head dims in column parts (96 = 64 + 32, 192 = 128 + 64)
and with a value head dim of its own (MLA: 192/128, 128/64): `varlen_bwd_dkdv_parts_kernel` (the dK/dV tables run
d = 192 on the key-split kernel, `packattn.ops.varlen.bwd_dkdv_sm90_ksplit`).

The contract, partitions, ring, barriers, tail rendezvous, masks (``TREE`` included) and schedule are those of
`packattn.ops.varlen.bwd_dkdv_sm90` (module docstring); the tensors are held in column parts
(`packattn.ops.varlen.bwd_parts_sm90`): K, Q in parts of ``HEAD_DIM``, V, dO in parts of ``HEAD_DIM_V``.

Step ``it`` of one consumer (enters and leaves with no wgmma in flight)::

    wait   ready[slot]; tail step only: zero the Q / dO rows past len_q (as there, per part)
    issue  S^T = K_hi Q_hi^T (+ K_lo Q_lo^T)        (1-2 async groups chained on one accumulator)
    issue  dP^T = V_hi dO_hi^T (+ V_lo dO_lo^T)     (NDP = 1-2 groups)
    wait   until NDP pending                        (S^T done; dP^T runs under P^T)
    P^T = exp2(S^T c - lse log2e), masked
    issue  dV_part += P^T dO_part for each value part   (NV groups)
    wait   until NV pending                         (dP^T done; dV runs under dS^T)
    dS^T = P^T (dP^T - delta); issue dK_part += dS^T Q_part for each q/k part; wait 0; arrive empty

Accumulators: one per column part of the consumer's 64 keys' dK and dV; the ``lo`` part of a dim that has none
(d_v = 128 of MLA 192/128) is a 1-register placeholder that no wgmma touches.

The outputs are stored from registers (`bwd_common_sm90._store_direct`), per part at its columns.
Shared memory (contract with `packattn.ops.varlen.launch_sm90_bwd_parts.dkdv_parts_shared_bytes`): K (d) and
V (d_v) of the tile, the ring of (Q, dO) slots, lse / delta per slot, the query-position tables, the mbarriers.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from packattn.ops.varlen.bwd_common_sm90 import LOG2E, _query_bounds, _store_direct
from packattn.ops.varlen.bwd_dkdv_sm90 import _fill_cols, _probs_t_ws, _small_buffers
from packattn.ops.varlen.bwd_dkdv_sm90_load import _dkdv_tile
from packattn.ops.varlen.bwd_parts_sm90 import (
    _alloc_parts,
    _dkdv_parts_producer,
    part_lo,
)
from packattn.ops.varlen.bwd_ws_sm90 import _zero_tails, ws_partitions
from packattn.ops.varlen.common_sm90 import _to_operand, mma_layout
from packattn.ops.varlen.common_sm90_ws import _opaque_program_id
from packattn.ops.varlen.fwd_sm90_parts import part_hi

WG_KEYS = gl.constexpr(64)  # keys per consumer warp group


@gluon.constexpr_function
def groups(*flags):
    """How many async wgmma groups the true ``flags`` issue (a wait's pending count)."""
    return sum(int(bool(f)) for f in flags)


@gluon.jit
def _placeholder():
    """An accumulator of a column part the dim lacks: one float32 per thread, never touched by a wgmma."""
    return gl.zeros([128], gl.float32, gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _new_acc(OWN: gl.constexpr, WIDTH: gl.constexpr):
    """A zero ``[64, WIDTH]`` wgmma accumulator where ``OWN``, else `_placeholder`."""
    if OWN:
        acc = gl.zeros([WG_KEYS, WIDTH], gl.float32, mma_layout(4, WIDTH))
    else:
        acc = _placeholder()
    return acc


@gluon.jit
def _chain_t(a_hi, a_lo, b_hi, b_lo, zero, LO: gl.constexpr):
    """``A_hi B_hi^T (+ A_lo B_lo^T)``: 1 or 2 async wgmma groups on one accumulator; returns the last token."""
    tok = warpgroup_mma(a_hi, b_hi.permute((1, 0)), zero, use_acc=False, is_async=True)
    if LO > 0:
        tok = warpgroup_mma(a_lo, b_lo.permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _into_parts(x, dtype: gl.constexpr, b_hi, b_lo, acc_hi, acc_lo, OWN_HI: gl.constexpr, OWN_LO: gl.constexpr):
    """Issue ``acc_hi += x B_hi`` (``OWN_HI``) and ``acc_lo += x B_lo`` (``OWN_LO``) as async groups, ``x`` (float32,
    S^T layout) cast to ``dtype`` and laid out as each accumulator's A operand; returns the two tokens."""
    if OWN_HI:
        acc_hi = warpgroup_mma(_to_operand(x, dtype, mma_layout(4, b_hi.shape[1])), b_hi, acc_hi, is_async=True)
    if OWN_LO:
        acc_lo = warpgroup_mma(_to_operand(x, dtype, mma_layout(4, b_lo.shape[1])), b_lo, acc_lo, is_async=True)
    return acc_hi, acc_lo


@gluon.jit
def _dkdv_parts_step(it, m_start, accs, ntail, k_wg, k_lo_wg, v_wg, v_lo_wg, cols, q_hi, q_lo, do_hi, do_lo, stats,
                     ready, empty, zero_bar, m_mid_lo, m_mid_hi, q_lo_b, q_hi_b, len_q, qk_scale_log2,
                     s_layout: gl.constexpr, WG: gl.constexpr, BLOCK_M: gl.constexpr, D_LO: gl.constexpr,
                     DV_LO: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Step ``it`` of one consumer (module docstring); ``accs = (dk_hi, dk_lo, dv_hi, dv_lo)``. Returns ``(accs,
    ntail)`` with no wgmma in flight."""
    dk_hi, dk_lo, dv_hi, dv_lo = accs
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    qh, ql, dh, dl = q_hi.index(slot), q_lo.index(slot), do_hi.index(slot), do_lo.index(slot)
    stat = stats.index(slot)
    if m_start + BLOCK_M > len_q:  # rows past the sequence: zeros, not NaN, enter dK / dV
        ntail = _zero_tails(qh, ql, dh, dl, m_start, len_q, ntail, zero_bar, BLOCK_M, D_LO, DV_LO, WG, CONSUMERS)
    s_zero = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, s_layout)
    s_tok = _chain_t(k_wg, k_lo_wg, qh, ql, s_zero, D_LO)
    dp_tok = _chain_t(v_wg, v_lo_wg, dh, dl, s_zero, DV_LO)
    lse = stat.slice(0, BLOCK_M).load(gl.SliceLayout(0, s_layout))
    lse_log2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    s_t = warpgroup_mma_wait(groups(True, DV_LO > 0), deps=(s_tok, ))
    p_t = _probs_t_ws(s_t, lse_log2, q_lo_b, q_hi_b, m_start, m_mid_lo, m_mid_hi, qk_scale_log2, cols, BLOCK_M,
                      s_layout)
    dv_hi, dv_lo = _into_parts(p_t, k_wg.dtype, dh, dl, dv_hi, dv_lo, True, DV_LO > 0)
    dp_t = warpgroup_mma_wait(groups(True, DV_LO > 0), deps=(dp_tok, ))
    delta = stat.slice(BLOCK_M, BLOCK_M).load(gl.SliceLayout(0, s_layout))
    ds_t = p_t * (dp_t - delta[None, :])
    dk_hi, dk_lo = _into_parts(ds_t, k_wg.dtype, qh, ql, dk_hi, dk_lo, True, D_LO > 0)
    dk_hi, dk_lo, dv_hi, dv_lo = warpgroup_mma_wait(0, deps=(dk_hi, dk_lo, dv_hi, dv_lo))
    mbarrier.arrive(empty.index(slot), count=1)
    return (dk_hi, dk_lo, dv_hi, dv_lo), ntail


@gluon.jit
def _dkdv_parts_loop(accs, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, KeyEnd,
                     qk_scale_log2, window_left, window_right, chunk_size, k_wg, k_lo_wg, v_wg, v_lo_wg, cols, q_hi,
                     q_lo, do_hi, do_lo, stats, kv_bar, ready, empty, zero_bar, s_layout: gl.constexpr,
                     WG: gl.constexpr, BLOCK_M: gl.constexpr, D_LO: gl.constexpr, DV_LO: gl.constexpr,
                     STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr,
                     TOP_LEFT: gl.constexpr, TREE: gl.constexpr, CONSUMERS: gl.constexpr):
    """The ``total > 0`` steps of the program's tile (`bwd_dkdv_sm90._consume_tile` with parts); returns ``accs``."""
    offs_k = k_start + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, s_layout))
    q_lo_b, q_hi_b = _query_bounds(offs_k, KeyEnd, len_q, len_kv, window_left, window_right, chunk_size, HAS_LEFT,
                                   HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE)
    _fill_cols(cols, BLOCK_M)
    m_end = m_lo + num_m_blocks * BLOCK_M
    m_start = m_lo
    ntail = m_lo * 0
    mbarrier.wait(kv_bar, 0)
    for it in range(0, total):
        accs, ntail = _dkdv_parts_step(it, m_start, accs, ntail, k_wg, k_lo_wg, v_wg, v_lo_wg, cols, q_hi, q_lo,
                                       do_hi, do_lo, stats, ready, empty, zero_bar, m_mid_lo, m_mid_hi, q_lo_b,
                                       q_hi_b, len_q, qk_scale_log2, s_layout, WG, BLOCK_M, D_LO, DV_LO, STAGES,
                                       CONSUMERS)
        m_start += BLOCK_M
        if m_start == m_end:
            m_start = m_lo
    return accs


@gluon.jit
def _store_part(acc, base, col0: gl.constexpr, first_key, len_kv, stride_row, scale, OWN: gl.constexpr):
    """Store an owned ``[64, W]`` accumulator times ``scale`` at columns ``col0 ...`` of rows ``first_key + i <
    len_kv`` of ``base`` (the sequence's first row, the kv head's first column)."""
    if OWN:
        W: gl.constexpr = acc.shape[1]
        _store_direct(acc * scale, base + col0, first_key, len_kv, stride_row, WG_KEYS, W, mma_layout(4, W))


@gluon.jit
def _dkdv_parts_consumer(dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd,
                         stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head, num_heads_kv, group_size,
                         heads_per_section, qk_scale_log2, scale, window_left, window_right, chunk_size, k_hi, k_lo,
                         v_hi, v_lo, col_smem, q_hi, q_lo, do_hi, do_lo, stats, kv_bar, ready, empty, zero_bar,
                         HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr,
                         TOP_LEFT: gl.constexpr, TREE: gl.constexpr, CONSUMERS: gl.constexpr, WG: gl.constexpr):
    """Consumer warp group ``WG``: keys ``[64 WG, 64 WG + 64)`` of the tile, their dK / dV in column parts."""
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    DV_HI: gl.constexpr = part_hi(HEAD_DIM_V)
    DV_LO: gl.constexpr = part_lo(HEAD_DIM_V)
    KEY0: gl.constexpr = WG * WG_KEYS
    s_layout: gl.constexpr = mma_layout(4, BLOCK_M)
    accs = (_new_acc(True, D_HI), _new_acc(D_LO > 0, D_LO), _new_acc(True, DV_HI), _new_acc(DV_LO > 0, DV_LO))
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, gl.program_id(0),
                   gl.num_programs(0), num_heads_kv, group_size, heads_per_section, BLOCK_M)
    if total > 0:
        accs = _dkdv_parts_loop(accs, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, KeyEnd,
                                qk_scale_log2, window_left, window_right, chunk_size,
                                k_hi.slice(KEY0, WG_KEYS, dim=0), k_lo.slice(KEY0, WG_KEYS, dim=0),
                                v_hi.slice(KEY0, WG_KEYS, dim=0), v_lo.slice(KEY0, WG_KEYS, dim=0),
                                col_smem.index(WG), q_hi, q_lo, do_hi, do_lo, stats, kv_bar, ready, empty, zero_bar,
                                s_layout, WG, BLOCK_M, D_LO, DV_LO, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT,
                                TREE, CONSUMERS)
    dk_hi, dk_lo, dv_hi, dv_lo = accs
    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                   _opaque_program_id(num_heads_kv), gl.num_programs(0), num_heads_kv, group_size, heads_per_section,
                   BLOCK_M)
    if seq >= 0:
        row0 = row0_kv.to(gl.int64)
        base_v = dV + row0 * stride_dv_row + kv_head.to(gl.int64) * stride_dv_head
        base_k = dK + row0 * stride_dk_row + kv_head.to(gl.int64) * stride_dk_head
        first_key = k_start + KEY0
        _store_part(dv_hi, base_v, 0, first_key, len_kv, stride_dv_row, 1.0, True)
        _store_part(dv_lo, base_v, DV_HI, first_key, len_kv, stride_dv_row, 1.0, DV_LO > 0)
        _store_part(dk_hi, base_k, 0, first_key, len_kv, stride_dk_row, scale, True)
        _store_part(dk_lo, base_k, D_HI, first_key, len_kv, stride_dk_row, scale, D_LO > 0)


_partitions = ws_partitions(_dkdv_parts_consumer, _dkdv_parts_producer)


# ---------------------------------------------------------------- kernel
@gluon.jit
def varlen_bwd_dkdv_parts_kernel(
    q_desc, k_desc, v_desc, do_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, Lse, Delta, dK, dV, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd,
    stride_dk_row, stride_dk_head, stride_dv_row, stride_dv_head, stride_lse_head,
    num_heads_kv, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size, heads_per_section,
    num_work,
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr,
    TOP_LEFT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    TREE: gl.constexpr = False,
):
    """`bwd_dkdv_sm90.varlen_bwd_dkdv_gluon_ws_kernel` with column parts (module docstring). Descriptors from
    `launch_sm90.part_descriptors`: ``q_desc`` / ``q_lo_desc`` blocks ``[BLOCK_M, hi]`` / ``[BLOCK_M, lo]`` of
    ``HEAD_DIM``, ``do_*`` of ``HEAD_DIM_V``, ``k_*`` / ``v_*`` with ``BLOCK_N`` rows; a ``lo`` descriptor is None
    where its dim has one part."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((BLOCK_N == WG_KEYS) | (BLOCK_N == 2 * WG_KEYS), "one or two consumer warp groups of 64 keys")
    gl.static_assert((BLOCK_M == 32) | (BLOCK_M == 64), "query block: 32 or 64 rows")
    gl.static_assert(STAGES >= 2, "ring of at least two (Q, dO) slots")
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    DV_HI: gl.constexpr = part_hi(HEAD_DIM_V)
    DV_LO: gl.constexpr = part_lo(HEAD_DIM_V)
    CONSUMERS: gl.constexpr = BLOCK_N // WG_KEYS
    k_hi, k_lo = _alloc_parts(k_desc, k_lo_desc, 0, BLOCK_N, D_HI, D_LO)
    v_hi, v_lo = _alloc_parts(v_desc, v_lo_desc, 0, BLOCK_N, DV_HI, DV_LO)
    q_hi, q_lo = _alloc_parts(q_desc, q_lo_desc, STAGES, BLOCK_M, D_HI, D_LO)
    do_hi, do_lo = _alloc_parts(do_desc, do_lo_desc, STAGES, BLOCK_M, DV_HI, DV_LO)
    col_smem, stats, kv_bar, zero_bar, ready, empty = _small_buffers(STAGES, BLOCK_M, CONSUMERS)
    _partitions((dK, dV, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, KeyEnd, stride_dk_row,
                 stride_dk_head, stride_dv_row, stride_dv_head, num_heads_kv, group_size, heads_per_section,
                 qk_scale_log2, scale, window_left, window_right, chunk_size, k_hi, k_lo, v_hi, v_lo, col_smem, q_hi,
                 q_lo, do_hi, do_lo, stats, kv_bar, ready, empty, zero_bar, HEAD_DIM, HEAD_DIM_V, BLOCK_M, STAGES,
                 HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, TREE, CONSUMERS),
                (q_desc, k_desc, v_desc, do_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, Lse, Delta, tiles,
                 cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_lse_head, num_heads_kv, group_size,
                 heads_per_section, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi, do_lo, stats, kv_bar, ready, empty,
                 HEAD_DIM, HEAD_DIM_V, BLOCK_M, STAGES),
                CONSUMERS, CONSUMER_REGS, PRODUCER_REGS)
