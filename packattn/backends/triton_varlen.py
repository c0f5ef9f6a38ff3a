"""The ``triton`` backend: our varlen kernels (`packattn.ops.varlen`) -- portable Triton everywhere, sm_90
Gluon kernels on Hopper -- for varlen and dense batches: causal (both alignments), windows, chunks, GQA/MQA,
padding between sequences, lse, deterministic backward."""

from __future__ import annotations

import torch

from packattn.backends.base import Problem
from packattn.backends.triton_base import TritonBackend
from packattn.ops.runtime.launch import nonnegative_scale
from packattn.ops.runtime.support import device_unsupported
from packattn.ops.varlen import op
from packattn.ops.varlen.configs import DTYPES, HEAD_DIMS
from packattn.ops.varlen.traced import traced_varlen_attention


def kernel_limits(params) -> str | None:
    """Dtype and head-dim limits of the varlen-family kernels: q/k and v head dims each in `HEAD_DIMS`, equal or
    not (MLA, e.g. 192/128: on sm_90 the Gluon kernels at the pairs of
    `packattn.ops.varlen.configs.GLUON_HEAD_DIMS`, the portable Triton ones elsewhere; where the Gluon kernels run:
    `packattn.ops.runtime.sm90.sm90_runs`). The tree backend adds `tree_limits`."""
    if params.dtype not in DTYPES:
        return f"dtype {params.dtype} not supported (float16, bfloat16, float32)"
    if params.head_dim not in HEAD_DIMS:
        return f"head_dim {params.head_dim} not in {HEAD_DIMS}"
    if params.head_dim_v not in HEAD_DIMS:
        return f"value head_dim {params.head_dim_v} not in {HEAD_DIMS}"
    return None


def tree_limits(params) -> str | None:
    """`kernel_limits` of the tree kernels (`packattn.ops.tree`), which take equal q/k and v head dims only."""
    if params.head_dim != params.head_dim_v:
        return (f"head dims {params.head_dim}/{params.head_dim_v}: the tree kernels need equal q and v head dims "
                "(MLA runs on varlen descriptors)")
    return kernel_limits(params)


class TritonVarlenBackend(TritonBackend):
    """Our varlen kernels (`packattn.ops.varlen`)."""

    name = "triton"

    def unsupported(self, params) -> str | None:
        if (why := device_unsupported(params.device_type)) is not None:
            return why
        if params.kind == "tree":
            return "tree descriptors are handled by the tree kernels"
        return kernel_limits(params)  # the backward is deterministic by construction: deterministic=True is fine

    def run(self, problem: Problem):
        q, scale, _ = nonnegative_scale(problem.q, problem.scale)
        if torch.compiler.is_compiling():  # one graph for every packing: tables built when the op runs
            out, lse = traced_varlen_attention(q, problem.k, problem.v, problem.seqs, problem.mask, scale)
        else:
            out, lse = op.attention(q, problem.k, problem.v, problem.seqs, problem.mask, scale)
        return out, (lse if problem.return_lse else None)

    def backward_from_stats(self, problem: Problem, out, lse, dout, dlse):
        q, scale, negated = nonnegative_scale(problem.q, problem.scale)
        dq, dk, dv = op.backward_with_stats(q, problem.k, problem.v, problem.seqs, problem.mask, out, lse, dout,
                                            dlse, scale)
        return (-dq if negated else dq), dk, dv
