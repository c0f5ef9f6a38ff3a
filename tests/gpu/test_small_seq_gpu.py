"""Small-sequence cross-attention at W9 size on a GPU (skipped without CUDA by tests/gpu/conftest.py):
the `small_seq` kernels in bf16 against the reference backend in float32, packed and dense,
every head dim of the workload, GQA, and automatic dispatch."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.varlen import Varlen

ITEMS = 30720


def rel_l2(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def lengths(low: int = 2, items: int = ITEMS):
    return torch.randint(low, 17, (items,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim", [128, 256, 512])
def test_packed_matches_reference(head_dim, heads):
    items = ITEMS if head_dim < 512 else ITEMS // 4  # the float32 reference's scores at d=512 need > 140 GB
    seqs = Varlen.from_lengths([1] * items, lengths(0, items).tolist(), device="cuda")  # some items have no key
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()

    q, k, v = rand(items, heads[0]), rand(seqs.total_kv, heads[1]), rand(seqs.total_kv, heads[1])
    dout = torch.randn_like(q)
    out, lse = packattn.attention(q, k, v, seqs, backend="small_seq", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = packattn.attention(*leaves, seqs, backend="reference", return_lse=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    errors = {n: rel_l2(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    assert all(e < 1e-2 for e in errors.values()), errors


def test_dense_entry_point_matches_packed():
    n = lengths()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ITEMS, 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(ITEMS, 16, 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dense = packattn.small_seq_attention(q, k, v, n.cuda())
    keep = torch.arange(16)[None, :] < n[:, None]
    seqs = Varlen.from_lengths([1] * ITEMS, n.tolist(), device="cuda")
    packed = packattn.attention(q, k[keep.cuda()], v[keep.cuda()], seqs, backend="small_seq")
    assert rel_l2(dense, packed) < 1e-3


def test_auto_dispatch_picks_small_seq():
    from packattn import dispatch

    params = dispatch.Params(
        device_type="cuda", dtype=torch.bfloat16, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128,
        kind="varlen", pad_between_seqs=False, is_self=False, host_lengths=True, max_seqlen_q=1, max_seqlen_kv=16,
        mask=packattn.Mask.make(causal=False), return_lse=False, deterministic=False, requires_grad=True)
    assert dispatch.select(params, "auto").name == "small_seq"
