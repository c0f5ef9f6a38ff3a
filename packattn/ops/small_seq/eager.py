"""The eager path of the small-seq op with little host time per call.

A small-seq call moves tens of megabytes in ~0.1 ms of GPU time, so its host time (the Python from
`packattn.attention` to the launches, and autograd's backward) can exceed its GPU time. In eager mode a
call runs `_Eager`, an autograd function over ``(q, k, v)`` alone, whose forward and backward repeat a
cached `Plan`: the kernel, grid, scalar arguments and keyword arguments that `op._launch` chose for the
first call of the same *call shape* (shapes, strides, dtypes and devices of q, k, v, the number of items,
scale, padding flags, ``kv_fill`` and the config tables of `configs`), launched through
`fast_launch.launch_keyed` keyed by the plan and the 16-byte alignment of the tensors. So a repeated call
builds no config, no keyword dictionary and no per-argument specialisation key, and slices no item table
(its rows are cached with it, `rows_of`).

What a plan repeats is what the first call launched: the first call of a shape (and any call whose
tables were swapped by `configs.override` since) goes through `op.fwd_impl` / `op.bwd_impl`, the same
functions the ``packattn::small_seq_*`` custom ops run, and later calls build their tensor arguments with
the same `op` helpers (`op.fwd_tensors`, `op.fwd_outputs`, ...), so both paths launch the same kernels with
the same arguments. While torch.compile traces, or for tensor subclasses, the custom op runs instead
(`op.small_seq_fwd`, through `fast_op.call`). Transforms of ``torch.func`` (grad, vmap, jacrev, ...) are
not supported (neither path defines what they need): a call under one raises a RuntimeError.
The gradients are not differentiable: a double backward raises (``once_differentiable``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from packattn.ops.runtime import fast_launch, fast_op
from packattn.ops.small_seq import configs, op

_PLANS_MAX = 64  # plans kept (a process sees a few call shapes); cleared when full
_plans: dict = {}


def _internals() -> tuple:
    """``(apply, unwrap_if_dead, functorch_active)`` from torch's private internals (torch 2.11 to 2.13 have them):
    ``Function.apply``'s C part, functorch's unwrapping of dead wrappers and its "any transform active"
    check. Where this torch lacks one of them: ``(None, None, <always False>)``, and calls take the public
    ``_Eager.apply`` (a torch.func transform then meets that function's own error), so a torch release that
    renames them cannot break ``import packattn``."""
    try:
        return (torch._C._FunctionBase.__dict__["apply"], torch._C._functorch.unwrap_if_dead,
                torch._C._are_functorch_transforms_active)
    except (AttributeError, KeyError, ImportError):
        return None, None, lambda: False


_apply_raw, _unwrap_if_dead, _functorch_active = _internals()


def rows_of(items: torch.Tensor) -> tuple:
    """``(items, (q_rows, kv_starts, kv_lens), aligned, num_items)`` of an item table (`op.build_items`):
    its rows as the kernels take them and whether each row is 16-byte aligned (cached with the table)."""
    rows = (items[0], items[1], items[2])
    return items, rows, tuple(r.data_ptr() % 16 == 0 for r in rows), items.shape[1]


class _Launch:
    """One kernel launch of a plan: the kernel, grid, the arguments after the tensors, the keyword arguments."""

    __slots__ = ("grid", "kernel", "kwargs", "table", "tail")

    def __init__(self, launched: tuple, tensors: int, table: dict):
        self.kernel, self.grid, args, self.kwargs = launched
        self.tail = args[tensors:]  # repeated as they are: a tensor among them would be frozen into the plan
        if not all(isinstance(a, torch.Tensor) for a in args[:tensors]) or any(
                isinstance(a, torch.Tensor) for a in self.tail):
            raise RuntimeError(f"small_seq plan: {self.kernel.__name__} was launched with tensors other than its "
                               f"first {tensors} arguments (op.FWD_TENSORS / op.BWD_TENSORS out of date?)")
        self.table = table  # the configs table it was chosen from (its identity: still in force?)

    def __call__(self, args: tuple, aligned: bool, rows_aligned: tuple) -> None:
        if aligned:
            fast_launch.launch_keyed(self.kernel, self.grid, args + self.tail, self.kwargs, (self, rows_aligned))
        else:  # some tensor is not 16-byte aligned: the launch keys each argument
            fast_launch.launch(self.kernel, self.grid, args + self.tail, self.kwargs)


class Plan:
    """The launches of one call shape: the forward's, and the backward's per gradient layout."""

    __slots__ = ("bwd", "fwd", "kv_fill", "padded_kv", "padded_q", "scale")

    def __init__(self, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int):
        self.scale, self.padded_q, self.padded_kv, self.kv_fill = scale, padded_q, padded_kv, kv_fill
        self.fwd: _Launch | None = None
        self.bwd: dict = {}  # (dout's strides and dtype, dlse's dtype or None) -> _Launch

    def forward(self, q, k, v, rows: tuple):
        launch = self.fwd
        if launch is None or launch.table is not configs.FWD:
            out, lse, launched = op.fwd_impl(q, k, v, rows[1], rows[3], self.scale, self.padded_q)
            self.fwd = None if launched is None else _Launch(launched, op.FWD_TENSORS, configs.FWD)
            return out, lse
        out, lse = op.fwd_outputs(q, self.padded_q)
        aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | lse.data_ptr()) & 15
        launch(op.fwd_tensors(q, k, v, out, lse, rows[1]), aligned, rows[2])
        return out, lse

    def backward(self, dout, dlse, q, k, v, rows: tuple):
        dout, dlse, has_dlse = op.bwd_grads(dout, dlse, q)
        key = (dout.stride(), dout.dtype, dlse.dtype if has_dlse else None)
        launch = self.bwd.get(key)
        if launch is None or launch.table is not configs.BWD:
            dq, dk, dv, launched = op.bwd_impl(dout, dlse if has_dlse else None, q, k, v, rows[1], rows[3],
                                               self.scale, self.padded_q, self.padded_kv, self.kv_fill)
            if launched is not None:
                self.bwd[key] = _Launch(launched, op.BWD_TENSORS, configs.BWD)
            return dq, dk, dv
        dq, dk, dv = op.bwd_outputs(q, k, v, self.padded_q, self.padded_kv)
        ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | dlse.data_ptr()
        aligned = not (ptrs | dq.data_ptr() | dk.data_ptr() | dv.data_ptr()) & 15
        launch(op.bwd_tensors(q, k, v, dout, dlse, dq, dk, dv, rows[1]), aligned, rows[2])
        return dq, dk, dv


def plan_for(q, k, v, num_items: int, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int) -> Plan | None:
    """The cached plan of this call shape; None when q, k or v has a strided last dim (`op.fwd_impl` copies those)."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, num_items, scale, padded_q, padded_kv, kv_fill)
    plan = _plans.get(key)
    if plan is None:
        if q.stride()[-1] != 1 or k.stride()[-1] != 1 or v.stride()[-1] != 1:
            return None
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        plan = _plans[key] = Plan(scale, padded_q, padded_kv, kv_fill)
    return plan


class _Eager(torch.autograd.Function):
    """The small-seq op over ``(q, k, v)`` with a `Plan` and the item table's `rows_of` (eager mode)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, rows: tuple):
        out, lse = plan.forward(q, k, v, rows)
        ctx.save_for_backward(q, k, v)
        ctx.plan, ctx.rows = plan, rows
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient: no dlse term
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(dout, dlse, q, k, v, ctx.rows)
        return dq, dk, dv, None, None


_eager_apply = None if _apply_raw is None else _apply_raw.__get__(None, _Eager)
_FUNC_UNSUPPORTED = ("packattn small_seq: torch.func transforms (grad, vmap, jvp, jacrev, ...) are not supported; "
                     "differentiate with torch.autograd.grad or .backward()")


def small_seq_fwd_call(q, k, v, items, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int, seqs=None):
    """``packattn::small_seq_fwd(q, k, v, items, scale, padded_q, padded_kv, kv_fill)`` -> ``(out, lse)``;
    ``seqs``: the `Varlen` that ``items`` is the cached table of (its `rows_of` is cached there too). Eager
    calls run `_Eager` (module docstring); RuntimeError under a torch.func transform."""
    plain = fast_op._PLAIN_TYPES
    if (type(q) not in plain or type(k) not in plain or type(v) not in plain or type(items) is not torch.Tensor
            or torch.compiler.is_compiling()):
        return fast_op.call(op.small_seq_fwd, op._SmallSeqFwdEager.apply, q, k, v, items, scale, padded_q,
                            padded_kv, kv_fill)
    if _functorch_active():
        raise RuntimeError(_FUNC_UNSUPPORTED)
    rows = rows_of(items) if seqs is None else seqs.cached("small_seq_item_rows", lambda: rows_of(items))
    plan = plan_for(q, k, v, rows[3], scale, padded_q, padded_kv, kv_fill)
    if plan is None:
        return op._SmallSeqFwdEager.apply(q, k, v, items, scale, padded_q, padded_kv, kv_fill)
    if _eager_apply is None:  # this torch lacks the internals (`_internals`)
        return _Eager.apply(q, k, v, plan, rows)
    # what Function.apply does outside functorch transforms: dead functorch wrappers unwrapped, then the C apply
    return _eager_apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), plan, rows)
