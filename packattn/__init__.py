"""packattn: attention for packed sequences (varlen, padding, chunks, windows, GQA) with one front-end."""

from packattn.api import DotProductAttention, attention
from packattn.dispatch import NoBackendError
from packattn.mask import Mask
from packattn.small_seq import small_seq_attention
from packattn.tree import Tree
from packattn.varlen import Varlen

__version__ = "0.1.0"

__all__ = ["DotProductAttention", "Mask", "NoBackendError", "Tree", "Varlen", "attention", "small_seq_attention",
           "__version__"]
