"""Tree packing of sequences that share prefixes: the `Tree` descriptor and per-sequence log-probs."""

from packattn.tree.descriptor import Tree
from packattn.tree.logprobs import sequence_logprobs

__all__ = ["Tree", "sequence_logprobs"]
