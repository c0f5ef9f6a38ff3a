"""The ``small_seq`` backend: one query per sequence over at most 16 keys (retrieval / recommendation
cross-attention; `packattn.ops.small_seq`): varlen or dense, no restricting mask, GQA/MQA, padding between
sequences, lse, deterministic."""

from __future__ import annotations

from packattn.backends.base import Problem
from packattn.backends.triton_base import TritonBackend
from packattn.ops.small_seq.eager import small_seq_fwd_call
from packattn.ops.small_seq.op import MAX_KEYS, item_table, kernel_unsupported


class SmallSeqBackend(TritonBackend):
    """Our small-sequence kernels (`packattn.ops.small_seq`)."""

    name = "small_seq"

    def unsupported(self, params) -> str | None:
        if params.kind not in ("varlen", "dense"):
            return f"{params.kind} descriptors are not small-sequence batches"
        if params.max_seqlen_q > 1 or params.max_seqlen_kv > MAX_KEYS:
            def shown(n):  # dispatch buckets lengths above 16 into 17
                return f"> {MAX_KEYS}" if n > MAX_KEYS else str(n)
            return (f"only one query over at most {MAX_KEYS} keys per sequence; got max_seqlen_q "
                    f"{shown(params.max_seqlen_q)}, max_seqlen_kv {shown(params.max_seqlen_kv)}")
        mask = params.mask
        if mask.window is not None or mask.chunk_size is not None:
            return f"no windows or chunks (mask {mask.describe()}): only masks that keep every key of the query"
        if mask.causal and mask.align == "top_left" and not params.is_self:
            return "causal='top_left' hides keys from a single query: only bottom-right causal (= no mask) or none"
        return kernel_unsupported(params.device_type, params.dtype, params.head_dim, params.head_dim_v)

    def run(self, problem: Problem):
        seqs = problem.seqs
        out, lse = small_seq_fwd_call(
            problem.q, problem.k, problem.v, item_table(seqs), problem.scale,
            seqs.cu_seqlens_q_padded is not None, seqs.cu_seqlens_kv_padded is not None, 0, seqs)
        return out, (lse if problem.return_lse else None)
