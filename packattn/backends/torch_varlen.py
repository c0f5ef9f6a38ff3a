"""`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside PyTorch) on CUDA."""

from __future__ import annotations

import inspect

import torch

from packattn.backends.base import Backend, Problem, empty_rows_lse, flash_kernel_unsupported

_varlen = _VARLEN_ATTN = _IMPORT_ERROR = None
_SIGNATURE: dict = {}


def _load():
    """Import torch's varlen_attn on first use (it pulls in torch._dynamo: about a second)."""
    global _varlen, _VARLEN_ATTN, _SIGNATURE, _IMPORT_ERROR
    if _VARLEN_ATTN is None and _IMPORT_ERROR is None:
        try:
            from torch.nn.attention import varlen as _varlen

            _VARLEN_ATTN = _varlen.varlen_attn
            _SIGNATURE = inspect.signature(_VARLEN_ATTN).parameters
        except (ImportError, AttributeError) as e:  # torch without varlen_attn
            _IMPORT_ERROR = e
    return _VARLEN_ATTN


class TorchVarlenBackend(Backend):
    name = "torch_varlen"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA"
        if _load() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({_IMPORT_ERROR})"
        return None

    def unsupported(self, params) -> str | None:
        why = flash_kernel_unsupported(params)
        if why:
            return why
        if params.head_dim != params.head_dim_v or params.head_dim > 256 or params.head_dim % 8:
            return f"head dims {params.head_dim}/{params.head_dim_v}: needs equal q/v head dims, a multiple of 8, <= 256"
        if params.pad_between_seqs:
            return "no padding between sequences (cu_seqlens are both lengths and offsets)"
        if params.mask.window is not None and "window_size" not in _SIGNATURE:
            return "this torch's varlen_attn has no window_size"
        if params.mask.causal and "window_size" not in _SIGNATURE and "is_causal" not in _SIGNATURE:
            return "this torch's varlen_attn has no causal option"
        if params.deterministic:
            return "FlashAttention-2's backward accumulates dq with atomics (not deterministic)"
        return None

    def run(self, problem: Problem):
        seqs, mask = problem.seqs, problem.mask
        kwargs = {"scale": problem.scale}
        if "window_size" in _SIGNATURE:
            kwargs["window_size"] = (mask.left, mask.right)
        elif mask.causal:
            kwargs["is_causal"] = True
        k, v = problem.k, problem.v
        group = problem.q.shape[1] // k.shape[1]
        if group > 1 and "enable_gqa" in _SIGNATURE:
            kwargs["enable_gqa"] = True
        elif group > 1:  # this torch's varlen_attn has no GQA: repeat K/V heads (autograd sums them back)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if problem.return_lse:
            kwargs["return_aux"] = _varlen.AuxRequest(lse=True)
        result = _VARLEN_ATTN(
            problem.q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_kv,
            seqs.max_seqlen_q, seqs.max_seqlen_kv, **kwargs,
        )
        if not problem.return_lse:
            return result, None
        out, lse = result
        if lse.shape[0] != problem.q.shape[1]:  # (total, heads) in some versions
            lse = lse.t()
        return out, empty_rows_lse(lse.float())
