"""Column parts and a value head dim of its own for the warp-specialised Gluon backward (sm_90a): the load side
and the shared pieces of `packattn.ops.varlen.bwd_dkdv_sm90_parts` and `packattn.ops.varlen.bwd_dq_sm90_parts`.

As in the forward (`packattn.ops.varlen.fwd_sm90_parts`): a head dim that is not a power of two runs exactly, with
no padding, as two column parts ``hi = part_hi(d)`` and ``lo = d - hi`` (96 = 64 + 32, 192 = 128 + 64), each
tensor in shared memory as one buffer per part, filled by its own TMA box over the same ``(rows, heads * d)``
view (host: `launch_sm90.part_descriptors`; the ``lo`` box at column ``head * d + hi``). q/k have head dim
``HEAD_DIM``, v / dO / O ``HEAD_DIM_V`` (MLA: 192/128, 128/64). Products contracting a head dim chain one async
wgmma group per part on one accumulator; products into a head dim keep one accumulator per part.

A tensor without a second part (``D_LO == 0`` / ``DV_LO == 0``) gets its ``lo`` buffer aliased to the first
part's, never read (a name bound to None cannot travel in the tuples of ``gl.warp_specialize``): code tests the
head dims, not the buffers. The kernels of one power-of-two head dim (`bwd_dkdv_sm90`, `bwd_dq_sm90`) are not
built from these pieces; what they share with the part kernels is in `packattn.ops.varlen.bwd_ws_sm90` (tail
zeroing, barriers, partitions) and `packattn.ops.varlen.bwd_dq_sm90_delta` (delta from O).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from packattn.ops.runtime.gluon_compat import tma_load
from packattn.ops.varlen.bwd_dkdv_sm90_load import _dkdv_tile, _stats_copy
from packattn.ops.varlen.bwd_dq_sm90_load import _dq_tile
from packattn.ops.varlen.fwd_sm90_parts import _load_kv_parts, part_hi


@gluon.constexpr_function
def part_lo(head_dim):
    """The second column part of ``head_dim`` (0 for a power of two)."""
    return int(head_dim) - part_hi(head_dim)


@gluon.jit
def _alloc_parts(desc, lo_desc, STAGES: gl.constexpr, ROWS: gl.constexpr, HI: gl.constexpr, LO: gl.constexpr):
    """``(hi, lo)`` shared buffers of ``[ROWS, HI]`` / ``[ROWS, LO]`` (``STAGES > 0``: a ring of them) in the
    descriptors' layouts; ``lo`` is ``hi`` (unused) where ``LO == 0``."""
    if STAGES == 0:
        hi = gl.allocate_shared_memory(desc.dtype, [ROWS, HI], desc.layout)
    else:
        hi = gl.allocate_shared_memory(desc.dtype, [STAGES, ROWS, HI], desc.layout)
    lo = hi
    if LO > 0:
        if STAGES == 0:
            lo = gl.allocate_shared_memory(lo_desc.dtype, [ROWS, LO], lo_desc.layout)
        else:
            lo = gl.allocate_shared_memory(lo_desc.dtype, [STAGES, ROWS, LO], lo_desc.layout)
    return hi, lo


@gluon.jit
def _tma_parts(desc, lo_desc, bar, hi, lo, row, col, HI: gl.constexpr, LO: gl.constexpr):
    """TMA the rows at ``row`` of one tensor's parts (``hi`` at column ``col``, ``lo`` at ``col + HI``) onto
    ``bar`` (whose expected bytes the caller set)."""
    tma_load(desc, [row, col], bar, hi)
    if LO > 0:
        tma_load(lo_desc, [row, col + HI], bar, lo)


@gluon.constexpr_function
def parts_nbytes(desc, lo_desc):
    """Bytes of one TMA load of both parts of a tensor (``lo_desc`` None: one part)."""
    return desc.block_type.nbytes + (0 if lo_desc is None else lo_desc.block_type.nbytes)


