"""Implementations timed by `packattn bench`: ours (through `packattn.attention`) and the anchors,
each called directly so no dispatch overhead is charged to them.

Every factory takes (workload, device) and returns a callable ``f(q, k, v) -> out`` working on
the workload's THD tensors, or raises `Unavailable` with a reason.
"""

from __future__ import annotations

import torch.nn.functional as F

import packattn
from packattn.backends import get as get_backend
from packattn.bench.workloads import Workload
from packattn.mask import Mask
from packattn.varlen import Varlen


class Unavailable(Exception):
    pass


def ours(backend: str, **flags):
    def factory(w: Workload, seqs):
        why = get_backend(backend).unavailable()
        if why:
            raise Unavailable(why)
        if (backend == "triton_tree") == isinstance(seqs, Varlen) and backend in ("triton", "triton_tree"):
            raise Unavailable("triton_tree runs the tree workloads, triton the others")
        return lambda q, k, v: packattn.attention(q, k, v, seqs, backend=backend, **w.options, **flags)

    return factory


def torch_varlen(w: Workload, seqs):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise Unavailable(str(e)) from None
    mask = Mask.make(**w.options)
    if mask.chunk_size is not None or seqs.pad_between_seqs:
        raise Unavailable("varlen_attn has no chunks and no padding between sequences")
    group = w.heads_q // w.heads_kv

    def run(q, k, v):
        return varlen_attn(q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.max_seqlen_q, seqs.max_seqlen_kv,
                           window_size=(mask.left, mask.right))

    run.expand_kv = group  # K/V heads repeated outside the timed region (torch 2.11 has no GQA here)
    return run


def flex(w: Workload, seqs):
    from packattn.backends import flex as flex_backend

    if flex_backend.FlexBackend().unavailable():
        raise Unavailable(flex_backend.FlexBackend().unavailable())
    if isinstance(seqs, Varlen):
        block_mask = flex_backend.build_block_mask(seqs, Mask.make(**w.options))
    else:  # a tree: FlexAttention with a tree BlockMask on the packed tokens
        block_mask = flex_backend.build_tree_block_mask(seqs)
    compiled = flex_backend._compiled_flex()

    def run(q, k, v):
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = compiled(q4, k4, v4, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)

    return run


def sdpa_dense(w: Workload, seqs):
    """Dense causal SDPA over all tokens as one sequence: what this GPU does on one long sequence."""
    total = seqs.total_q

    def run(q, k, v):
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)

    run.flops = 4.0 * w.head_dim * w.heads_q * total * (total + 1) / 2
    return run


def fa4(w: Workload, seqs):
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        raise Unavailable(f"flash_attn.cute not importable ({type(e).__name__})") from None
    mask = Mask.make(**w.options)
    if mask.chunk_size is not None or seqs.pad_between_seqs:
        raise Unavailable("FA4 anchor runs unpadded, unchunked batches")
    window = (None if mask.left < 0 else mask.left, None if mask.right < 0 else mask.right)

    def run(q, k, v):
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=seqs.cu_seqlens_q, cu_seqlens_k=seqs.cu_seqlens_kv,
            max_seqlen_q=seqs.max_seqlen_q, max_seqlen_k=seqs.max_seqlen_kv, causal=mask.causal,
            window_size=window if mask.window is not None else (None, None),
        )
        return out[0] if isinstance(out, tuple) else out

    return run


IMPLS = {
    "packattn:triton": ours("triton"),
    "packattn:triton_tree": ours("triton_tree"),
    "packattn:flex": ours("flex"),
    "torch_varlen": torch_varlen,
    "flex": flex,
    "fa4": fa4,
    "sdpa_dense": sdpa_dense,
}
ANCHORS = ("torch_varlen", "flex", "fa4", "sdpa_dense")
EXPANDED_ANCHORS = ("torch_varlen", "fa4")  # on a tree workload they run the expanded batch
