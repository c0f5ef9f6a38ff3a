"""FlashAttention-4 (`flash_attn.cute`, CuTe DSL) when installed: an optional extra, never required.

Padding between sequences goes through ``seqused_q/k`` (real lengths) with the padded offsets as
``cu_seqlens``; rows in no sequence are zeroed by us on the way in and out, so out and the
gradients are exact zeros there whatever the kernel leaves in them.
"""

from __future__ import annotations

import torch

from packattn.backends.base import Backend, Problem, empty_rows_lse, flash_kernel_unsupported, padding_row_mask
from packattn.ops.runtime import support

_IMPORT_ERROR: Exception | None = None
_varlen_func = None


def _load():
    global _varlen_func, _IMPORT_ERROR
    if _varlen_func is None and _IMPORT_ERROR is None:
        try:
            from flash_attn.cute import flash_attn_varlen_func

            _varlen_func = flash_attn_varlen_func
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
            _IMPORT_ERROR = e
    return _varlen_func


class Fa4Backend(Backend):
    name = "fa4"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA"
        if _load() is None:
            return f"flash_attn.cute is not importable ({type(_IMPORT_ERROR).__name__}: {str(_IMPORT_ERROR)[:80]})"
        if torch.cuda.get_device_capability()[0] < 9:
            return "FlashAttention-4 targets Hopper (sm_90) and newer"
        return None

    def unsupported(self, params) -> str | None:
        if params.traced:
            return ("not traceable by torch.compile (flash_attn.cute's autograd function calls what dynamo skips); "
                    "compiled graphs take the next backend")
        why = flash_kernel_unsupported(params)
        if why:
            return why
        if params.head_dim != params.head_dim_v or params.head_dim not in (64, 96, 128, 192, 256):
            return (f"head dims {params.head_dim}/{params.head_dim_v}: used here for equal q/v head dims 64, 96, 128, "
                    "192, 256")
        if params.deterministic:
            return "its deterministic backward is not verified here (the triton backend's is)"
        return None

    def defers_to(self, params) -> tuple[str, str] | None:
        """Short batches with gradients at d = 128, no GQA, on Hopper go to the triton backend: its short-batch
        backward (the sm_90 Gluon kernels) measured faster than FA4's there (W8 on H100, benchmarks/NOTES.md,
        "Dispatch"). Not where those kernels are off for every call (``PACKATTN_PORTABLE=1``, a Triton they are
        not built for: `support.sm90_kernels_off`): the portable Triton kernels are slower. Elsewhere FA4
        measured faster and leads. Decided on `dispatch.Params` alone (``short_seqs``: `packattn.lengths`)."""
        if (params.requires_grad and params.kind == "varlen" and params.short_seqs and params.head_dim == 128
                and params.heads_q == params.heads_kv and torch.cuda.get_device_capability()[0] == 9
                and support.sm90_kernels_off() is None):
            return "triton", ("short sequences (<= 512 rows) with gradients at d = 128: the triton backend's "
                              "short-batch backward measured faster on Hopper (W8 f+b 1.09x FA4)")
        return None

    def run(self, problem: Problem):
        seqs, mask = problem.seqs, problem.mask
        q, k, v = problem.q, problem.k, problem.v
        extra = {}
        if seqs.pad_between_seqs:
            valid_q = padding_row_mask(seqs)
            valid_kv = seqs.cached("valid_rows_kv", lambda: seqs.row_map_kv()[0] >= 0)
            q = torch.where(valid_q[:, None, None], q, q.new_zeros(()))
            k = torch.where(valid_kv[:, None, None], k, k.new_zeros(()))
            v = torch.where(valid_kv[:, None, None], v, v.new_zeros(()))
            cu_q = seqs.cu_seqlens_q_padded if seqs.cu_seqlens_q_padded is not None else seqs.cu_seqlens_q
            cu_k = seqs.cu_seqlens_kv_padded if seqs.cu_seqlens_kv_padded is not None else seqs.cu_seqlens_kv
            extra = {"seqused_q": seqs.seqlens_q, "seqused_k": seqs.seqlens_kv}
        else:
            cu_q, cu_k = seqs.cu_seqlens_q, seqs.cu_seqlens_kv
        window = (None, None)
        if mask.window is not None:
            window = (None if mask.left < 0 else mask.left, None if mask.right < 0 else mask.right)
        out, lse = _load()(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqs.max_seqlen_q,
            max_seqlen_k=seqs.max_seqlen_kv, softmax_scale=problem.scale, causal=mask.causal,
            window_size=window, return_lse=True, **extra,
        )
        if seqs.pad_between_seqs:
            out = torch.where(valid_q[:, None, None], out, out.new_zeros(()))
        if not problem.return_lse:
            return out, None
        lse = empty_rows_lse(lse.float())
        if seqs.pad_between_seqs:
            lse = torch.where(valid_q[None, :], lse, lse.new_full((), float("-inf")))
        return out, lse
