"""DELTA_FROM_O, the consumer's part: the warp-specialised dQ kernel (`packattn.ops.varlen.bwd_dq_sm90`) computes
delta = rowsum(dO * O) itself instead of reading the preprocess's (`packattn.ops.varlen.launch_triton.bwd_delta`;
no dlse term), so the backward drops that kernel (`packattn.ops.varlen.op.fuses_delta`: the dQ pass then runs
before the dK/dV pass, which reads the delta it wrote). One consumer or two, each summing its own 64 rows.

* Producer (`packattn.ops.varlen.bwd_dq_sm90_load`): O by TMA with Q and dO on ``q_bar``.
* Consumer: no delta load. The tile's first ring step (`bwd_dq_sm90._dq_ws_step` with ``DELTA_FROM_O``) issues S[0] and
  dP[0], then computes delta while they run (`_delta_from_o`: dO and O from shared memory in chunks of up to 64
  columns, each in a wgmma accumulator layout, float32 products, the row sum inside quads of lanes, so it lands
  in the row layout of lse / delta with no shared-memory exchange), stores it to ``Delta`` for the rows ``<
  len_q``, then waits for S as before; later steps use it. The dQ in column parts
  (`packattn.ops.varlen.bwd_dq_sm90_parts`) sums both value parts the same way.
* Rows past ``len_q`` sum whatever TMA read there: their P is 0 (lse +inf), neither their dQ nor their delta is
  stored. Rows that see no key get rowsum(dO O), as from the preprocess. A tile without key blocks writes no
  delta: those rows keep what ``Delta`` held (the caller passes zeros; the dK/dV pass reads them with P = 0).
* The float32 sums run in another order than the preprocess's: results are close to, not bitwise, the unfused
  backward's.
* Without ``DELTA_FROM_O`` the launcher passes ``o_desc = None`` (a constant: no kernel parameter), and the
  kernel compiles as if this feature did not exist.

Budget at d = 128: one consumer (64, 64, 2 stages) 114940 B of shared memory (two CTAs per SM), two consumers
(128, 64, 4 stages) 229760 B (one CTA per SM); no spills (scripts/check_gluon_bwd_compile.py --delta-from-o).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from packattn.ops.varlen.common_sm90 import mma_layout


@gluon.jit
def _row_dots(a, b, out_layout: gl.constexpr):
    """``sum_d a[i, d] b[i, d]`` in float32 of two ``[ROWS, W]`` shared-memory tiles, in ``out_layout`` (a row
    layout). The columns in chunks of up to 64, each loaded in a wgmma accumulator layout of the chunk's width
    (pairs of elements per thread, the row sum inside a quad of lanes), so that the sums land in the
    accumulators' row layout without a shared-memory exchange and few registers are live."""
    ROWS: gl.constexpr = a.shape[0]
    W: gl.constexpr = a.shape[1]
    CHUNK: gl.constexpr = 64 if W >= 64 else W
    layout: gl.constexpr = mma_layout(4, CHUNK)
    acc = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, layout))
    for c in gl.static_range(W // CHUNK):
        x = a.slice(c * CHUNK, CHUNK, dim=1).load(layout).to(gl.float32)
        y = b.slice(c * CHUNK, CHUNK, dim=1).load(layout).to(gl.float32)
        acc += gl.sum(x * y, axis=1)
    return gl.convert_layout(acc, out_layout)


@gluon.jit
def _delta_from_o(do_hi, o_hi, do_lo, o_lo, delta_ptr, delta_rows, s_layout: gl.constexpr, DV_LO: gl.constexpr):
    """``delta[i] = sum_d dO[i, d] O[i, d]`` in float32 for one warp group's 64 rows, from shared memory: dO and O
    in up to two column parts (``do_hi`` / ``o_hi``, and ``do_lo`` / ``o_lo`` of ``DV_LO`` columns where ``DV_LO >
    0``; `_row_dots`), in the row layout of ``s_layout`` (``SliceLayout(1, s_layout)``: that of lse / delta in
    the steps); stored to ``delta_ptr[i]`` for ``i < delta_rows`` (the rows inside the sequence: the masked store
    of `bwd_common_sm90._row_vector`'s addresses)."""
    ROWS: gl.constexpr = do_hi.shape[0]  # one warp group's rows: 64
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    delta = _row_dots(do_hi, o_hi, row_layout)
    if DV_LO > 0:
        delta += _row_dots(do_lo, o_lo, row_layout)
    offs = gl.arange(0, ROWS, layout=row_layout)
    gl.store(delta_ptr + offs, delta, mask=offs < delta_rows)
    return delta
