"""Launchers of the portable Triton varlen kernels (`packattn.ops.varlen.fwd_triton`, `bwd_triton`) and the
outputs they write. Float32 inputs use ``tl.dot(..., input_precision="ieee")``: exact float32 products (no
TF32), slower than TF32 on tensor cores. ``seq_args = (cu_seqlens_q, cu_seqlens_kv, row_offsets_q,
row_offsets_kv)``; ``scale >= 0`` (`launch.nonnegative_scale`); the tile tables are built with
`configs.triton_config`'s blocks. MLA: V, out, dO, dV have v's head dim (may differ from q/k's).
"""

from __future__ import annotations

import torch

from packattn.mask import Mask
from packattn.ops.runtime import fast_launch
from packattn.ops.runtime.launch import (LOG2E, NO_MASK, _launch, _precision, block_d, mask_constexprs,
                                         mask_scalars)
from packattn.ops.varlen.configs import PREPROCESS_BLOCK_M, triton_config


def new_output(shape, dtype, device, padded: bool, pad_rows: torch.Tensor | None, fill: float = 0.0,
               dim: int = 0) -> torch.Tensor:
    """An output the kernels write except on rows in no sequence: those hold ``fill``. With the
    padding rows known only they are filled, otherwise the whole tensor."""
    if not padded:
        return torch.empty(shape, dtype=dtype, device=device)
    if pad_rows is None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    if fill == 0 and dim == 0:
        _zero_rows(out, pad_rows)
    else:
        out.index_fill_(dim, pad_rows, fill)
    return out


def _zero_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out.index_fill_(0, rows, 0)`` on a contiguous ``out``, with each row seen as the widest integers
    its bytes divide into (zero bits are zero in every dtype): the fill kernel then handles 4x fewer
    elements for 16-bit rows."""
    row_bytes = out[0].numel() * out.element_size() if out.shape[0] else 0
    wide = next((t for t in (torch.int64, torch.int32, torch.int16) if row_bytes % t.itemsize == 0), None)
    if wide is None or not out.is_contiguous() or out.numel() == 0:
        out.index_fill_(0, rows, 0)
        return
    out.view(out.shape[0], row_bytes // out.element_size()).view(wide).index_fill_(0, rows, 0)


def triton_fwd(q, k, v, out, lse, seq_args, q_tiles, scale: float, mask: Mask, long_seqs: bool) -> None:
    """The forward into ``out`` / ``lse``: one program per (query tile, query head)."""
    from packattn.ops.varlen.fwd_triton import varlen_fwd_kernel

    heads_q, head_dim, head_dim_v = q.shape[1], q.shape[2], v.shape[2]
    config = triton_config("fwd", q, v, long_seqs)
    args = (q, k, v, out, lse, q_tiles, *seq_args,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            heads_q, heads_q // k.shape[1], scale * LOG2E, *mask_scalars(mask))
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), HEAD_DIM_V=head_dim_v, BLOCK_DV=block_d(head_dim_v),
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, INPUT_PRECISION=_precision(q.dtype), **mask_constexprs(mask))
    _launch(varlen_fwd_kernel, (q_tiles.shape[0] * heads_q,), args, constexprs, config)


def bwd_delta(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``rowsum(dO * O) - dlse`` (float32, lse's shape): the backward preprocess, over O's (the value) head dim."""
    from packattn.ops.varlen.bwd_triton import bwd_preprocess_kernel

    total_q, heads_q, head_dim = out.shape
    delta = torch.empty_like(lse)
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else delta  # placeholder pointer when there is no dlse
    grid = (-(-total_q // PREPROCESS_BLOCK_M), heads_q)
    if grid[0] > 0:
        fast_launch.launch(bwd_preprocess_kernel, grid, (out, dout, lse, dlse, delta, total_q, *out.stride()[:2],
                                                         *dout.stride()[:2], delta.stride()[0]),
                           dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=PREPROCESS_BLOCK_M,
                                HAS_DLSE=has_dlse))
    return delta


def _qkv_do_strides(q, k, v, dout) -> tuple:
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1))


def _bwd_constexprs(head_dim: int, head_dim_v: int, dtype: torch.dtype, mask: Mask) -> dict:
    """The constexprs both Triton backward passes take."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), HEAD_DIM_V=head_dim_v, BLOCK_DV=block_d(head_dim_v),
                INPUT_PRECISION=_precision(dtype), **mask_constexprs(mask))


# The mask scalars of a tree dK/dV launch (unused: the constexprs say no window / chunk). Zeros, not
# `mask_scalars(NO_MASK)`: Triton specialises integer arguments on their value, and these keep the tree
# kernel's specialisation (the same PTX as before).
TREE_SCALARS = (0, 0, 0)


def triton_dkdv(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale: float, mask: Mask,
                key_end: torch.Tensor | None = None) -> None:
    """dK/dV pass over key tiles (`bwd_triton.bwd_dkdv_kernel`); ``key_end`` (int32 `Tree.row_subtree_end`):
    the tree mask instead of ``mask`` (which is then ignored, as in `launch_sm90.gluon_dkdv`)."""
    from packattn.ops.varlen.bwd_triton import bwd_dkdv_kernel

    heads_kv = k.shape[1]
    tree = key_end is not None
    if tree:
        mask = NO_MASK  # no window / chunk: the constexprs select the tree mask alone
    config = triton_config("dkdv", q, v)
    args = (q, k, v, dout, lse, delta, dk, dv, tiles, *seq_args, key_end if tree else tiles,
            *_qkv_do_strides(q, k, v, dout), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
            heads_kv, q.shape[1] // heads_kv, scale * LOG2E, scale, *(TREE_SCALARS if tree else mask_scalars(mask)))
    _launch(bwd_dkdv_kernel, (tiles.shape[0] * heads_kv,), args,
            dict(_bwd_constexprs(q.shape[-1], v.shape[-1], q.dtype, mask), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 TREE=tree), config)


def triton_dq(q, k, v, dout, lse, delta, dq, tiles, seq_args, scale: float, mask: Mask) -> None:
    """dQ pass over query tiles (`bwd_triton.bwd_dq_kernel`)."""
    from packattn.ops.varlen.bwd_triton import bwd_dq_kernel

    heads_q, head_dim, head_dim_v = q.shape[1], q.shape[2], v.shape[2]
    config = triton_config("dq", q, v)
    args = (q, k, v, dout, lse, delta, dq, tiles, *seq_args, *_qkv_do_strides(q, k, v, dout),
            dq.stride(0), dq.stride(1), lse.stride(0), heads_q, heads_q // k.shape[1], scale * LOG2E, scale,
            *mask_scalars(mask))
    _launch(bwd_dq_kernel, (tiles.shape[0] * heads_q,), args,
            dict(_bwd_constexprs(head_dim, head_dim_v, q.dtype, mask), BLOCK_M=config.block_m, BLOCK_N=config.block_n), config)
