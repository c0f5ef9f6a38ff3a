"""Collectives with autograd for context parallelism (any backend: gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's ``x`` (padded to ``max_rows``) stacked into ``(world * max_rows, ...)``.
    Backward: the gradients of all ranks summed, each rank keeping its own rows (reduce-scatter;
    a fixed reduction order, so deterministic for a fixed world size)."""

    @staticmethod
    def forward(ctx, x, max_rows: int, world: int, group):
        ctx.rows, ctx.max_rows, ctx.world, ctx.group = x.shape[0], max_rows, world, group
        out = x.new_empty(world * max_rows, *x.shape[1:])
        if world == 1:
            out.copy_(_pad_rows(x, max_rows))
        else:
            _all_gather(out, _pad_rows(x, max_rows), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        mine = grad.new_empty(ctx.max_rows, *grad.shape[1:])
        if ctx.world == 1:
            mine.copy_(grad)
        else:
            _reduce_scatter(mine, grad, group=ctx.group)
        return mine[: ctx.rows], None, None, None


def gather_rows(x: torch.Tensor, max_rows: int, world: int, group=None) -> torch.Tensor:
    """All-gather rows with a reduce-scatter backward; see `_GatherRows`."""
    return _GatherRows.apply(x, max_rows, world, group)


class _AllToAllRows(torch.autograd.Function):
    """Forward: ``x (world * rows, ...)`` cut into ``world`` equal blocks of rows; block ``j`` goes
    to rank ``j``, and block ``j`` of the result is what rank ``j`` sent here. Backward: the same
    exchange on the gradient (the exchange transposes the block matrix, so it is its own inverse)."""

    @staticmethod
    def forward(ctx, x, world: int, group):
        ctx.world, ctx.group = world, group
        return _exchange(x, world, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.world, ctx.group), None, None


def _exchange(x: torch.Tensor, world: int, group) -> torch.Tensor:
    x = x.contiguous()
    if world == 1 or x.numel() == 0:  # the same on every rank of the group: its ranks exchange equal blocks
        return x.clone()
    if x.shape[0] % world:
        raise ValueError(f"all_to_all_rows needs a multiple of world={world} rows, got {x.shape[0]}")
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """All-to-all of equal blocks of rows with an all-to-all backward; see `_AllToAllRows`."""
    return _AllToAllRows.apply(x, world, group)
