"""The small-sequence op (one query over at most 16 keys per sequence): item tables, launchers,
``torch.library`` custom ops, and the limits of its kernels.

Kernels live in `packattn.ops.small_seq.kernels`. A batch is a list of *items* described by an int32
table ``(3, items)`` with rows ``q_rows`` (physical row of the item's query, -1 when it has none),
``kv_starts`` (physical row of its first key) and ``kv_lens`` (0..16). For a `Varlen` it is built
with device ops only (no host sync) and cached on the descriptor; for a dense ``(B, S, H, D)``
batch (`packattn.small_seq.small_seq_attention`) it is ``[b, b * S, kv_lengths[b]]``, so K/V are
read in place.

The forward (``packattn::small_seq_fwd``) returns ``(out, lse, P)``; ``P`` (float32
``(items, heads_q, 16)``, the softmax) is kept for the backward (``packattn::small_seq_bwd``),
which is deterministic (no atomics) and takes the gradient flowing into ``lse`` as well.
"""

from __future__ import annotations

import torch

from packattn.ops.runtime import fast_op
from packattn.ops.runtime.launch import LOG2E, _fix_interpreter_loop_bounds, _last_dim_contiguous
from packattn.ops.runtime.support import device_unsupported, interpreting
from packattn.varlen import Varlen

MAX_KEYS = 16  # BLOCK_S of the kernels
HEAD_DIMS = (64, 128, 256, 512)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Warps per program by head dim: time grows with the warps at every head dim, so 1 warp, also at 256 where
# ptxas reports spills; at 512 one warp spills kilobytes in the backward, and 2 warps measured best
# (benchmarks/NOTES.md, small_seq v1).
NUM_WARPS = {64: 1, 128: 1, 256: 1, 512: 2}


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


# ---------------------------------------------------------------- launchers / custom ops
def _launch(kernel, grid: int, args: tuple, constexprs: dict, head_dim: int) -> None:
    if grid == 0:
        return
    if interpreting():
        _fix_interpreter_loop_bounds()
        num_warps = 1
    else:
        num_warps = NUM_WARPS[head_dim]
    kernel[(grid,)](*args, **constexprs, BLOCK_S=MAX_KEYS, num_warps=num_warps, num_stages=1)


def _small_seq_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: torch.Tensor,
    scale: float, padded_q: bool, padded_kv: bool, kv_fill: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, P)``; ``padded_q``: some query rows belong to no item (zeros / -inf there).
    ``padded_kv`` and ``kv_fill`` are only carried for the backward."""
    from packattn.ops.small_seq.kernels import small_seq_fwd_kernel

    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    total_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    num_items = items.shape[1]
    out = q.new_zeros(q.shape) if padded_q else q.new_empty(q.shape)
    lse = torch.full((heads_q, total_q), float("-inf"), dtype=torch.float32, device=q.device) if padded_q else \
        torch.empty((heads_q, total_q), dtype=torch.float32, device=q.device)
    p = torch.empty((num_items, heads_q, MAX_KEYS), dtype=torch.float32, device=q.device)
    args = (q, k, v, out, lse, p, items[0], items[1], items[2],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), p.stride(0), p.stride(1),
            heads_kv, heads_q // heads_kv, scale * LOG2E)
    _launch(small_seq_fwd_kernel, num_items * heads_kv, args, dict(HEAD_DIM=head_dim, BLOCK_D=head_dim), head_dim)
    return out, lse, p


small_seq_fwd = torch.library.custom_op("packattn::small_seq_fwd", _small_seq_fwd, mutates_args=())


@small_seq_fwd.register_fake
def _small_seq_fwd_fake(q, k, v, items, *rest):
    total_q, heads_q, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((heads_q, total_q), dtype=torch.float32),
            q.new_empty((items.shape[1], heads_q, MAX_KEYS), dtype=torch.float32))


def _small_seq_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    p: torch.Tensor, items: torch.Tensor, scale: float, padded_q: bool, padded_kv: bool, kv_fill: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from the saved softmax ``p``; ``dlse`` (or None): the gradient into lse."""
    from packattn.ops.small_seq.kernels import small_seq_bwd_kernel

    dout, q, k, v = (_last_dim_contiguous(x) for x in (dout, q, k, v))
    p = p.contiguous()
    heads_q, head_dim = q.shape[1], q.shape[2]
    heads_kv = k.shape[1]
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else p  # placeholder pointer when there is none
    dq = q.new_zeros(q.shape) if padded_q else q.new_empty(q.shape)
    dk = k.new_zeros(k.shape) if padded_kv else k.new_empty(k.shape)
    dv = v.new_zeros(v.shape) if padded_kv else v.new_empty(v.shape)
    args = (q, k, v, p, dout, dlse, dq, dk, dv, items[0], items[1], items[2],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            p.stride(0), p.stride(1), dout.stride(0), dout.stride(1), dlse.stride(0),
            dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            heads_kv, heads_q // heads_kv, scale, kv_fill)
    _launch(small_seq_bwd_kernel, items.shape[1] * heads_kv, args,
            dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, HAS_DLSE=has_dlse), head_dim)
    return dq, dk, dv


small_seq_bwd = torch.library.custom_op("packattn::small_seq_bwd", _small_seq_bwd, mutates_args=())


@small_seq_bwd.register_fake
def _small_seq_bwd_fake(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, items, *options = inputs
    _, _, p = output
    ctx.save_for_backward(q, k, v, p, items)
    ctx.options = options  # scale, padded_q, padded_kv, kv_fill
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: no dlse term


def _backward_through(bwd):
    """The backward of ``packattn::small_seq_fwd`` computing its gradients with ``bwd`` (the
    ``packattn::small_seq_bwd`` op, or its implementation on the eager path, `fast_op`)."""

    def backward(ctx, dout, dlse, _dp):
        q, k, v, p, items = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        dq, dk, dv = bwd(dout, dlse, q, k, v, p, items, *ctx.options)
        return dq, dk, dv, None, None, None, None, None

    return backward


small_seq_fwd.register_autograd(_backward_through(small_seq_bwd), setup_context=_setup_context)
_SmallSeqFwdEager = fast_op.eager_function(_small_seq_fwd, _setup_context, _backward_through(_small_seq_bwd))


def small_seq_fwd_call(*args):
    """``packattn::small_seq_fwd(*args)`` through `fast_op.call` (a plain autograd function in eager mode)."""
    return fast_op.call(small_seq_fwd, _SmallSeqFwdEager.apply, *args)
