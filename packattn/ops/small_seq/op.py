"""The small-sequence op (one query over at most 16 keys per sequence): item tables, launchers,
``torch.library`` custom ops, and the limits of its kernels.

Kernels live in `packattn.ops.small_seq.kernels_mma` (tensor cores; units of one item) and
`packattn.ops.small_seq.kernels_stack` (units of several items' query rows stacked in one tile);
`packattn.ops.small_seq.configs` picks one and its launch shape per pass, head dim and GQA group. A batch is a list of *items* described by an int32 table
``(3, items)`` with rows ``q_rows`` (physical row of the item's query, -1 when it has none),
``kv_starts`` (physical row of its first key) and ``kv_lens`` (0..16). For a `Varlen` it is built
with device ops only (no host sync) and cached on the descriptor; for a dense ``(B, S, H, D)``
batch (`packattn.small_seq.small_seq_attention`) it is ``[b, b * S, kv_lengths[b]]``, so K/V are
read in place.

The forward (``packattn::small_seq_fwd``) returns ``(out, lse)``; the backward
(``packattn::small_seq_bwd``) recomputes the softmax from q and k (it reads them anyway), is
deterministic (no atomics) and takes the gradient flowing into ``lse`` as well.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from torch.autograd.function import once_differentiable

from packattn.ops.runtime import fast_launch, fast_op
from packattn.ops.runtime.launch import (
    LOG2E,
    _fix_interpreter_loop_bounds,
    _last_dim_contiguous,
)
from packattn.ops.runtime.support import device_unsupported, interpreting
from packattn.ops.small_seq import configs
from packattn.varlen import Varlen

MAX_KEYS = 16  # BLOCK_S of the kernels
HEAD_DIMS = configs.HEAD_DIMS
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_unsupported(device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> str | None:
    """Device, dtype and head-dim limits of the kernels (shared with the dense entry point)."""
    if (why := device_unsupported(device_type)) is not None:
        return why
    if dtype not in DTYPES:
        return f"dtype {dtype} not supported (float16, bfloat16, float32)"
    if head_dim != head_dim_v:
        return f"head dims {head_dim}/{head_dim_v}: q and v head dims must be equal"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    return None


# ---------------------------------------------------------------- item tables (device ops only)
def build_items(seqs: Varlen) -> torch.Tensor:
    """``int32 (3, num_seqs)``: ``q_rows`` (-1 for a sequence with no query), ``kv_starts``, ``kv_lens``."""
    q_rows = torch.where(seqs.seqlens_q > 0, seqs.starts_q, -1)
    return torch.stack([q_rows, seqs.starts_kv, seqs.seqlens_kv]).to(torch.int32).contiguous()


def item_table(seqs: Varlen) -> torch.Tensor:
    return seqs.cached("small_seq_items", lambda: build_items(seqs))


def dense_items(kv_lengths: torch.Tensor, seqlen_kv: int) -> torch.Tensor:
    """Items of a dense batch ``k (B, seqlen_kv, H, D)``: item ``b`` reads rows ``b * seqlen_kv + s``.
    Lengths are clamped to ``[0, seqlen_kv]`` on the device (checking them would sync)."""
    b = torch.arange(kv_lengths.shape[0], device=kv_lengths.device, dtype=torch.int32)
    lens = kv_lengths.clamp(0, seqlen_kv).to(torch.int32)
    return torch.stack([b, b * seqlen_kv, lens]).contiguous()


# ---------------------------------------------------------------- the kernels' tensor arguments
# Each kernel takes its tensors first (`fwd_tensors`, `bwd_tensors`: FWD_TENSORS / BWD_TENSORS of them), then
# their strides and the launch's scalars. `packattn.ops.small_seq.eager` repeats a launch with new tensors
# built by these same functions and keeps everything after the first FWD_TENSORS / BWD_TENSORS arguments.
FWD_TENSORS = 8
BWD_TENSORS = 11


def fwd_tensors(q, k, v, out, lse, rows: tuple) -> tuple:
    """The forward kernel's tensor arguments; ``rows``: the item table's ``(q_rows, kv_starts, kv_lens)``."""
    return (q, k, v, out, lse, *rows)


def bwd_tensors(q, k, v, dout, dlse, dq, dk, dv, rows: tuple) -> tuple:
    """The backward kernel's tensor arguments (``rows`` as in `fwd_tensors`)."""
    return (q, k, v, dout, dlse, dq, dk, dv, *rows)


