"""The eager path of the small-seq op with little host time per call.

A small-seq call moves tens of megabytes in ~0.1 ms of GPU time, so its host time (the Python from
`packattn.attention` to the launches, and autograd's backward) can exceed its GPU time. In eager mode a
call runs `_Eager`, an autograd function over ``(q, k, v)`` alone, whose forward and backward repeat a
cached `Plan`: the kernel, grid, scalar arguments and keyword arguments that `op._launch` chose for the
first call of the same *call shape* (shapes, strides, dtypes, device, scale, padding flags and the
config tables of `configs`), launched through `fast_launch.launch_keyed` keyed by the plan and the
16-byte alignment of the tensors. So a repeated call builds no config, no keyword dictionary and no
per-argument specialisation key, and slices no item table (its rows are cached with it, `rows_of`).

What a plan repeats is what the first call launched: the first call of a shape (and any call whose
tables were swapped by `configs.override` since) goes through `op.fwd_impl` / `op.bwd_impl`, the same
functions the ``packattn::small_seq_*`` custom ops run, so both paths launch the same kernels with the
same arguments. While torch.compile traces, for tensor subclasses or under functorch transforms, the
custom op runs instead (`op.small_seq_fwd`, through `fast_op.call`).
"""

from __future__ import annotations

import torch

from packattn.ops.runtime import fast_launch, fast_op
from packattn.ops.small_seq import configs, op

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_PLANS_MAX = 64  # plans kept (a process sees a few call shapes); cleared when full
_plans: dict = {}
_apply_raw = torch._C._FunctionBase.__dict__["apply"]  # autograd.Function.apply without its Python wrapper
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


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
        self.tail = args[tensors:]
        self.table = table  # the configs table it was chosen from (its identity: still in force?)

    def __call__(self, args: tuple, aligned: bool, rows_aligned: tuple) -> None:
        if aligned:
            fast_launch.launch_keyed(self.kernel, self.grid, args + self.tail, self.kwargs, (self, rows_aligned))
        else:  # some tensor is not 16-byte aligned: the launch keys each argument
            fast_launch.launch(self.kernel, self.grid, args + self.tail, self.kwargs)


class Plan:
    """The launches of one call shape: the forward's, and the backward's per gradient layout."""

    __slots__ = ("bwd", "fwd", "kv_fill", "padded_kv", "padded_q", "scale", "shape_kv", "shape_lse", "shape_q")

    def __init__(self, q, k, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int):
        self.scale, self.padded_q, self.padded_kv, self.kv_fill = scale, padded_q, padded_kv, kv_fill
        self.shape_q, self.shape_kv, self.shape_lse = q.shape, k.shape, (q.shape[1], q.shape[0])
        self.fwd: _Launch | None = None
        self.bwd: dict = {}  # (dout's strides and dtype, dlse's dtype or None) -> _Launch

    def forward(self, q, k, v, rows: tuple):
        launch = self.fwd
        if launch is None or launch.table is not configs.FWD:
            out, lse, launched = op.fwd_impl(q, k, v, rows[1], rows[3], self.scale, self.padded_q)
            self.fwd = None if launched is None else _Launch(launched, 8, configs.FWD)
            return out, lse
        if self.padded_q:
            out = q.new_zeros(self.shape_q)
            lse = q.new_full(self.shape_lse, float("-inf"), dtype=torch.float32)
        else:
            out = q.new_empty(self.shape_q)
            lse = q.new_empty(self.shape_lse, dtype=torch.float32)
        aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | lse.data_ptr()) & 15
        launch((q, k, v, out, lse, *rows[1]), aligned, rows[2])
        return out, lse

    def backward(self, dout, dlse, q, k, v, rows: tuple):
        if dout is None:
            dout = torch.zeros_like(q)
        elif dout.stride()[-1] != 1:
            dout = dout.contiguous()
        has_dlse = dlse is not None
        if has_dlse:
            dlse = dlse.contiguous()
        key = (dout.stride(), dout.dtype, dlse.dtype if has_dlse else None)
        launch = self.bwd.get(key)
        if launch is None or launch.table is not configs.BWD:
            dq, dk, dv, launched = op.bwd_impl(dout, dlse, q, k, v, rows[1], rows[3], self.scale, self.padded_q,
                                               self.padded_kv, self.kv_fill)
            if launched is not None:
                self.bwd[key] = _Launch(launched, 11, configs.BWD)
            return dq, dk, dv
        if not has_dlse:
            dlse = dout  # placeholder pointer (HAS_DLSE is off), as op.bwd_impl passes
        new = q.new_zeros if self.padded_q else q.new_empty
        dq = new(self.shape_q)
        new = k.new_zeros if self.padded_kv else k.new_empty
        dk, dv = new(self.shape_kv), new(self.shape_kv)
        ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | dlse.data_ptr()
        aligned = not (ptrs | dq.data_ptr() | dk.data_ptr() | dv.data_ptr()) & 15
        launch((q, k, v, dout, dlse, dq, dk, dv, *rows[1]), aligned, rows[2])
        return dq, dk, dv


def plan_for(q, k, v, num_items: int, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int) -> Plan | None:
    """The cached plan of this call shape; None when q, k or v has a strided last dim (`op.fwd_impl` copies those)."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device, num_items,
           scale, padded_q, padded_kv, kv_fill)
    plan = _plans.get(key)
    if plan is None:
        if q.stride()[-1] != 1 or k.stride()[-1] != 1 or v.stride()[-1] != 1 or v.shape != k.shape:
            return None
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        plan = _plans[key] = Plan(q, k, scale, padded_q, padded_kv, kv_fill)
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
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(dout, dlse, q, k, v, ctx.rows)
        return dq, dk, dv, None, None


_eager_apply = _apply_raw.__get__(None, _Eager)


def small_seq_fwd_call(q, k, v, items, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int, seqs=None):
    """``packattn::small_seq_fwd(q, k, v, items, scale, padded_q, padded_kv, kv_fill)`` -> ``(out, lse)``;
    ``seqs``: the `Varlen` that ``items`` is the cached table of (its `rows_of` is cached there too). Eager
    calls run `_Eager` (module docstring)."""
    if (type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN or type(items) is not torch.Tensor
            or torch.compiler.is_compiling() or _functorch_active()):
        return fast_op.call(op.small_seq_fwd, op._SmallSeqFwdEager.apply, q, k, v, items, scale, padded_q,
                            padded_kv, kv_fill)
    rows = rows_of(items) if seqs is None else seqs.cached("small_seq_item_rows", lambda: rows_of(items))
    plan = plan_for(q, k, v, rows[3], scale, padded_q, padded_kv, kv_fill)
    if plan is None:
        return op._SmallSeqFwdEager.apply(q, k, v, items, scale, padded_q, padded_kv, kv_fill)
    # what Function.apply does outside functorch transforms: dead functorch wrappers unwrapped, then the C apply
    return _eager_apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), plan, rows)
