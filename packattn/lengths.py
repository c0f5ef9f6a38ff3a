"""Length classes of a batch that both dispatch and the Triton backend key on (one place for each
rule, in a module light enough for dispatch to import)."""

from __future__ import annotations

# No sequence longer than SHORT_SEQLEN (queries or keys): the Gluon forward and dQ take their
# short-sequence tiles and work order, and auto dispatch passes FA4 over for the triton backend on
# such batches with gradients (`Fa4Backend.defers_to`).
SHORT_SEQLEN = 512
# Documents of at most TINY_SEQLEN tokens (one tile of the forward) rank backends differently from those up
# to SHORT_SEQLEN (the cost table's ``tiny`` and ``short`` regimes: dispatch buckets lengths at both bounds).
TINY_SEQLEN = 128


def short_batch(max_seqlen_q: int, max_seqlen_kv: int) -> bool:
    """No sequence longer than `SHORT_SEQLEN`, queries or keys."""
    return max(max_seqlen_q, max_seqlen_kv) <= SHORT_SEQLEN
