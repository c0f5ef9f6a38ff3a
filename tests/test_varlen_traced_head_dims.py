"""The varlen op under torch.compile (`packattn.ops.varlen.traced`) with a value head dim of its own (MLA): one
graph, the same out and gradients as the eager call (the traced ops build the plan from q, k and v as the eager
path does; the fake forward's output takes v's head dim). On CPU in Triton's interpreter, or on a GPU."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn import Varlen
from triton_varlen_harness import DEVICE, requires_triton

pytestmark = requires_triton


@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 32), (32, 64)])
def test_torch_compile_with_a_value_head_dim_of_its_own(head_dim, head_dim_v):
    seqs = Varlen.from_lengths([17, 30], device=DEVICE)
    gen = torch.Generator().manual_seed(0)

    def rand(h, d):
        return torch.randn(seqs.total_q, h, d, generator=gen).to(DEVICE).requires_grad_()

    q, k, v = rand(2, head_dim), rand(1, head_dim), rand(1, head_dim_v)
    dout = torch.randn(seqs.total_q, 2, head_dim_v, generator=gen).to(DEVICE)

    def step(q, k, v):
        return packattn.attention(q, k, v, seqs, causal=True, backend="triton")

    eager = step(q, k, v)  # also fills the dispatch cache (a miss logs, which dynamo cannot trace)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    assert out.shape == (seqs.total_q, 2, head_dim_v)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for got, want, x in zip(grads, torch.autograd.grad(step(q, k, v), (q, k, v), dout), (q, k, v)):
        assert got.shape == x.shape
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    ref = packattn.attention(q, k, v, seqs, causal=True, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
