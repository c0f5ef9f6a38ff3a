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


def short_batch(max_seqlen_q: int, max_seqlen_kv: int) -> bool:
    """No sequence longer than `SHORT_SEQLEN`, queries or keys."""
    return max(max_seqlen_q, max_seqlen_kv) <= SHORT_SEQLEN
