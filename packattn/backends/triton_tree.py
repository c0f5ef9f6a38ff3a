"""The ``triton_tree`` backend: our tree kernels (`packattn.ops.tree`) for a `packattn.Tree` descriptor: GQA/MQA,
lse, deterministic backward. A tree without sharing is exactly causal varlen attention and runs as such."""

from __future__ import annotations

import torch

from packattn.backends.base import Problem
from packattn.backends.triton_base import TritonBackend
from packattn.backends.triton_varlen import tree_limits
from packattn.mask import Mask
from packattn.ops.runtime.launch import nonnegative_scale
from packattn.ops.runtime.support import device_unsupported
from packattn.ops.tree import op
from packattn.ops.tree.traced import traced_tree_attention
from packattn.ops.varlen import op as varlen_op

CAUSAL = Mask.make(True)


class TritonTreeBackend(TritonBackend):
    """Our tree kernels (`packattn.ops.tree`)."""

    name = "triton_tree"

    def unsupported(self, params) -> str | None:
        if params.kind != "tree":
            return "handles tree descriptors only"
        if (why := device_unsupported(params.device_type)) is not None:
            return why
        return tree_limits(params)

    def run(self, problem: Problem):
        q, scale, _ = nonnegative_scale(problem.q, problem.scale)
        if torch.compiler.is_compiling():  # one graph for every tree: tables built when the op runs
            out, lse = traced_tree_attention(q, problem.k, problem.v, problem.seqs, scale)
        elif problem.seqs.varlen_equivalent is not None:  # no sharing: exactly causal varlen, run as such
            out, lse = varlen_op.attention(q, problem.k, problem.v, problem.seqs.varlen_equivalent, CAUSAL, scale)
        else:
            out, lse = op.attention(q, problem.k, problem.v, problem.seqs, scale)
        return out, (lse if problem.return_lse else None)
