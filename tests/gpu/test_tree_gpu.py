"""Tree attention at full size on a GPU (skipped without CUDA by tests/gpu/conftest.py): W6 and W7
of shared/workloads.md in bf16 against the reference backend in float32, the tree forward against
our varlen kernel on the expanded sequences (bf16 ulps), W8 as a tree equal to W8 as a Varlen, and
a bitwise-deterministic backward."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.bench.workloads import tree_workloads
from packattn.varlen import Varlen


def rel_l2(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the bf16 spacing at max(|a|, |b|) (8 significant bits)."""
    a, b = a.double(), b.double()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    return (a - b).abs() / ulp


@pytest.fixture(scope="module", params=["W6", "W7"])
def workload(request):
    return tree_workloads()[request.param]


def test_tree_matches_reference(workload):
    tree, q, k, v = workload.make_inputs("cuda", torch.bfloat16)
    dout = torch.randn_like(q)
    out = packattn.attention(q, k, v, tree, backend="triton_tree")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = packattn.attention(*leaves, tree, backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    errors = {name: rel_l2(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    assert all(e < 1e-2 for e in errors.values()), errors


def test_tree_forward_equals_varlen_kernel_on_expanded_sequences(workload, monkeypatch):
    # the tree forward shares the inner loop of the Triton varlen forward (not the Gluon one): compare with it
    monkeypatch.setenv("PACKATTN_TRITON_FWD", "triton")
    tree, q, k, v = workload.make_inputs("cuda", torch.bfloat16, requires_grad=False)
    out_tree = tree.gather(packattn.attention(q, k, v, tree, backend="triton_tree"))
    expanded = [tree.gather(x) for x in (q, k, v)]
    out_varlen = packattn.attention(*expanded, tree.unpacked, causal=True, backend="triton")
    ulps = bf16_ulps(out_tree, out_varlen)
    print(f"\n{workload.name}: tree vs varlen on expanded: max {ulps.max().item():.0f} bf16 ulps, "
          f"{(ulps > 0).float().mean().item() * 100:.3f}% of elements differ")
    assert ulps.max().item() <= 4


def test_w8_tree_equals_w8_varlen():
    w = tree_workloads()["W8tree"]
    tree, q, k, v = w.make_inputs("cuda", torch.bfloat16)
    varlen = Varlen.from_lengths(w.lengths_q, device="cuda")
    dout = torch.randn_like(q)
    a = packattn.attention(q, k, v, tree, backend="triton_tree")
    b = packattn.attention(q, k, v, varlen, causal=True, backend="triton")
    ga = torch.autograd.grad(a, (q, k, v), dout)
    gb = torch.autograd.grad(b, (q, k, v), dout)
    for x, y in zip((a, *ga), (b, *gb)):
        assert rel_l2(x, y) < 1e-2


def test_tree_backward_is_bitwise_deterministic():
    tree, q, k, v = tree_workloads()["W6"].make_inputs("cuda", torch.bfloat16)
    dout = torch.randn_like(q)

    def grads():
        out = packattn.attention(q, k, v, tree, backend="triton_tree", deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


def test_tree_auto_dispatch_on_cuda():
    tree, q, k, v = tree_workloads()["W6"].make_inputs("cuda", torch.bfloat16, requires_grad=False)
    from packattn import dispatch

    params = dispatch.Params(
        device_type="cuda", dtype=q.dtype, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128, kind="tree",
        pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=17, max_seqlen_kv=17,
        mask=packattn.Mask.make(causal=True), return_lse=False, deterministic=False, requires_grad=False)
    assert dispatch.select(params, "auto").name == "triton_tree"
