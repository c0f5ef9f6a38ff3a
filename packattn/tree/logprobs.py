"""Per-sequence token log-probabilities from the logits of a packed `Tree`."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from packattn.tree.descriptor import Tree

_CHUNK_ELEMENTS = 1 << 24  # rows of logits upcast at a time


class _RowLogsumexp(torch.autograd.Function):
    """``logsumexp(x.to(dtype), -1)`` by chunks of rows: no upcast copy of all of ``x`` is kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = max(1, _CHUNK_ELEMENTS // max(1, x.shape[1]))
        out = x.new_empty(x.shape[0], dtype=dtype)
        for xs, os in zip(x.split(rows), out.split(rows)):
            torch.logsumexp(xs.to(dtype), -1, out=os)
        ctx.save_for_backward(x, out)
        ctx.rows = rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, out = ctx.saved_tensors
        gx = torch.empty_like(x)
        for xs, gs, ls, g in zip(x.split(ctx.rows), gx.split(ctx.rows), out.split(ctx.rows), grad.split(ctx.rows)):
            gs.copy_(torch.exp(xs.to(out.dtype) - ls[:, None]) * g[:, None])  # softmax * grad
        return gx, None


def _rows(tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed row of the previous token, True at the first token of a sequence), per unpacked entry."""
    def build():
        first = torch.zeros(tree.sequence_index.numel(), dtype=torch.bool, device=tree.device)
        first[tree.unpacked.cu_seqlens_q[:-1].long()] = True
        return tree.sequence_index.roll(1), first

    return tree.cached("sequence_logprobs_rows", build)


def sequence_logprobs(logits: torch.Tensor, tree: Tree, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """log p(token_j | tokens_<j) of every sequence, laid out like ``tree.unpacked``; 0 at j = 0.

    ``logits`` (total, vocab) are over the packed rows; ``tokens`` (total,) default to ``tree.tokens``.
    The last row of a node predicts the first token of each of its children. Computed in float32
    (float64 stays float64); gradients of shared rows are summed. A token id outside ``[0, vocab)`` is a
    ValueError naming it (checked on the host: for tokens on a GPU that is one device-to-host copy of their
    range per call, once per tree for ``tree.tokens``).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() != 2 or logits.shape[0] != tree.total:
        raise ValueError(f"logits must be (total={tree.total}, vocab), got shape {tuple(logits.shape)}")
    tokens = tree.tokens if tokens is None else tokens
    if tokens is None:
        raise ValueError("no tokens: the tree was built without them and none were given")
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
    if tokens.shape != (tree.total,):
        raise ValueError(f"tokens must have shape ({tree.total},), got {tuple(tokens.shape)}")
    _check_token_ids(tokens, tree, logits.shape[1])
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tree = tree.to(logits.device)
    prev, first = _rows(tree)
    target = tokens.to(logits.device, torch.int64)[tree.sequence_index]
    lse = _RowLogsumexp.apply(logits, dtype)
    logp = logits[prev, target].to(dtype) - lse[prev]
    return torch.where(first, logp.new_zeros(()), logp)


def _check_token_ids(tokens: torch.Tensor, tree: Tree, vocab: int) -> None:
    """ValueError naming the first token id outside ``[0, vocab)`` (an index error, or a device-side assert
    on a GPU, otherwise)."""
    if tokens.numel() == 0 or torch.compiler.is_compiling():
        return
    if tokens is tree.tokens:  # the tree's own tokens: their range is read once per tree
        low, high = tree.cached("token_id_range", lambda: tuple(int(x) for x in torch.aminmax(tokens)))
    else:
        low, high = (int(x) for x in torch.aminmax(tokens))
    if low < 0 or high >= vocab:
        bad = int(((tokens < 0) | (tokens >= vocab)).nonzero()[0])
        raise ValueError(f"tokens[{bad}] = {int(tokens[bad])} is not a token id of logits with vocab {vocab} "
                         f"(ids must be in [0, {vocab}))")
