"""Pieces that the warp-specialised Gluon backward kernels for Hopper (sm_90a) share: the dK/dV and dQ kernels of
one power-of-two head dim (`packattn.ops.varlen.bwd_dkdv_sm90`, `packattn.ops.varlen.bwd_dq_sm90`) and those in
column parts (`packattn.ops.varlen.bwd_dkdv_sm90_parts`, `packattn.ops.varlen.bwd_dq_sm90_parts`).

* `_zero_tails`: a tail step's zeroing of the ring slot's rows past the sequence, with the two consumers'
  rendezvous on ``zero_bar`` (the contract: `bwd_dkdv_sm90`'s module docstring, "Tail step").
* `_tile_barriers`: the tile's mbarrier (``kv_bar`` / ``q_bar``), ``zero_bar`` and the ring's ``ready`` /
  ``empty``, initialised.
* `ws_partitions`: a kernel's ``gl.warp_specialize`` of one or two consumer warp groups and the producer.

A tensor held in one part passes its buffer twice and a second width of 0 (`_zero_rows_parts`): the code it
compiles to is that of the one-part call.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from packattn.ops.varlen.common_sm90 import _zero_v_tail
from packattn.ops.varlen.common_sm90_ws import _ring_barriers


@gluon.jit
def _zero_rows_parts(hi, lo, first_row, end_row, ROWS: gl.constexpr, LO: gl.constexpr):
    """`common_sm90._zero_v_tail` of both parts of one slot (rows ``first_row + i >= end_row`` set to 0); ``LO ==
    0``: ``hi`` only (``lo`` unused)."""
    _zero_v_tail(hi, first_row, end_row, ROWS, hi.shape[1], 4)
    if LO > 0:
        _zero_v_tail(lo, first_row, end_row, ROWS, LO, 4)


@gluon.jit
def _zero_tails(a_hi, a_lo, b_hi, b_lo, first_row, end_row, ntail, zero_bar, ROWS: gl.constexpr,
                A_LO: gl.constexpr, B_LO: gl.constexpr, WG: gl.constexpr, CONSUMERS: gl.constexpr):
    """Zero the rows ``first_row + i >= end_row`` of one ring slot's two tensors ``a`` (Q or K: parts ``a_hi`` /
    ``a_lo``, ``A_LO`` columns in the second) and ``b`` (dO or V). ``CONSUMERS == 1``: this warp group zeroes
    both (fence + barrier over it inside: its own wgmma see the zeros), no rendezvous; two: consumer 0 zeroes
    ``a``, consumer 1 ``b``, then both arrive on ``zero_bar`` (count 2) and wait with parity ``ntail & 1``.
    Returns ``ntail``, the tail steps so far (unchanged with one consumer)."""
    if CONSUMERS == 1:
        _zero_rows_parts(a_hi, a_lo, first_row, end_row, ROWS, A_LO)
        _zero_rows_parts(b_hi, b_lo, first_row, end_row, ROWS, B_LO)
    else:
        if WG == 0:
            _zero_rows_parts(a_hi, a_lo, first_row, end_row, ROWS, A_LO)
        else:
            _zero_rows_parts(b_hi, b_lo, first_row, end_row, ROWS, B_LO)
        mbarrier.arrive(zero_bar, count=1)
        mbarrier.wait(zero_bar, ntail & 1)  # the other consumer's tensor is zero too
        ntail += 1
    return ntail


@gluon.jit
def _tile_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """``(bar, zero_bar, ready, empty)``, initialised: ``bar`` (count 1) the tile's loads (K / V in dK/dV, Q / dO
    in dQ), ``zero_bar`` (count 2) the two consumers' tail rendezvous (`_zero_tails`; with one consumer not
    allocated: ``bar`` in its place, unused), the ring's ``ready`` / ``empty`` (`common_sm90_ws._ring_barriers`)."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    zero_bar = bar
    if CONSUMERS == 2:
        zero_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(zero_bar, count=2)
    ready, empty = _ring_barriers(STAGES, CONSUMERS)
    return bar, zero_bar, ready, empty


def ws_partitions(consumer, producer):
    """A jit function ``partitions(consumer_args, producer_args, CONSUMERS, CONSUMER_REGS, PRODUCER_REGS)``: a
    kernel's ``gl.warp_specialize`` of the ``@gluon.jit`` functions ``consumer`` (its last argument: the consumer
    warp group, ``WG``) and ``producer``. ``consumer(*consumer_args, 0)`` runs in the default partition (4
    warps), with ``CONSUMERS == 2`` ``consumer(*consumer_args, 1)`` as a 4-warp worker (``CONSUMER_REGS``
    registers), and ``producer(*producer_args)`` as a 1-warp worker (``PRODUCER_REGS``; with one consumer the
    launch pads it to 4 warps). The functions are closed over (jit code takes a function argument as a
    constexpr, which ``gl.warp_specialize`` does not call), and ``WG`` travels beside the arguments, not
    appended to them (a tuple's ``+`` unwraps the constexprs it appends)."""
    wg0, wg1 = gl.constexpr(0), gl.constexpr(1)

    @gluon.jit
    def consume(args, WG: gl.constexpr):
        consumer(*args, WG)

    @gluon.jit
    def partitions(consumer_args, producer_args, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr):
        if CONSUMERS == 2:
            gl.warp_specialize([(consume, (consumer_args, wg0)), (consume, (consumer_args, wg1)),
                                (producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(consume, (consumer_args, wg0)), (producer, producer_args)], [1], [PRODUCER_REGS])

    return partitions
