"""Warp-specialisation plumbing shared by the Hopper (sm_90a) Gluon kernels of the varlen and tree families.

* Work split: `_section_order` (work item -> ``(tile, head)`` in head sections), `_work_item` (its tile-table
  row decoded), `_opaque_program_id` / `_opaque_num_programs` / `_program_id` (grid reads LLVM may not merge
  or hoist, so a second decode recomputes instead of holding the first decode's scalars across the main loop).
* Ring: `_ring_barriers` (``ready`` / ``empty`` mbarriers of a ``STAGES``-slot K/V ring).
* The warp-specialised forward's pieces that the varlen forward (`packattn.ops.varlen.fwd_sm90`) and the tree
  forward (`packattn.ops.tree.fwd_sm90`) share: `_ws_buffers` (shared memory and barriers), `_ws_load_q`
  (the producer's Q load), `_ws_tile_start` (a consumer's fresh row state), `_ws_epilogue` / `_store_out`
  (``out`` and ``lse`` from the accumulator registers).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from packattn.ops.runtime import launch
from packattn.ops.runtime.gluon_compat import tma_load
from packattn.ops.varlen.common_sm90 import _tile_row, quad_vec_layout

LN2 = gl.constexpr(launch.LN2)


# ---------------------------------------------------------------- work split
@gluon.jit
def _opaque_program_id(like):
    """The program id, read through inline asm that LLVM may not merge with an earlier read (``like``:
    any i32 scalar, the asm's dummy operand), so that a second decode (the consumers' epilogue)
    recomputes everything instead of keeping the first decode's values in registers across the main
    loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _opaque_num_programs(like):
    """``gl.num_programs(0)`` read where it is used (inline asm LLVM may not hoist out of a loop)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %nctaid.x;", "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _opaque_i32(x):
    """``x`` (an int32 scalar) through inline asm LLVM may not hoist or merge: what a partition computes from it
    stays inside the partition's loop instead of moving to the kernel's entry block, whose values live across
    setmaxnreg, where ptxas spills them."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _program_id(like, OPAQUE_PID: gl.constexpr):
    """The program id; ``OPAQUE_PID``: read through inline asm that LLVM may not merge with an earlier
    read (``like``: any int32 scalar, the asm's dummy operand), so that the consumers' epilogue decodes
    the tile row again instead of keeping the first decode's scalars in registers across the main loop."""
    if OPAQUE_PID:
        pid = _opaque_program_id(like)
    else:
        pid = gl.program_id(0)
    return pid


@gluon.jit
def _section_order(w, heads_per_section, section_items):
    """``(tile, head)`` of work item ``w``: the heads are cut into sections of ``heads_per_section``
    (``section_items = tiles x heads_per_section`` items each), taken one after the other; inside a
    section the heads vary fastest, so its longest tiles come first and the programs running at the
    same time share the K/V (or Q/dO) of few heads in L2. One section of all heads: tile
    ``w // heads``, head ``w % heads``."""
    section = w // section_items
    r = w - section * section_items
    tile = r // heads_per_section
    return tile, section * heads_per_section + (r - tile * heads_per_section)


