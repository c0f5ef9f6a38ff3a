"""The load side of the warp-specialised dK/dV kernel (`packattn.ops.varlen.bwd_dkdv_sm90`, whose module
docstring describes the partitions and barriers): the work-item decode every partition shares (`_dkdv_tile`)
and the 1-warp producer partition (K / V of the tile by TMA onto ``kv_bar``; per ring step Q and dO by TMA and
the queries' lse / delta by cp.async into the slot, all tracked by the slot's ``ready``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from packattn.ops.runtime.gluon_compat import cp_async_load, tma_load
from packattn.ops.varlen.common_sm90 import _tile_row
from packattn.ops.varlen.common_sm90_ws import _section_order


@gluon.jit
def _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, w, num_items, num_heads_kv,
               group_size, heads_per_section, BLOCK_M: gl.constexpr):
    """Decode work item ``w`` of ``num_items`` (key tile, kv head) (`_section_order`: sections of
    ``heads_per_section`` kv heads, heads fastest inside a section; ``w`` the program id and
    ``num_items`` the grid). Every partition calls it, so all agree on
    ``total`` (0 for an unused row, ``seq < 0``)."""
    tile, kv_head = _section_order(w, heads_per_section, num_items // num_heads_kv * heads_per_section)
    seq, k_start, m_lo, m_mid_lo, m_mid_hi, m_hi, len_q, len_kv, row0_q, row0_kv = _tile_row(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    num_m_blocks = (m_hi - m_lo + BLOCK_M - 1) // BLOCK_M
    total = gl.where(seq >= 0, group_size * num_m_blocks, 0)
    return (seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q,
            row0_kv)


# ---------------------------------------------------------------- producer
@gluon.jit
def _stats_copy(lse_row, delta_row, stride_lse_head, g, m_start, len_q, buf, BLOCK_M: gl.constexpr):
    """cp.async ``lse`` (``buf[:BLOCK_M]``) and ``delta`` (``buf[BLOCK_M:]``) of query head ``g`` of the
    group, queries ``m_start ...`` (``lse_row`` / ``delta_row``: the group's first head, the sequence's
    first row); positions past ``len_q`` are not read and land as 0 (harmless: their Q and dO rows
    are zeroed before any product, see `bwd_dkdv_sm90._dkdv_ws_step`)."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])  # the producer's one warp
    off = g.to(gl.int64) * stride_lse_head + m_start
    offs = gl.arange(0, BLOCK_M, layout=layout)
    ok = offs < len_q - m_start
    cp_async_load(buf.slice(0, BLOCK_M), lse_row + off + offs, mask=ok)
    cp_async_load(buf.slice(BLOCK_M, BLOCK_M), delta_row + off + offs, mask=ok)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, row0_kv, k_start, kv_head, HEAD_DIM: gl.constexpr):
    """TMA the tile's K and V (keys ``k_start ...`` of the sequence at row ``row0_kv``) onto ``kv_bar``."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [row0_kv + k_start, kv_head * HEAD_DIM], kv_bar, k_smem)
    tma_load(v_desc, [row0_kv + k_start, kv_head * HEAD_DIM], kv_bar, v_smem)


@gluon.jit
def _produce_steps(q_desc, do_desc, q_bufs, do_bufs, stats, ready, empty, lse_row, delta_row, stride_lse_head,
                   first_head, row0_q, len_q, m_lo, m_end, first, last, g, m_start, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Ring steps ``first .. last-1`` (counted over the program's work items), the first of them
    query head ``g`` of the group, queries ``m_start ...``: each into slot ``it % STAGES`` once both
    consumers released the step ``it - STAGES`` there: lse and delta of the step's queries
    (cp.async, tracked by ``ready`` through ``cp.async.mbarrier.arrive``, which adds its own
    pending arrival), then Q and dO (TMA, ``expect`` bytes on ``ready``). Returns ``(g, m_start)``
    of step ``last`` (counters, no divisions)."""
    for it in range(first, last):
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        _stats_copy(lse_row, delta_row, stride_lse_head, g, m_start, len_q, stats.index(slot), BLOCK_M)
        async_copy.mbarrier_arrive(ready.index(slot))
        bar = ready.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        col = (first_head + g) * HEAD_DIM
        tma_load(q_desc, [row0_q + m_start, col], bar, q_bufs.index(slot))
        tma_load(do_desc, [row0_q + m_start, col], bar, do_bufs.index(slot))
        m_start += BLOCK_M
        if m_start == m_end:
            m_start = m_lo
            g += 1
    return g, m_start


@gluon.jit
def _dkdv_ws_producer(q_desc, k_desc, v_desc, do_desc, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q,
                      row_offsets_kv, stride_lse_head, num_heads_kv, group_size, heads_per_section, k_smem,
                      v_smem, q_bufs, do_bufs, stats, kv_bar, ready, empty, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Load partition (one warp): the program's K / V tile, then its ``total`` ring steps (`_produce_steps`).
    A tile without steps loads nothing."""
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, gl.program_id(0),
                   gl.num_programs(0), num_heads_kv, group_size, heads_per_section, BLOCK_M)
    if total > 0:
        _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, row0_kv, k_start, kv_head, HEAD_DIM)
        first_head = kv_head * group_size
        row_off = first_head.to(gl.int64) * stride_lse_head + row0_q.to(gl.int64)
        lse_row = Lse + row_off
        delta_row = Delta + row_off
        m_end = m_lo + num_m_blocks * BLOCK_M
        _produce_steps(q_desc, do_desc, q_bufs, do_bufs, stats, ready, empty, lse_row, delta_row,
                       stride_lse_head, first_head, row0_q, len_q, m_lo, m_end, 0, total, m_lo * 0, m_lo, HEAD_DIM,
                       BLOCK_M, STAGES)
