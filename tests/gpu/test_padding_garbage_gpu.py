"""Padding rows between sequences may hold anything a buffer held before (NaN, inf): the fast kernels must keep
them out of every real row (skipped without CUDA by tests/gpu/conftest.py). The masked probabilities are exact
zeros, but 0 * NaN is NaN, so a kernel that reads a padding row of V (or Q / dO / K in the backward) into an
operand must zero it first (`fwd_sm90._ws_zero_v_tail`, `bwd_ws_sm90._zero_tails`)."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.mask import Mask
from packattn.ops.varlen import op
from packattn.varlen import Varlen

LENGTHS = [1000, 37, 700, 129, 1, 300, 2100]  # no length a multiple of any block; 2100 >= the Gluon row bound
DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64)]
MASKS = {"causal": {"causal": True}, "window": {"window": (100, 30)}}


def _run(seqs, dims, fill, opts):
    """f+b of `packattn.attention` (backend triton) with every padding row of q / k / v / dout set to ``fill``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    d, dv = dims
    pad_q, pad_kv = seqs.row_map_q()[0] < 0, seqs.row_map_kv()[0] < 0

    def rand(rows, heads, width, pad):
        x = torch.randn(rows, heads, width, device="cuda", generator=gen).to(torch.bfloat16)
        x[pad] = fill
        return x

    q, k, v = rand(seqs.total_q, 8, d, pad_q), rand(seqs.total_kv, 2, d, pad_kv), rand(seqs.total_kv, 2, dv, pad_kv)
    dout = rand(seqs.total_q, 8, dv, pad_q)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out, lse = packattn.attention(*leaves, seqs, backend="triton", return_lse=True, **opts)
    return (out, lse, *torch.autograd.grad(out, leaves, dout)), pad_q, pad_kv


def _takes_the_gluon_kernels(seqs, dims):
    """The test is about the sm_90 Gluon kernels' tail zeroing: their plans must be the ones that run."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm_90 Gluon kernels need a Hopper GPU")
    q = torch.zeros(seqs.total_q, 8, dims[0], device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(seqs.total_kv, 2, dims[0], device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(seqs.total_kv, 2, dims[1], device="cuda", dtype=torch.bfloat16)
    _tables, options = op.forward_plan(q, k, v, seqs, Mask.make(True), need_grad=True)
    assert options[op.FWD_OPTIONS.index("gluon")], "the Gluon forward is not selected"
    plan = op.bwd_plan(q, k, v)
    assert plan.dkdv is not None, "the Gluon dK/dV is not selected"


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}v{d[1]}")
def test_nan_and_inf_in_padding_rows_reach_no_real_row(dims, mask):
    seqs = Varlen.from_lengths(LENGTHS, pad_to_multiple=64, device="cuda")
    _takes_the_gluon_kernels(seqs, dims)
    clean, pad_q, pad_kv = _run(seqs, dims, 0.0, MASKS[mask])
    assert pad_q.any() and pad_kv.any()
    for fill in (float("nan"), float("inf")):
        dirty, _, _ = _run(seqs, dims, fill, MASKS[mask])
        for name, a, b, pad in zip(("out", "lse", "dq", "dk", "dv"), clean, dirty,
                                   (pad_q, None, pad_q, pad_kv, pad_kv)):
            if name == "lse":
                assert torch.equal(a[:, ~pad_q], b[:, ~pad_q]), f"lse of real rows changed ({fill} padding)"
                assert torch.isneginf(b[:, pad_q]).all(), f"lse of padding rows not -inf ({fill})"
                continue
            assert torch.equal(a[~pad], b[~pad]), f"{name} of real rows changed ({fill} padding)"
            assert torch.equal(b[pad], torch.zeros_like(b[pad])), f"{name} of padding rows not zero ({fill})"
