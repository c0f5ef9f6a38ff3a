"""Collectives with autograd for context parallelism (any backend: gloo on CPU, NCCL on GPUs),
and the asynchronous halves they are made of (`start_gather_rows`, `start_reduce_scatter_rows`),
for executors that overlap communication with compute."""

from __future__ import annotations

import dataclasses

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
        return start_gather_rows(x, max_rows, world, group).wait()

    @staticmethod
    def backward(ctx, grad):
        mine = start_reduce_scatter_rows(grad, ctx.rows, ctx.max_rows, ctx.world, ctx.group).wait()
        return mine, None, None, None


@dataclasses.dataclass
class Pending:
    """A collective issued with ``async_op=True``: ``wait()`` returns its result once it is complete
    (on CUDA: once the current stream is ordered after it, without blocking the host)."""

    result: torch.Tensor  # not valid before wait()
    work: object | None  # the torch.distributed work handle; None when nothing was communicated
    sent: torch.Tensor | None  # the collective's input, kept alive until it completes

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = self.sent = None
        return self.result


def start_gather_rows(x: torch.Tensor, max_rows: int, world: int, group=None) -> Pending:
    """Issue the all-gather of `gather_rows` (no autograd): every rank's ``x`` (padded to
    ``max_rows``) stacked into ``(world * max_rows, ...)``."""
    sent = _pad_rows(x, max_rows)
    out = x.new_empty(world * max_rows, *x.shape[1:])
    if world == 1:
        return Pending(out.copy_(sent), None, None)
    return Pending(out, _all_gather(out, sent, group=group, async_op=True), sent)


def start_reduce_scatter_rows(grad: torch.Tensor, rows: int, max_rows: int, world: int, group=None) -> Pending:
    """Issue the reduce-scatter of `gather_rows`'s backward (no autograd): ``grad (world *
    max_rows, ...)`` summed over ranks in a fixed order; the result is this rank's first ``rows``."""
    grad = grad.contiguous()
    mine = grad.new_empty(max_rows, *grad.shape[1:])
    if world == 1:
        return Pending(mine.copy_(grad)[:rows], None, None)
    return Pending(mine[:rows], _reduce_scatter(mine, grad, group=group, async_op=True), grad)


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
