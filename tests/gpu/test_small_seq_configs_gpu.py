"""The small-seq kernels compiled for the GPU at every head dim and GQA group, under the default launch
configs and the alternatives `benchmarks/small_seq_sweep.py` times: bf16 (and fp16) against the reference
backend in float32 (skipped without CUDA by tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.ops.small_seq import configs
from packattn.varlen import Varlen

ITEMS = 4096
C = configs.SmallSeqConfig
SWEPT = ["h1 c1 u8 w1 s5", "h1 c2 u8 w2 s5", "h1 c1 u8 w4 s5", "h1 c2 u8 w4 s5", "h1 c1 u8 w8 s5", "h2 c1 u8 w2 s5",
         "h4 c1 u8 w4 s5", "h8 c1 u8 w8 s5", "h1 c4 u4 w4 s5", "h1 c1 u2 w4 s3",
         "h1 c1 u24 w4 s1", "h1 c1 u8 w2 s5 i4", "h1 c2 u4 w8 s3 i2",
         "h1 c1 u8 w4 s3 i8"]


def rel_l2(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(head_dim: int, heads: tuple[int, int], dtype=torch.bfloat16, items: int = ITEMS) -> None:
    n = torch.randint(0, 17, (items,), generator=torch.Generator().manual_seed(head_dim + heads[1]))
    seqs = Varlen.from_lengths([1] * items, n.tolist(), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, device="cuda", generator=gen, dtype=dtype).requires_grad_()

    q, k, v = rand(items, heads[0]), rand(seqs.total_kv, heads[1]), rand(seqs.total_kv, heads[1])
    dout = torch.randn_like(q)
    out, lse = packattn.attention(q, k, v, seqs, backend="small_seq", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    again = torch.autograd.grad(packattn.attention(q, k, v, seqs, backend="small_seq"), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "backward not deterministic"
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = packattn.attention(*leaves, seqs, backend="reference", return_lse=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-2
    errors = {n: rel_l2(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    assert all(e < 1e-2 for e in errors.values()), errors


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_default_configs(head_dim, group):
    check(head_dim, (2 * group, 2))


@pytest.mark.parametrize("config", SWEPT)
@pytest.mark.parametrize("head_dim,heads", [(64, (8, 8)), (128, (8, 2)), (512, (8, 2)), (256, (6, 3))])
def test_swept_configs(config, head_dim, heads):
    c = C.parse(config)
    with configs.override(fwd=c, bwd=c):
        check(head_dim, heads, items=1024)


@pytest.mark.parametrize("head_dim", [64, 512])
def test_fp16(head_dim):
    check(head_dim, (8, 2), torch.float16, items=1024)