@gluon.jit
def _work_item(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, w, num_heads_q, group_size,
               heads_per_section, num_items, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Decode work item ``w`` of ``num_items = tiles x num_heads_q`` (`_section_order`); ``seq < 0``
    marks an unused tile-table row."""
    tile, head = _section_order(w, heads_per_section, num_items // num_heads_q * heads_per_section)
    seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi, len_q, len_kv, row0_q, row0_kv = _tile_row(
        tiles, tile, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    col_kv = (head // group_size) * HEAD_DIM
    num_blocks = gl.where(seq >= 0, (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N, 0)
    return seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv



# ---------------------------------------------------------------- ring
@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_KV: gl.constexpr = False):
    """The ring's mbarriers of a warp-specialised kernel, initialised: ``ready[slot]`` (count 1: the
    producer's expect + TMA) and ``empty[slot]`` (count ``CONSUMERS``: each consumer warp group
    releases the slot). ``SPLIT_KV`` (the forward's separate K / V barriers, `fwd_sm90_ring`): ``2 STAGES`` of
    each, ``[slot]`` for K and ``[STAGES + slot]`` for V (`launch_sm90.shared_bytes` counts them so)."""
    BARS: gl.constexpr = STAGES * (2 if SPLIT_KV else 1)
    ready = gl.allocate_shared_memory(gl.int64, [BARS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BARS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


# ---------------------------------------------------------------- the warp-specialised forward's pieces
@gluon.jit
def _ws_buffers(q_desc, k_desc, v_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                HEAD_DIM: gl.constexpr, SPLIT_KV: gl.constexpr = False):
    """Shared memory of the warp-specialised forward, barriers initialised: ``(q_smem, k_bufs, v_bufs,
    q_bar, q_empty, ready, empty)``; ``q_empty`` and ``empty`` count one arrival per consumer warp group.
    ``SPLIT_KV``: the ring has ``2 STAGES`` barriers each, ``[slot]`` for K and ``[STAGES + slot]`` for V."""
    NUM_CONSUMERS: gl.constexpr = BLOCK_M // 64
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=NUM_CONSUMERS)
    ready, empty = _ring_barriers(STAGES, NUM_CONSUMERS, SPLIT_KV)
    return q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty


@gluon.jit
def _ws_load_q(q_desc, q_smem, q_bar, q_empty, loads_q, row, col):
    """Producer: TMA the tile's Q (rows ``row ...``, column ``col``) onto ``q_bar`` once the consumers
    released the previous tile's Q on ``q_empty`` (``loads_q``: Q loads issued before this one)."""
    mbarrier.wait(q_empty, (loads_q & 1) ^ 1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [row, col], q_bar, q_smem)


@gluon.jit
def _ws_tile_start(q_wg_start, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr):
    """Fresh state of one consumer's 64 query rows ``q_wg_start ...``: ``(offs_m, offs_n, m_i, l_i, acc)``
    (row positions, key offsets within a block, running max / sum, output accumulator)."""
    offs_m = q_wg_start + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    return offs_m, offs_n, m_i, l_i, acc


@gluon.jit
def _store_out(acc, m_i, l_i, Out, Lse, row0_q, q_start, len_q, head, stride_o_row, stride_o_head,
               stride_lse_head, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
               VEC_STORE: gl.constexpr = False):
    """Store rows ``q_start + i < len_q``: ``out = acc / l`` in ``Out``'s dtype and ``lse = (m + log2 l) ln 2``
    (``out = 0``, ``lse = -inf`` where ``l = 0``: the row saw no key), straight from the accumulator layout
    (each thread writes pairs of adjacent columns), so no shared memory: Q's buffer is not needed. ``VEC_STORE``
    (`configs.GluonConfig.vec_store`): the output converted to 16-byte row pieces first
    (`common_sm90.quad_vec_layout`: one consumer warp group's 64 rows)."""
    gl.static_assert((not VEC_STORE) | (BLOCK_M == 64), "vec_store: one consumer warp group's 64 rows")
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    empty = l_o == 0.0
    l_safe = gl.where(empty, 1.0, l_o)
    out = acc * (1.0 / l_safe)[:, None]
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    lse = gl.where(empty, float("-inf"), (m_o + gl.log2(l_safe)) * LN2)
    rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    gl.store(Lse + head.to(gl.int64) * stride_lse_head + row0_q + rows, lse, mask=rows < len_q)
    out_layout: gl.constexpr = quad_vec_layout(HEAD_DIM) if VEC_STORE else o_layout
    if VEC_STORE:
        out = gl.convert_layout(out.to(Out.dtype.element_ty), out_layout)
        rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
    base = Out + row0_q * stride_o_row + head.to(gl.int64) * stride_o_head
    ptrs = base + rows[:, None] * stride_o_row + cols[None, :]
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < len_q)[:, None])


@gluon.jit
def _ws_epilogue(acc, m_i, l_i, Out, Lse, row0_q, q_wg_start, len_q, head, stride_o_row, stride_o_head,
                 stride_lse_head, o_layout: gl.constexpr, HEAD_DIM: gl.constexpr, VEC_STORE: gl.constexpr = False):
    """Store one consumer's 64 rows (those before ``len_q``) from registers (Q was released already);
    ``VEC_STORE``: `_store_out`."""
    _store_out(acc, m_i, l_i, Out, Lse, row0_q, q_wg_start, len_q, head, stride_o_row, stride_o_head,
               stride_lse_head, o_layout, 64, HEAD_DIM, VEC_STORE)
