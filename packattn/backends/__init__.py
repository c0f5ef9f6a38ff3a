"""The backend registry, in priority order (first capable one wins), built on first use.

Importing this package loads no backend: `registry()` imports the backend modules (and through
them triton, FlexAttention, torch's varlen_attn) the first time dispatch or a tool needs the list,
so ``import packattn`` stays light. ``REGISTRY`` (a module attribute) is the same list.
"""

from __future__ import annotations

# Priority order: small_seq first (it accepts only one query over <= 16 keys, the case it is built for).
# FA4 (only when installed) leads where it supports the call: it measured faster than our Triton kernels
# on W1-W5; short batches with gradients excepted, where auto dispatch passes it over
# (`Fa4Backend.defers_to`). torch_varlen before flex: no compile on first use.
_registry: list | None = None


def registry() -> list:
    """The backends, one instance each, in priority order (one list per process: a test or a tool may
    append its own backend to it, to be asked for by name).

    Under torch.compile, dispatch decides outside the trace (`dispatch._select_outside_trace`), which
    builds this list eagerly before the trace reads it: the graph's guard on it never changes."""
    global _registry
    if _registry is None:
        _registry = _build()
    return _registry


def _build() -> list:
    from packattn.backends.fa4 import Fa4Backend
    from packattn.backends.flex import FlexBackend
    from packattn.backends.reference import ReferenceBackend
    from packattn.backends.sdpa import SdpaBackend
    from packattn.backends.small_seq import SmallSeqBackend
    from packattn.backends.torch_varlen import TorchVarlenBackend
    from packattn.backends.triton_tree import TritonTreeBackend
    from packattn.backends.triton_varlen import TritonVarlenBackend

    return [SmallSeqBackend(), Fa4Backend(), TritonVarlenBackend(), TritonTreeBackend(), TorchVarlenBackend(),
            FlexBackend(), SdpaBackend(), ReferenceBackend()]


def get(name: str):
    for backend in registry():
        if backend.name == name:
            return backend
    raise KeyError(name)


def __getattr__(name: str):
    if name == "REGISTRY":
        return registry()
    raise AttributeError(f"module 'packattn.backends' has no attribute {name!r}")
