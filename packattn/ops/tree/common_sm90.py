"""Gluon helpers shared by the Hopper (sm_90a) kernels of the tree family (`packattn.ops.tree.fwd_sm90`,
`packattn.ops.tree.dq_sm90`): the block walk over a query tile's intervals (`_first_block`, `_next_block`,
`_count_blocks`; module docstring of `packattn.ops.tree.fwd_sm90`) and the producer's cp.async of ``key_end``
(`_ends_copy`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from packattn.ops.runtime.gluon_compat import cp_async_load


# ---------------------------------------------------------------- the block walk (every partition)
@gluon.jit
def _interval(intervals, index, first, last):
    """Interval row ``[lo, hi, kind]`` at ``index`` clamped to the tile's rows ``[first, last]``."""
    at = intervals + gl.maximum(gl.minimum(index, last), first) * 3
    return gl.load(at), gl.load(at + 1), gl.load(at + 2)


@gluon.jit
def _enter(intervals, index, first, last):
    """Cursor ``(index, lo, hi, kind)`` at the first visible interval from ``index`` on: a kind-0 row
    is followed by a visible one (the table holds maximal runs), so at most one row is skipped."""
    lo, hi, kind = _interval(intervals, index, first, last)
    if kind == 0:
        index += 1
        lo, hi, kind = _interval(intervals, index, first, last)
    return index, lo, hi, kind


@gluon.jit
def _first_block(intervals, first, last):
    """Cursor ``(interval index, block start, interval end, kind)`` at the tile's first visible block."""
    return _enter(intervals, first, first, last)


@gluon.jit
def _next_block(intervals, index, n, hi, kind, first, last, BLOCK_N: gl.constexpr):
    """The cursor one block on; past the tile's last visible block it stays on the last row
    (harmless: nobody uses it)."""
    n += BLOCK_N
    if n >= hi:
        index, n, hi, kind = _enter(intervals, index + 1, first, last)
    return index, n, hi, kind


@gluon.jit
def _count_blocks(intervals, first, count, BLOCK_N: gl.constexpr):
    """Key blocks of the tile's visible intervals."""
    total = count * 0
    for i in range(first, first + count):
        lo, hi, kind = _interval(intervals, i, first, first + count - 1)
        total += gl.where(kind != 0, (hi - lo) // BLOCK_N, 0)
    return total



# ---------------------------------------------------------------- producer
@gluon.jit
def _ends_copy(key_end, n, total, buf, BLOCK_N: gl.constexpr):
    """cp.async ``key_end[n : n + BLOCK_N]`` into ``buf`` (the producer's one warp); keys past
    ``total`` are not read and land as 0."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK_N, layout=layout)
    cp_async_load(buf, key_end + n + offs, mask=offs < total - n)
