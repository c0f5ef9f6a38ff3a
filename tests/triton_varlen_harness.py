"""What the CPU tests of the triton backend share (tests/test_triton_varlen*.py): the skip mark, the
device, random packed inputs (also tests/test_small_seq.py's), the self-attention masks. Triton's
interpreter: tests/conftest.py sets TRITON_INTERPRET=1 without CUDA before packattn is imported.
"""

from __future__ import annotations

import pytest
import torch

from packattn.backends import triton_varlen
from packattn.varlen import Varlen

requires_triton = pytest.mark.skipif(
    triton_varlen.TritonVarlenBackend().unavailable() is not None, reason="triton backend unavailable here"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(lengths_q, lengths_kv=None, heads=(2, 2), head_dim=32, dtype=torch.float32, pad=None, seed=0):
    seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=pad, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()

    q, k, v = rand(seqs.total_q, heads[0]), rand(seqs.total_kv, heads[1]), rand(seqs.total_kv, heads[1])
    dout = torch.randn(seqs.total_q, heads[0], head_dim, generator=gen).to(DEVICE, dtype)
    return seqs, q, k, v, dout


SELF_MASKS = [
    {},
    {"causal": True},
    {"causal": True, "window": (8, 0)},
    {"window": (5, 11)},
    {"window": (-1, 3)},
    {"chunk_size": 24},
    {"causal": True, "chunk_size": 16},
    {"causal": True, "chunk_size": 32, "window": (20, 0)},
]
