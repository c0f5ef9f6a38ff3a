"""The STORED backward (`packattn.backends.triton_stored`: the dQ pass keeps P and dS, the dK/dV pass reads
them) against the float64 brute force, in Triton's interpreter on CPU (``PACKATTN_STORED_PDS=1`` takes it
with the Triton dQ pass) or on a GPU; and when it is taken."""

from __future__ import annotations

import math

import pytest
import torch

from packattn.backends import triton_stored, triton_varlen
from packattn.mask import Mask
from packattn.varlen import Varlen
from test_triton_varlen import brute_force, run_brute, run_triton
from triton_varlen_harness import DEVICE, make_inputs, requires_triton

pytestmark = requires_triton

LENGTHS = [17, 0, 1, 64, 100, 129, 200]


@pytest.fixture
def stored(monkeypatch):
    """Force the STORED backward and count the calls that took it."""
    monkeypatch.setenv(triton_stored.SWITCH, "1")
    calls = []
    real = triton_stored.stored_bwd

    def spy(*args, **kwargs):
        calls.append(args[12])  # num_pairs
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_stored, "stored_bwd", spy)
    return calls


def _plan():
    q = torch.zeros(1, 2, 32)
    return triton_varlen.bwd_plan(q, q, q, True)


def test_pair_count_and_bases():
    seqs = Varlen.from_lengths([0, 1, 64, 65, 512], device=DEVICE)
    # blocks 0, 1, 1, 2, 8 -> pairs 0, 1, 1, 3, 36
    assert torch.equal(triton_stored.pair_base(seqs).cpu(), torch.tensor([0, 0, 1, 2, 5], dtype=torch.int32))
    assert triton_stored.stored_pairs(seqs, Mask.make(causal=True), _plan(), True) in (0, 41)  # 0: not measured here


@pytest.mark.parametrize("causal", [True, "top_left"])
def test_taken_where_allowed(monkeypatch, causal):
    monkeypatch.setenv(triton_stored.SWITCH, "1")
    seqs = Varlen.from_lengths([0, 1, 64, 65, 512], device=DEVICE)
    plan = _plan()
    assert triton_stored.stored_pairs(seqs, Mask.make(causal=causal), plan, True) == 41
    assert triton_stored.stored_pairs(seqs, Mask.make(causal=causal), plan, False) == 0  # not a short batch
    for mask in (Mask.make(), Mask.make(causal=True, window=(8, 0)), Mask.make(causal=True, chunk_size=32),
                 Mask.make(window=(-1, 3))):
        assert triton_stored.stored_pairs(seqs, mask, plan, True) == 0, mask.describe()
    cross = Varlen.from_lengths([5, 7], [5, 7], device=DEVICE)  # equal lengths, but not declared self-attention
    assert triton_stored.stored_pairs(cross, Mask.make(causal=True), plan, True) == 0
    monkeypatch.setenv(triton_stored.SWITCH, "0")
    assert triton_stored.stored_pairs(seqs, Mask.make(causal=True), plan, True) == 0


@pytest.mark.parametrize("causal", [True, "top_left"])
@pytest.mark.parametrize("heads,pad", [((2, 2), None), ((4, 2), 16), ((3, 1), None)])
def test_matches_brute_force_fp32(stored, causal, heads, pad):
    seqs, q, k, v, dout = make_inputs(LENGTHS, heads=heads, pad=pad)
    out, lse, grads = run_triton(q, k, v, seqs, dout, causal=causal)
    assert stored, "the STORED backward did not run"
    ref_out, _, ref_grads = run_brute(q, k, v, seqs, dout, causal=causal)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=0)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not torch.isnan(got).any(), name
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_nan_padding_rows_stay_out(stored):
    """Padding rows full of NaN (inputs and dout): the stored tiles' rows past a sequence hold whatever the dQ
    pass computed there; the dK/dV pass must mask them, and padding rows of every gradient are exact zeros."""
    seqs, q, k, v, dout = make_inputs([17, 1, 64, 70], heads=(4, 2), pad=32)
    pad_q = seqs.row_map_q()[0] < 0
    assert pad_q.any()
    with torch.no_grad():
        for x in (q, k, v, dout):
            x[pad_q] = float("nan")
    out, _, grads = run_triton(q, k, v, seqs, dout, causal=True)
    assert stored
    clean = [x.detach().masked_fill(pad_q[:, None, None], 0).requires_grad_() for x in (q, k, v)]
    ref_out, _, ref_grads = run_brute(*clean, seqs, dout.masked_fill(pad_q[:, None, None], 0), causal=True)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert not torch.isnan(got).any(), name
        assert torch.equal(got[pad_q], torch.zeros_like(got[pad_q])), name
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_fp16_within_twice_torch_fp16_error(stored):
    seqs, q, k, v, dout = make_inputs([37, 0, 100, 130], heads=(4, 2), dtype=torch.float16)
    _, _, grads = run_triton(q, k, v, seqs, dout, causal=True)
    assert stored
    _, _, truth = run_brute(q, k, v, seqs, dout, causal=True)
    _, _, low = run_brute(q, k, v, seqs, dout, dtype=torch.float16, causal=True)
    for name, got, want, fp16 in zip(("dq", "dk", "dv"), grads, truth, low):
        err = (got.double() - want).abs().max().item()
        torch_err = (fp16.double() - want).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3g} vs fp16 torch {torch_err:.3g}"


def test_deterministic(stored):
    seqs, q, k, v, dout = make_inputs([37, 1, 100], heads=(4, 1), pad=16)
    first = run_triton(q, k, v, seqs, dout, causal=True)[2]
    second = run_triton(q, k, v, seqs, dout, causal=True)[2]
    assert len(stored) == 2
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_gradient_through_lse(stored):
    """A loss on lse: the STORED backward then takes delta from the preprocess (its dlse term)."""
    import packattn

    seqs, q, k, v, dout = make_inputs([37, 0, 20, 65])
    out, lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, causal=True)
    weight = torch.linspace(-1, 1, lse.numel()).view_as(lse).to(lse.device)
    loss = (out.float() * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * weight).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    assert stored
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r_out, r_lse = brute_force(*leaves, seqs, Mask.make(causal=True), 1.0 / math.sqrt(q.shape[-1]))
    r_loss = (r_out * dout.double()).sum() + (torch.where(torch.isfinite(r_lse), r_lse, 0) * weight.double()).sum()
    for got, ref in zip(grads, torch.autograd.grad(r_loss, leaves)):
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)
