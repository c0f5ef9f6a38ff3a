"""DELTA FROM O in the warp-specialised dQ kernel (`varlen_bwd_gluon_dq_ws`; constexpr ``DELTA_FROM_O``,
``gluon_launch_dq(..., delta_from_o=True, out=O)``; never ``PERSISTENT``, static_assert: one tile per program; one
consumer, or two, each summing its own 64 rows of O): the kernel computes delta = rowsum(dO * O) itself instead of
reading the preprocess's (`triton_varlen.bwd_delta`, dlse = None: no dlse term), so that the backward drops that
kernel (`triton_varlen.fuses_delta`: the dQ pass then runs before the dK/dV pass, which reads the delta it wrote).
A previous attempt (benchmarks/NOTES.md, v16) loaded O from global memory in the two-consumer kernel's consumers,
on their critical path; here O comes by TMA:

* Producer: O with Q and dO on ``q_bar`` (`varlen_bwd_gluon_dq_ws_producer`, module docstring).
* Consumer: no delta load; after the ``q_bar`` wait the tile's first ring step (`_dq_ws_step` with
  ``DELTA_FROM_O``; peeled off the block loop without ``CARRY_DS``, already separate with it) issues S[0] and
  dP[0] (async), then computes delta (`_delta_from_o`: dO and O from shared memory in 64-column chunks, each
  loaded in a wgmma accumulator layout of 64 columns -- ldmatrix in the SASS --, float32 products, the row sum
  inside quads of lanes: it lands in the row layout of lse / delta with no shared-memory exchange) while they
  run, stores it to ``Delta`` for the tile's rows inside the sequence (rows ``< len_q``: the masked addresses
  the load would read), then waits for S as before; later steps use it. In the SASS (d = 128) the ldmatrix
  and most of the shuffles are scheduled among the HGMMAs of S[0] / dP[0], before the first wait on them.
* Tile rows past ``len_q`` get the row sums of whatever TMA read there (the next sequence's rows, zeros past
  the tensor): their P is 0 (lse +inf), their dQ rows are never stored, their delta is not stored. Rows that
  see no key (lse = -inf) have P = 0 as before; their delta is rowsum(dO O), what the preprocess gives them.
* A tile with ``num_blocks == 0`` loads nothing and writes no delta: those rows keep what ``Delta`` held (the
  caller passes zeros; the dK/dV pass reads them only with P = 0: such rows see no key).
* Float32 sums in another order than the preprocess kernel's: delta, and dQ / dK / dV through it, are not
  bitwise those of the unfused backward.
* Without ``DELTA_FROM_O`` the launcher passes ``o_desc = None`` (a constant for Triton: no kernel parameter)
  and the PTX is unchanged (292 variants: every one-consumer and two-consumer config of
  `triton_bwd_gluon.DQ_WS_ALTERNATIVES`, the persistent (128, 64, 3 / 4), the tree dQ, every mask, bf16 /
  fp16, d 64 / 128; TTGIR too; ``.loc`` / debug sections aside).

sm_90a compile (scripts/check_gluon_bwd_compile.py --kernels dq --delta-from-o [--config ...]): every mask,
bf16 / fp16, no spills, no ptxas warnings, the overlap check passes. One consumer, two CTAs per SM; consumer
registers used (of 232) and shared memory per CTA: d = 128, (64, 64, 2 stages) 212-217, 114940 B (<= 115712, the
two-CTA limit: 772 B to spare; with the R mask the block loop stays at 175, the peak is in the peeled first step,
whose code is there twice: ~2200-2500 consumer SASS instructions instead of ~1300); d = 64, (64, 64, 2 / 3 / 4
stages) 143-151 / 144-165 / 144-164, 57596 / 74012 / 90396 B, (64, 128, 2 stages) 206-218, 90364 B. On GPUs since
the eleventh session: the short-batch backward's default (benchmarks/NOTES.md, v21). Two consumers (fifteenth
session, v30), one CTA per SM at d = 128: (128, 64, 4 stages) 229760 B, (128, 64, 3 stages) 196992 B, consumers
215-224 of 240; GPU-tested and measured in the sixteenth session (v30), the long-batch default since then
(`triton_bwd_gluon.fused_delta_dq`; ``$PACKATTN_GLUON_FUSED_DELTA=0`` keeps the preprocess).

(`_delta_from_o` is the consumer's part; the producer's is in `varlen_bwd_gluon_dq_ws_producer`.)
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from packattn.ops.varlen.common_sm90 import mma_layout


@gluon.jit
def _delta_from_o(do_wg, o_wg, delta_ptr, delta_rows, s_layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    """``delta[i] = sum_d dO[i, d] O[i, d]`` in float32 for the warp group's 64 rows, from shared memory
    (``do_wg`` / ``o_wg``, ``[64, HEAD_DIM]``), in the row layout of ``s_layout`` (``SliceLayout(1,
    s_layout)``: that of lse / delta in the steps); stored to ``delta_ptr[i]`` for ``i < delta_rows``
    (the rows inside the sequence: the masked store of `varlen_bwd_gluon._row_vector`'s addresses).
    The columns in chunks of 64, each loaded in a wgmma accumulator layout of 64 columns (pairs of
    elements per thread, the row sum inside a quad of lanes), so that the sums land in the accumulators'
    row layout without a shared-memory exchange and few registers are live."""
    CHUNK: gl.constexpr = 64
    ROWS: gl.constexpr = do_wg.shape[0]  # one warp group's rows: 64
    layout: gl.constexpr = mma_layout(4, CHUNK)
    delta = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, layout))
    for c in gl.static_range(HEAD_DIM // CHUNK):
        do = do_wg.slice(c * CHUNK, CHUNK, dim=1).load(layout).to(gl.float32)
        o = o_wg.slice(c * CHUNK, CHUNK, dim=1).load(layout).to(gl.float32)
        delta += gl.sum(do * o, axis=1)
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
    offs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(delta_ptr + offs, delta, mask=offs < delta_rows)
    return delta
