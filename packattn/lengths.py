"""Length classes of a batch that both dispatch and the Triton backend key on (one place for each
rule, in a module light enough for dispatch to import)."""

from __future__ import annotations

# No sequence longer than SHORT_SEQLEN (queries or keys): the Gluon forward and dQ take their
# short-sequence tiles and work order, and auto dispatch passes FA4 over for the triton backend on
# such batches with gradients (`Fa4Backend.defers_to`).
SHORT_SEQLEN = 512
# The cost table's length regimes count the forward's 128-row tiles of the longest sequence: one (``tiny``:
# at most TINY_SEQLEN tokens), two (``mid``: at most MID_SEQLEN), three or four (``short``: at most
# SHORT_SEQLEN); backends rank differently in each (dispatch buckets lengths at every bound).
TINY_SEQLEN = 128
MID_SEQLEN = 256
# The small-seq kernels' range: dispatch keeps longest lengths up to it exact (``small``).
SMALL_SEQLEN = 16

# The length regimes, shortest first: (name, longest sequence of the regime; None: no bound). The one
# definition of the boundaries: the cost table's regimes (`regime`), dispatch's length buckets (`bucket`) and
# the ranges ``packattn explain`` prints (`regime_range`, `length_class`) are all read off it.
REGIME_BOUNDS = (("small", SMALL_SEQLEN), ("tiny", TINY_SEQLEN), ("mid", MID_SEQLEN), ("short", SHORT_SEQLEN),
                 ("long", None))


def short_batch(max_seqlen_q: int, max_seqlen_kv: int) -> bool:
    """No sequence longer than `SHORT_SEQLEN`, queries or keys."""
    return max(max_seqlen_q, max_seqlen_kv) <= SHORT_SEQLEN


def regime(longest: int) -> str:
    """The regime (`REGIME_BOUNDS`) of a longest length, real or bucketed (`bucket` keeps the regime)."""
    return next(name for name, bound in REGIME_BOUNDS if bound is None or longest <= bound)


def _low(name: str) -> int:
    """The shortest length of a regime (0 for the first)."""
    names = [n for n, _ in REGIME_BOUNDS]
    index = names.index(name)
    return 0 if index == 0 else REGIME_BOUNDS[index - 1][1] + 1


def bucket(length: int) -> int:
    """A longest length as dispatch keys it: exact up to `SMALL_SEQLEN`, else the shortest length of its regime
    (17, 129, 257, 513)."""
    return length if length <= SMALL_SEQLEN else _low(regime(length))


def regime_range(name: str) -> str:
    """The lengths of a regime, one spelling everywhere: ``<=16``, ``17-128``, ``129-256``, ``257-512``,
    ``>512``."""
    bound = dict(REGIME_BOUNDS)[name]
    if bound is None:
        return f">{_low(name) - 1}"
    return f"<={bound}" if _low(name) == 0 else f"{_low(name)}-{bound}"


def length_class(bucketed: int) -> str:
    """A bucketed length (`bucket`) as the real lengths it stands for: the length itself in the small regime,
    else its regime's range (`regime_range`)."""
    return str(bucketed) if bucketed <= SMALL_SEQLEN else regime_range(regime(bucketed))