# ---------------------------------------------------------------- dK/dV producer
@gluon.jit
def _dkdv_parts_producer(q_desc, k_desc, v_desc, do_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc, Lse, Delta,
                         tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_lse_head,
                         num_heads_kv, group_size, heads_per_section, k_hi, k_lo, v_hi, v_lo, q_hi, q_lo, do_hi, do_lo,
                         stats, kv_bar, ready, empty, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                         BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """`bwd_dkdv_sm90_load._dkdv_ws_producer` with every tensor in its column parts: K / V of the tile onto
    ``kv_bar``, then per ring step lse / delta (cp.async) and Q, dO (TMA) into slot ``it % STAGES``."""
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    DV_HI: gl.constexpr = part_hi(HEAD_DIM_V)
    DV_LO: gl.constexpr = part_lo(HEAD_DIM_V)
    seq, kv_head, k_start, m_lo, m_mid_lo, m_mid_hi, num_m_blocks, total, len_q, len_kv, row0_q, row0_kv = \
        _dkdv_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, gl.program_id(0),
                   gl.num_programs(0), num_heads_kv, group_size, heads_per_section, BLOCK_M)
    if total > 0:
        mbarrier.expect(kv_bar, parts_nbytes(k_desc, k_lo_desc) + parts_nbytes(v_desc, v_lo_desc))
        _tma_parts(k_desc, k_lo_desc, kv_bar, k_hi, k_lo, row0_kv + k_start, kv_head * HEAD_DIM, D_HI, D_LO)
        _tma_parts(v_desc, v_lo_desc, kv_bar, v_hi, v_lo, row0_kv + k_start, kv_head * HEAD_DIM_V, DV_HI, DV_LO)
        first_head = kv_head * group_size
        row_off = first_head.to(gl.int64) * stride_lse_head + row0_q.to(gl.int64)
        m_end = m_lo + num_m_blocks * BLOCK_M
        g = m_lo * 0
        m_start = m_lo
        for it in range(0, total):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            _stats_copy(Lse + row_off, Delta + row_off, stride_lse_head, g, m_start, len_q, stats.index(slot),
                        BLOCK_M)
            bar = ready.index(slot)
            async_copy.mbarrier_arrive(bar)
            mbarrier.expect(bar, parts_nbytes(q_desc, q_lo_desc) + parts_nbytes(do_desc, do_lo_desc))
            _tma_parts(q_desc, q_lo_desc, bar, q_hi.index(slot), q_lo.index(slot), row0_q + m_start,
                       (first_head + g) * HEAD_DIM, D_HI, D_LO)
            _tma_parts(do_desc, do_lo_desc, bar, do_hi.index(slot), do_lo.index(slot), row0_q + m_start,
                       (first_head + g) * HEAD_DIM_V, DV_HI, DV_LO)
            m_start += BLOCK_M
            if m_start == m_end:
                m_start = m_lo
                g += 1


# ---------------------------------------------------------------- dQ producer
@gluon.jit
def _dq_parts_producer(q_desc, k_desc, v_desc, do_desc, o_desc, q_lo_desc, k_lo_desc, v_lo_desc, do_lo_desc,
                       o_lo_desc, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q,
                       group_size, heads_per_section, q_hi, q_lo, do_hi, do_lo, o_hi, o_lo, k_hi, k_lo, v_hi, v_lo,
                       q_bar, ready, empty, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, DELTA_FROM_O: gl.constexpr):
    """`bwd_dq_sm90_load._dq_ws_producer` with every tensor in its column parts: Q, dO (and O) of the tile onto
    ``q_bar``, then key block ``j`` (K, V parts: `fwd_sm90_parts._load_kv_parts`) into slot ``j % STAGES``."""
    D_HI: gl.constexpr = part_hi(HEAD_DIM)
    D_LO: gl.constexpr = part_lo(HEAD_DIM)
    DV_HI: gl.constexpr = part_hi(HEAD_DIM_V)
    DV_LO: gl.constexpr = part_lo(HEAD_DIM_V)
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N)
    if num_blocks > 0:
        nbytes: gl.constexpr = parts_nbytes(q_desc, q_lo_desc) + parts_nbytes(do_desc, do_lo_desc)
        if DELTA_FROM_O:
            mbarrier.expect(q_bar, nbytes + parts_nbytes(o_desc, o_lo_desc))
            _tma_parts(o_desc, o_lo_desc, q_bar, o_hi, o_lo, row0_q + q_start, head * HEAD_DIM_V, DV_HI, DV_LO)
        else:
            mbarrier.expect(q_bar, nbytes)
        _tma_parts(q_desc, q_lo_desc, q_bar, q_hi, q_lo, row0_q + q_start, head * HEAD_DIM, D_HI, D_LO)
        _tma_parts(do_desc, do_lo_desc, q_bar, do_hi, do_lo, row0_q + q_start, head * HEAD_DIM_V, DV_HI, DV_LO)
        col_v = (head // group_size) * HEAD_DIM_V
        for j in range(0, num_blocks):
            mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
            _load_kv_parts(k_desc, v_desc, k_lo_desc, v_lo_desc, k_hi, v_hi, k_lo, v_lo, ready, j, row0_kv, n_lo,
                           col_kv, col_v, num_blocks, STAGES, BLOCK_N, D_HI, DV_HI)