def fwd_outputs(q: torch.Tensor, padded_q: bool) -> tuple:
    """``(out, lse)`` for the forward kernel: ``padded_q``: zeros / -inf on the rows of no item (the
    kernel writes only item rows)."""
    shape_lse = (q.shape[1], q.shape[0])
    if padded_q:
        return q.new_zeros(q.shape), q.new_full(shape_lse, float("-inf"), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(shape_lse, dtype=torch.float32)


def bwd_grads(dout, dlse, q) -> tuple:
    """``(dout, dlse, has_dlse)`` as the backward kernel takes them: dout zeros when None (only lse had a
    gradient) and last-dim contiguous; dlse contiguous, or dout as a placeholder pointer when None (the
    kernel's HAS_DLSE is off then)."""
    if dout is None:
        dout = torch.zeros_like(q)
    elif dout.stride()[-1] != 1:
        dout = dout.contiguous()
    if dlse is None:
        return dout, dout, False
    return dout, dlse.contiguous(), True


def bwd_outputs(q, k, v, padded_q: bool, padded_kv: bool) -> tuple:
    """``(dq, dk, dv)`` for the backward kernel: zeros where ``padded_q`` / ``padded_kv`` (rows of no item)."""
    dq = q.new_zeros(q.shape) if padded_q else q.new_empty(q.shape)
    if padded_kv:
        return dq, k.new_zeros(k.shape), v.new_zeros(v.shape)
    return dq, k.new_empty(k.shape), v.new_empty(v.shape)


# ---------------------------------------------------------------- launchers / custom ops
_shrunk: dict = {}  # (pass, config, head_dim, group, heads_kv, dtype) -> the smaller config that launched


def _smaller(config: configs.SmallSeqConfig) -> configs.SmallSeqConfig | None:
    """What to try when ``config`` needs more shared memory than an SM has: fewer kv heads per unit, then
    fewer items per unit, then one pipeline buffer, then no pipelining; None: nothing smaller."""
    if config.block_h > 1:
        return replace(config, block_h=config.block_h // 2)
    if config.items > 1:
        return replace(config, items=config.items // 2)
    if config.num_stages > 1:
        return replace(config, num_stages=3 if config.num_stages > 3 else 1)
    return None


def _launch(kind: str, args: tuple, scalars: tuple, num_items: int, heads_kv: int, group: int,
            dtype: torch.dtype, head_dim: int, extra: dict) -> tuple | None:
    """Launch pass ``kind`` ("fwd" / "bwd") with its config (`_smaller` ones where it does not fit an SM):
    ``args`` are the tensors and strides, ``scalars`` the trailing ``(heads_kv, group, ...)`` arguments
    (``heads_kv`` goes as constexpr ``HEAD_BLOCKS``: the stacked kernels take ``num_items`` there).
    Returns what `_launch_config` launched, ``(kernel, grid, args, kwargs)``, None when nothing launched
    (`packattn.ops.small_seq.eager` repeats it for later calls of the same shape)."""
    if num_items == 0:
        return None
    if interpreting():
        _fix_interpreter_loop_bounds()
    from triton.runtime.errors import OutOfResources

    config = configs.lookup(kind, head_dim, group)
    key = (kind, config, head_dim, group, heads_kv, dtype)
    config = _shrunk.get(key, config)
    while True:
        try:
            return _launch_config(kind, config, args, scalars, num_items, heads_kv, group, dtype, head_dim, extra)
        except OutOfResources as e:
            smaller = _smaller(config)
            if smaller is None:
                raise
            warnings.warn(f"packattn small_seq: {e}; {config.describe()} -> {smaller.describe()}", stacklevel=2)
            config = _shrunk[key] = smaller


def _launch_config(kind: str, config: configs.SmallSeqConfig, args: tuple, scalars: tuple, num_items: int,
                   heads_kv: int, group: int, dtype: torch.dtype, head_dim: int, extra: dict) -> tuple:
    from packattn.ops.small_seq import kernels_mma, kernels_stack

    bh = configs.block_h(config, heads_kv)
    head_blocks = -(-heads_kv // bh)
    kwargs = dict(extra, BLOCK_D=head_dim // config.d_chunks, D_CHUNKS=config.d_chunks, BLOCK_S=MAX_KEYS,
                  BLOCK_G=configs.block_g(group, kind == "bwd", config.items), HEAD_BLOCKS=head_blocks,
                  STAGES=config.num_stages, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                  num_warps=bh if bh > 1 else config.num_warps, num_stages=1)
    if config.items > 1:
        kernel = kernels_stack.small_seq_fwd_stack_kernel if kind == "fwd" else kernels_stack.small_seq_bwd_stack_kernel
        num_units = -(-num_items // config.items) * heads_kv
        kwargs["STACK"] = config.items
        scalars = (num_items, *scalars[1:])
    else:
        kernel = kernels_mma.small_seq_fwd_mma_kernel if kind == "fwd" else kernels_mma.small_seq_bwd_mma_kernel
        num_units = num_items * head_blocks
        kwargs["BLOCK_H"] = bh
    grid = (-(-num_units // config.units),)
    args = (*args, num_units, config.units, *scalars)
    fast_launch.launch(kernel, grid, args, kwargs)
    return kernel, grid, args, kwargs


def _small_seq_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: torch.Tensor,
    scale: float, padded_q: bool, padded_kv: bool, kv_fill: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``padded_q``: some query rows belong to no item (zeros / -inf there).
    ``padded_kv`` and ``kv_fill`` are only carried for the backward."""
    return fwd_impl(q, k, v, (items[0], items[1], items[2]), items.shape[1], scale, padded_q)[:2]


def fwd_impl(q, k, v, rows: tuple, num_items: int, scale: float, padded_q: bool):
    """`_small_seq_fwd` on the item table's rows ``rows``: ``(out, lse, launched)`` (`_launch`'s result)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    heads_q, head_dim = q.shape[1], q.shape[2]
    heads_kv = k.shape[1]
    out, lse = fwd_outputs(q, padded_q)
    args = (*fwd_tensors(q, k, v, out, lse, rows),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0))
    group = heads_q // heads_kv
    launched = _launch("fwd", args, (heads_kv, group, scale * LOG2E), num_items, heads_kv, group, q.dtype, head_dim, {})
    return out, lse, launched


small_seq_fwd = torch.library.custom_op("packattn::small_seq_fwd", _small_seq_fwd, mutates_args=())


@small_seq_fwd.register_fake
def _small_seq_fwd_fake(q, k, v, items, *rest):
    total_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((heads_q, total_q), dtype=torch.float32)


def _small_seq_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    items: torch.Tensor, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``; ``dlse`` (or None): the gradient into lse."""
    return bwd_impl(dout, dlse, q, k, v, (items[0], items[1], items[2]), items.shape[1], scale, padded_q, padded_kv,
                    kv_fill)[:3]


def bwd_impl(dout, dlse, q, k, v, rows: tuple, num_items: int, scale: float, padded_q: bool, padded_kv: bool,
             kv_fill: int):
    """`_small_seq_bwd` on the item table's rows ``rows``: ``(dq, dk, dv, launched)`` (`_launch`'s result)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    dout, dlse, has_dlse = bwd_grads(dout, dlse, q)
    heads_q, head_dim = q.shape[1], q.shape[2]
    heads_kv = k.shape[1]
    dq, dk, dv = bwd_outputs(q, k, v, padded_q, padded_kv)
    args = (*bwd_tensors(q, k, v, dout, dlse, dq, dk, dv, rows),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dlse.stride(0),
            dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1))
    group = heads_q // heads_kv
    launched = _launch("bwd", args, (heads_kv, group, scale, scale * LOG2E, kv_fill), num_items, heads_kv, group,
                       q.dtype, head_dim, {"HAS_DLSE": has_dlse})
    return dq, dk, dv, launched


small_seq_bwd = torch.library.custom_op("packattn::small_seq_bwd", _small_seq_bwd, mutates_args=())


@small_seq_bwd.register_fake
def _small_seq_bwd_fake(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, items, *options = inputs
    ctx.save_for_backward(q, k, v, items)
    ctx.options = options  # scale, padded_q, padded_kv, kv_fill
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: no dlse term


def _backward_through(bwd):
    """The backward of ``packattn::small_seq_fwd`` computing its gradients with ``bwd`` (the
    ``packattn::small_seq_bwd`` op, or its implementation on the eager path, `fast_op`)."""

    def backward(ctx, dout, dlse):
        q, k, v, items = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        dq, dk, dv = bwd(dout, dlse, q, k, v, items, *ctx.options)
        return dq, dk, dv, None, None, None, None, None

    return backward


small_seq_fwd.register_autograd(_backward_through(small_seq_bwd), setup_context=_setup_context)
# the kernels' gradients are not differentiable: a double backward (create_graph=True) raises instead of
# silently dropping the second-order terms
_SmallSeqFwdEager = fast_op.eager_function(_small_seq_fwd, _setup_context,
                                           once_differentiable(_backward_through(_small_seq_bwd)))
