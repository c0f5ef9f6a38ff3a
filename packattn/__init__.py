"""packattn: attention for packed sequences (varlen, padding, chunks, windows, GQA) with one front-end.

The public names load on first use (module-level ``__getattr__``): ``import packattn`` imports
neither torch nor any backend, so ``packattn.jax`` works without torch and the PyTorch entry points
cost only what they use (`benchmarks/import_time.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "DotProductAttention": "packattn.api",
    "attention": "packattn.api",
    "NoBackendError": "packattn.dispatch",
    "Mask": "packattn.mask",
    "small_seq_attention": "packattn.small_seq",
    "Tree": "packattn.tree",
    "Varlen": "packattn.varlen",
}

__all__ = ["DotProductAttention", "Mask", "NoBackendError", "Tree", "Varlen", "attention", "small_seq_attention",
           "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from packattn.api import DotProductAttention, attention
    from packattn.dispatch import NoBackendError
    from packattn.mask import Mask
    from packattn.small_seq import small_seq_attention
    from packattn.tree import Tree
    from packattn.varlen import Varlen


# submodules that ``import packattn`` used to load eagerly: ``packattn.tree.Tree`` after a bare ``import packattn``
# still works, loading the submodule on first access
_SUBMODULES = ("api", "backends", "dispatch", "env", "mask", "small_seq", "tree", "varlen")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"packattn.{name}")  # (the import sets the attribute)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'packattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
