"""What every backend gets (a `Problem`) and what it must say about itself (a `Backend`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packattn.mask import Mask
from packattn.varlen import Varlen


@dataclass
class Problem:
    """One attention call, normalised to THD: ``q (total_q, heads_q, d)``, ``k, v (total_kv, heads_kv, d)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seqs: Varlen  # on q's device (a packattn.Tree when the params say kind == "tree")
    mask: Mask
    scale: float
    return_lse: bool
    deterministic: bool
    # (batch, seqlen_q, seqlen_kv) when the caller passed a dense layout (bshd/sbhd), else None
    dense: tuple[int, int, int] | None = None


class Backend:
    """A way to compute attention. Subclasses state what they support in `unsupported` (one place)."""

    name: str = "?"

    def unavailable(self) -> str | None:
        """Why this backend cannot run in this process at all (missing module...), or None."""
        return None

    def unsupported(self, params) -> str | None:
        """Why this backend cannot run a call with these `dispatch.Params`, or None if it can."""
        raise NotImplementedError

    def auto_skip(self, params) -> str | None:
        """Why ``backend="auto"`` should pass over this backend although it could run the call (e.g.
        a slow emulation meant for tests), or None. An explicit request still uses it."""
        return None

    def defers_to(self, params) -> tuple[str, str] | None:
        """``(name of another backend, why)`` when ``backend="auto"`` should pass over this backend for that
        one, measured faster on such calls; dispatch does so only where the other can run the call and is
        not disabled (`dispatch.reasons`). None otherwise."""
        return None

    def run(self, problem: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(out, lse)``; ``lse`` float32 ``(heads_q, total_q)`` or None when not asked for."""
        raise NotImplementedError

    def backward_from_stats(self, problem: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                            dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(dq, dk, dv)`` of ``problem``'s attention taken with the given softmax statistics instead of its own:
        ``out`` / ``lse`` (float32 ``(heads_q, total_q)``) may be those of a larger attention that this problem is
        one part of (context parallelism merges parts by lse), ``dout`` / ``dlse`` (or None) the gradients flowing
        into them. Each part's probabilities are ``exp(s - lse)`` and ``delta = rowsum(dout * out) - dlse``, so the
        parts' gradients add up to the whole's without recomputing the parts' own outputs. None: this backend
        cannot (the caller recomputes the part with autograd)."""
        return None


def flash_kernel_unsupported(params) -> str | None:
    """Limits shared by the FlashAttention-family backends (torch_varlen, fa4): CUDA, a varlen or
    dense batch, fp16/bf16, and causal aligned bottom-right (top-left only where it is the same)."""
    if params.device_type != "cuda":
        return f"needs CUDA tensors, got {params.device_type}"
    if params.kind == "tree":
        return "tree descriptors need a tree-aware backend"
    if params.dtype not in (torch.float16, torch.bfloat16):
        return f"takes fp16/bf16, got {params.dtype}"
    if params.mask.chunk_size is not None:
        return "no chunked attention"
    if params.mask.align == "top_left" and not params.is_self:
        return "causal is bottom-right aligned only (top-left differs when q and kv lengths differ)"
    return None


def padding_row_mask(seqs: Varlen) -> torch.Tensor:
    """Boolean (total_q,) True for query rows that belong to a sequence (cached per batch)."""
    return seqs.cached("valid_rows_q", lambda: seqs.row_map_q()[0] >= 0)


def zero_padding_rows(out: torch.Tensor, lse: torch.Tensor | None, seqs: Varlen):
    """Exact zeros in the output (and -inf in lse) for rows that belong to no sequence.

    Gradients through it are exact zeros for those rows too.
    """
    if not seqs.pad_between_seqs:
        return out, lse
    valid = padding_row_mask(seqs)
    out = torch.where(valid[:, None, None], out, out.new_zeros(()))
    if lse is not None:
        lse = torch.where(valid[None, :], lse, lse.new_full((), float("-inf")))
    return out, lse


def empty_rows_lse(lse: torch.Tensor) -> torch.Tensor:
    """Kernels that report +inf (flash-attn) or NaN for rows with no visible key: make it -inf."""
    return torch.where(torch.isfinite(lse), lse, lse.new_full((), float("-inf")))
