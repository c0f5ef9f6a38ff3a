"""The load side of the warp-specialised dQ kernel (`packattn.ops.varlen.bwd_dq_sm90`, whose module docstring
describes the partitions and barriers): the work-item decode every partition shares (`_dq_tile`) and the 1-warp
producer partition (per tile Q and dO -- and O with ``DELTA_FROM_O`` -- by TMA on ``q_bar``, then the key
blocks into the K / V ring).

Producer and consumers decode the same tile-table row (`packattn.ops.varlen.common_sm90_ws._work_item`, ``num_blocks
= 0`` for an unused row) and walk ``j = 0 .. num_blocks-1`` in the same order, so ring slot ``j % STAGES`` and
parity ``(j // STAGES) & 1`` agree. ``empty[slot]`` counts one arrival per consumer; the producer's first
``STAGES`` waits (parity 1 on fresh barriers) pass at once. With ``DELTA_FROM_O`` one ``expect`` covers the
bytes of the three ``[BLOCK_M, HEAD_DIM]`` blocks (Q, dO, O); ``q_bar`` completes one phase per program.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from packattn.ops.runtime.gluon_compat import tma_load
from packattn.ops.varlen.common_sm90 import _load_kv_block
from packattn.ops.varlen.common_sm90_ws import _program_id, _work_item


@gluon.jit
def _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
             heads_per_section, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, OPAQUE_PID: gl.constexpr = False):
    """`_work_item` of this program (one program per work item, in `common_sm90_ws._section_order`); ``OPAQUE_PID``:
    see `_program_id`."""
    pid = _program_id(num_heads_q, OPAQUE_PID)
    return _work_item(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, pid, num_heads_q, group_size,
                      heads_per_section, gl.num_programs(0), HEAD_DIM, BLOCK_N)


# ---------------------------------------------------------------- producer
@gluon.jit
def _dq_ws_producer(q_desc, k_desc, v_desc, do_desc, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                    num_heads_q, group_size, heads_per_section, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty,
                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, o_desc=None, o_smem=None,
                    DELTA_FROM_O: gl.constexpr = False):
    """Load partition (one warp): Q and dO of the tile once (``q_bar``), then key block ``j`` into ring
    slot ``j % STAGES`` once the consumers (both, or the only one) released block ``j - STAGES`` there.
    ``DELTA_FROM_O``: the tile's O rows (``o_desc``) into ``o_smem`` with Q and dO, on ``q_bar`` (its
    expected bytes count the three). A tile without key blocks loads nothing."""
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N)
    if num_blocks > 0:
        if DELTA_FROM_O:  # O with Q and dO: one phase of q_bar, 3 x BLOCK_M x HEAD_DIM elements
            mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + o_desc.block_type.nbytes)
            tma_load(q_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, q_smem)
            tma_load(do_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, do_smem)
            tma_load(o_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, o_smem)
        else:
            mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma_load(q_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, q_smem)
            tma_load(do_desc, [row0_q + q_start, head * HEAD_DIM], q_bar, do_smem)
        for j in range(0, num_blocks):
            mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
            _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, j, row0_kv, n_lo, col_kv, num_blocks, STAGES,
                           BLOCK_N)
