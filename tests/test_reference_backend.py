"""The reference backend's cost follows the real sequence lengths, not the declared maxima."""

from __future__ import annotations

import torch

import packattn
from packattn.backends import reference
from packattn.varlen import Varlen


def _spy_chunks(monkeypatch) -> list[tuple[int, int]]:
    """Records ``(query rows, key rows)`` of every padded block `reference._chunk` computes."""
    shapes = []
    original = reference._chunk

    def chunk(q, k, *args):
        shapes.append((q.shape[1], k.shape[1]))
        return original(q, k, *args)

    monkeypatch.setattr(reference, "_chunk", chunk)
    return shapes


def _oracle(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), k[start:start + n].double()) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[start:start + n].double()))
        start += n
    return torch.cat(out)


def test_declared_max_seqlen_does_not_set_the_cost(monkeypatch):
    """10 tokens declared with max_seqlen 16384 (about a minute before): blocks of the real longest length."""
    shapes = _spy_chunks(monkeypatch)
    lengths = [4, 6]
    seqs = Varlen.from_cu_seqlens(torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen_q=16384)
    assert seqs.max_seqlen_q == seqs.max_seqlen_kv == 16384
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, generator=gen) for _ in range(3))
    out = packattn.attention(q, k, v, seqs, causal=True, backend="reference")
    assert shapes and all(shape == (6, 6) for shape in shapes), shapes
    torch.testing.assert_close(out.double(), _oracle(q, k, v, lengths), atol=1e-6, rtol=0)


def test_without_host_lengths_the_rows_cap_the_cost(monkeypatch):
    """A descriptor built without host lengths: the declared maximum, capped by the rows of q and k."""
    shapes = _spy_chunks(monkeypatch)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    seqs = Varlen(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                  max_seqlen_q=16384, max_seqlen_kv=16384, total_q=10, total_kv=10, num_seqs=2, is_self=True)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, 2, 8, generator=gen) for _ in range(3))
    out = packattn.attention(q, k, v, seqs, causal=True, backend="reference")
    assert shapes and all(shape == (10, 10) for shape in shapes), shapes
    torch.testing.assert_close(out.double(), _oracle(q, k, v, [4, 6]), atol=1e-6, rtol=0)
