"""The experimental TMA forward (`packattn.kernels.varlen_fwd_tma`, ``PACKATTN_TRITON_FWD=tma``)
against the pointer forward and a float64 brute force, on tiny cases.

Triton 3.6's interpreter runs tensor descriptors (it turns ``desc.load`` into a masked pointer load
with the descriptor's bounds), so on CPU this checks the kernel's indexing and zero-fill logic, not
the TMA hardware path; on a GPU the same tests run the real TMA kernel. The launcher's own choice
(CUDA only, never in the interpreter) is bypassed by patching ``_use_tma_fwd``.
"""

from __future__ import annotations

import math

import pytest
import torch

import packattn
from packattn.backends import triton_varlen
from packattn.mask import Mask
from test_triton_varlen import DEVICE, brute_force, make_inputs

pytestmark = pytest.mark.skipif(
    triton_varlen.TritonVarlenBackend().unavailable() is not None, reason="triton backend unavailable here"
)

LENGTHS = [17, 0, 1, 37, 100]

CASES = [
    dict(opts={}),
    dict(opts={"causal": True}),
    dict(opts={"causal": True, "window": (8, 0)}),
    dict(opts={"window": (5, 11)}),
    dict(opts={"causal": True, "chunk_size": 16}),
    dict(opts={"causal": True}, heads=(4, 2)),  # GQA
    dict(opts={"causal": True, "window": (6, 0)}, heads=(4, 1)),  # MQA
    dict(opts={"causal": True}, pad=8),  # padding rows between sequences
    dict(opts={"causal": "top_left"}, lengths_kv=[40, 3, 0, 20, 64]),  # cross attention
    dict(opts={"causal": True}, head_dim=64, dtype=torch.float16),
]


def _forward(q, k, v, seqs, opts, tma: bool, monkeypatch):
    monkeypatch.setattr(triton_varlen, "_use_tma_fwd", lambda *args: tma)
    with torch.no_grad():
        return packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{Mask.make(**c['opts']).describe()}-{c.get('heads', '')}"
                         f"-pad{c.get('pad')}-{'cross' if 'lengths_kv' in c else 'self'}-d{c.get('head_dim', 32)}")
def test_tma_forward_matches_pointer_forward(case, monkeypatch):
    head_dim, dtype = case.get("head_dim", 32), case.get("dtype", torch.float32)
    seqs, q, k, v, _ = make_inputs(LENGTHS, case.get("lengths_kv"), case.get("heads", (2, 2)), head_dim, dtype,
                                   case.get("pad"))
    opts = case["opts"]
    out_ptr, lse_ptr = _forward(q, k, v, seqs, opts, False, monkeypatch)
    out_tma, lse_tma = _forward(q, k, v, seqs, opts, True, monkeypatch)
    assert not torch.isnan(out_tma).any()
    assert torch.equal(torch.isneginf(lse_tma), torch.isneginf(lse_ptr)), "lse = -inf on different rows"
    finite = torch.isfinite(lse_ptr)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(lse_tma[finite], lse_ptr[finite], atol=atol, rtol=0)
    torch.testing.assert_close(out_tma.float(), out_ptr.float(), atol=atol, rtol=0)
    if seqs.pad_between_seqs:  # rows in no sequence stay exact zeros / -inf
        covered = torch.zeros(seqs.total_q, dtype=torch.bool, device=q.device)
        for start, n in zip(seqs.host_starts_q, seqs.lengths_q):
            covered[start:start + n] = True
        assert torch.equal(out_tma[~covered], torch.zeros_like(out_tma[~covered]))
        assert torch.isneginf(lse_tma[:, ~covered]).all()
    if dtype == torch.float32:  # and both against the float64 brute force
        mask = Mask.make(opts.get("causal", False), opts.get("window"), opts.get("chunk_size"))
        ref_out, ref_lse = brute_force(q.detach(), k.detach(), v.detach(), seqs, mask, 1.0 / math.sqrt(head_dim))
        torch.testing.assert_close(out_tma.double(), ref_out, atol=1e-4, rtol=0)
        torch.testing.assert_close(lse_tma[finite].double(), ref_lse[finite], atol=1e-4, rtol=0)


def test_tma_forward_is_opt_in(monkeypatch):
    q = torch.zeros(8, 2, 128, device=DEVICE)
    monkeypatch.delenv(triton_varlen.FWD_VARIANT_ENV, raising=False)
    assert not triton_varlen._use_tma_fwd(q, q, q, 128)
    monkeypatch.setenv(triton_varlen.FWD_VARIANT_ENV, "tma")
    expected = DEVICE == "cuda" and not triton_varlen.interpreting()
    assert triton_varlen._use_tma_fwd(q, q, q, 128) == expected
    q96 = torch.zeros(8, 2, 96, device=DEVICE)
    assert not triton_varlen._use_tma_fwd(q96, q96, q96, 96)  # HEAD_DIM != BLOCK_D: pointer kernel
