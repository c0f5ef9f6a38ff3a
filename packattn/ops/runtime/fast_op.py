"""Eager fast path of our ``torch.library`` custom ops.

A custom op with registered autograd costs ~0.1-0.2 ms of host time per call in eager mode (the
dispatcher, then ``torch._library.autograd`` flattening every argument with pytree and filling
defaults from the schema, once forward and once backward); measured with the kernels stubbed out,
that was most of the host time of a W8 forward+backward (benchmarks/NOTES.md, v13). Batches of
short documents issued back to back are host-bound, so eager calls skip that machinery:

* `eager_function` builds a plain ``torch.autograd.Function`` from the op's own implementation,
  ``setup_context`` and ``backward`` (the same functions the op registers, so both paths compute
  the same thing);
* `call` runs the op itself while torch.compile / export traces (the op keeps the graph whole,
  with its fake implementation) or when an argument is a tensor subclass (fake, functional,
  DTensor: the dispatcher handles those), and the eager function otherwise.
"""

from __future__ import annotations

import torch


# argument types that are not tensor subclasses: one set lookup each (isinstance costs more host time)
_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


def _plain(args) -> bool:
    """No argument is a tensor subclass (lists of tensors included)."""
    for a in args:
        if type(a) in _PLAIN_TYPES:
            continue
        if isinstance(a, torch.Tensor):
            return False
        if isinstance(a, (list, tuple)) and not _plain(a):
            return False
    return True


def call(op, eager, *args):
    """``op(*args)`` under torch.compile / export or with tensor subclasses, else ``eager(*args)``."""
    if torch.compiler.is_compiling() or not _plain(args):
        return op(*args)
    return eager(*args)


def eager_function(forward, setup_context, backward) -> type[torch.autograd.Function]:
    """An autograd function running ``forward(*args)``, ``setup_context(ctx, args, output)`` and
    ``backward(ctx, *grads)`` as ``op.register_autograd(backward, setup_context=...)`` does. The
    op's backward returns a list of Nones for a list argument; an autograd function returns None."""

    class EagerOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output = forward(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return tuple(None if isinstance(g, list) else g for g in backward(ctx, *grads))

    EagerOp.__name__ = EagerOp.__qualname__ = f"Eager_{forward.__name__.lstrip('_')}"
    return EagerOp
