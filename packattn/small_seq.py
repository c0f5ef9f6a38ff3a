"""`small_seq_attention`: one query per item over at most 16 keys, on a dense batch.

Recommendation / retrieval models cross-attend one query per item to a handful of keys for tens
of thousands of items. For a packed (THD) batch, `packattn.attention` with a `Varlen` of query
lengths 0/1 and key lengths <= 16 dispatches to the same kernels (backend ``small_seq``).
"""

from __future__ import annotations

import math

import torch

from packattn.ops.small_seq.eager import small_seq_fwd_call
from packattn.ops.small_seq.op import MAX_KEYS, dense_items, kernel_unsupported

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BACKENDS = ("auto", "small_seq", "reference")
_INT32_MAX = 2**31 - 1


def small_seq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths, *,
                        scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention of one query per item over its first ``kv_lengths[b]`` keys.

    * ``q (B, heads_q, D)``, ``k (B, S, heads_kv, D)``, ``v (B, S, heads_kv, Dv)`` with ``S <= 16``
      and ``heads_q % heads_kv == 0`` (GQA/MQA);
    * ``kv_lengths``: ``(B,)`` integers in ``[0, S]`` (a tensor, list or tuple). Host values (a list,
      a CPU tensor) are checked; values in a GPU tensor are clamped to ``[0, S]`` on the device,
      since checking them would wait for the GPU;
    * returns ``(B, heads_q, Dv)`` in q's dtype; an item with no key gives zeros.

    ``backend``: ``"auto"`` runs the Triton kernels on CUDA when they support the call (head dims
    64/128/256/512, fp16/bf16/fp32, ``Dv == D``; K/V are read in place, no copy of contiguous
    inputs) and a plain PyTorch computation otherwise; ``"small_seq"`` insists on the kernels
    (ValueError naming why when they cannot run); ``"reference"`` is the plain computation.
    """
    _check_tensors(q, k, v)
    batch, _, head_dim = q.shape
    seqlen_kv, heads_kv = k.shape[1], k.shape[2]
    lengths = _check_lengths(kv_lengths, batch, seqlen_kv, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    why = kernel_unsupported(q.device.type, q.dtype, head_dim, v.shape[-1])
    if backend == "small_seq" and why is not None:
        raise ValueError(f"backend='small_seq' cannot run this call: {why}")
    if backend == "reference" or why is not None or (backend == "auto" and q.device.type != "cuda"):
        return small_seq_reference(q, k, v, lengths, float(scale))
    if batch * seqlen_kv > _INT32_MAX:
        raise ValueError(f"{batch} items x {seqlen_kv} keys overflow the kernels' int32 row numbers")
    rows = batch * seqlen_kv
    out, _ = small_seq_fwd_call(
        q, k.reshape(rows, heads_kv, head_dim), v.reshape(rows, heads_kv, v.shape[-1]),
        dense_items(lengths, seqlen_kv), float(scale), False, False, seqlen_kv)
    return out


def small_seq_reference(q, k, v, kv_lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain PyTorch: float32 scores (float64 for float64 inputs), keys past each length masked.

    K/V slots past an item's length are never read into the result: whatever they hold (NaN, inf,
    stale data), the output and the gradients of q, k, v are those of the valid keys alone, and the
    slots' gradients are zeros."""
    batch, heads_q, head_dim = q.shape
    seqlen_kv, heads_kv = k.shape[1], k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    slots = torch.arange(seqlen_kv, device=q.device)[None, :] < kv_lengths[:, None]  # (B, S)
    # zeros in the unused slots before any product: masking the scores alone still multiplies the
    # probabilities (0) by NaN values in v, and q's gradient by NaN keys
    k = torch.where(slots[:, :, None, None], k, k.new_zeros(()))
    v = torch.where(slots[:, :, None, None], v, v.new_zeros(()))
    qg = q.to(acc).view(batch, heads_kv, heads_q // heads_kv, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k.to(acc)) * scale
    valid = slots[:, None, None, :]
    scores = scores.masked_fill(~valid, float("-inf"))
    top = scores.amax(-1, keepdim=True) if seqlen_kv else scores.new_zeros(*scores.shape[:-1], 1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = torch.exp(scores - top) * valid
    denom = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v.to(acc))
    return out.reshape(batch, heads_q, v.shape[-1]).to(q.dtype)


def _check_tensors(q, k, v) -> None:
    for name, t, dims in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; small_seq_attention takes float16, bfloat16, float32 "
                            "or float64")
        if t.dim() != dims:
            layout = "(B, heads_q, D)" if dims == 3 else "(B, S, heads_kv, D)"
            raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0]:
        raise ValueError(f"q, k, v batch/key/head sizes disagree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] > MAX_KEYS:
        raise ValueError(f"k, v hold {k.shape[1]} keys per item; small_seq_attention takes at most {MAX_KEYS}")
    heads_q, heads_kv = q.shape[1], k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for GQA/MQA")
    if q.shape[2] != k.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != k head_dim {k.shape[3]}")
    if q.shape[2] == 0 or v.shape[3] == 0:
        raise ValueError("head_dim must be positive")


def _check_lengths(kv_lengths, batch: int, seqlen_kv: int, device: torch.device) -> torch.Tensor:
    """``kv_lengths`` as an integer tensor on ``device``; host values are range-checked."""
    if isinstance(kv_lengths, (list, tuple)):
        for i, n in enumerate(kv_lengths):
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"kv_lengths[{i}] must be an int, got {n!r}")
        kv_lengths = torch.tensor(kv_lengths, dtype=torch.int64).reshape(-1)
    if not isinstance(kv_lengths, torch.Tensor):
        raise TypeError(f"kv_lengths must be a tensor, list or tuple of ints, got {type(kv_lengths).__name__}")
    if kv_lengths.is_floating_point() or kv_lengths.is_complex() or kv_lengths.dtype == torch.bool:
        raise TypeError(f"kv_lengths must hold integers, got dtype {kv_lengths.dtype}")
    if kv_lengths.shape != (batch,):
        raise ValueError(f"kv_lengths must have shape ({batch},), got {tuple(kv_lengths.shape)}")
    if kv_lengths.device.type == "cpu" and batch:
        low, high = int(kv_lengths.min()), int(kv_lengths.max())
        if low < 0 or high > seqlen_kv:
            bad = int(((kv_lengths < 0) | (kv_lengths > seqlen_kv)).nonzero()[0])
            raise ValueError(f"kv_lengths[{bad}] = {int(kv_lengths[bad])} is outside [0, {seqlen_kv}] (S = k.shape[1])")
        return kv_lengths.to(device)
    return kv_lengths.clamp(0, seqlen_kv)
