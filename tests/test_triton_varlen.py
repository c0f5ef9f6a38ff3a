"""The Triton varlen kernels (backend "triton") against a float64 brute force, in Triton's
interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) or on a GPU.

Shapes are tiny (the interpreter is slow); tests/gpu/test_triton_varlen_gpu.py has full sizes.
No bf16 here: the interpreter stores bf16 as raw 16-bit integers, so its bf16 dot is wrong.
Tile tables and backward plans: test_triton_varlen_plans.py; dispatch and the custom ops:
test_triton_varlen_dispatch.py; shared inputs: triton_varlen_harness.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import packattn
from packattn import mask as masks
from packattn.ops.varlen import launch_triton
from packattn.mask import Mask
from packattn.varlen import Varlen
from triton_varlen_harness import DEVICE, SELF_MASKS, make_inputs, requires_triton

pytestmark = requires_triton


# ---------------------------------------------------------------- float64 brute force, one sequence at a time
def brute_force(q, k, v, seqs: Varlen, mask: Mask, scale: float, dtype=torch.float64):
    """``(out, lse)`` computed per sequence in ``dtype`` from `packattn.mask.dense_mask`; autograd-able.
    Rows in no sequence are zeros (lse -inf); a row that sees no key is zeros (lse -inf)."""
    group = q.shape[1] // k.shape[1]
    tie = sum(x.sum() for x in (q, k, v)).to(dtype) * 0  # keeps an all-empty result in the graph
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=dtype, device=q.device) + tie
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    starts_q, starts_kv = seqs.host_starts_q, seqs.host_starts_kv
    for i, (lq, lk) in enumerate(zip(seqs.lengths_q, seqs.lengths_kv)):
        if lq == 0:
            continue
        rq = slice(starts_q[i], starts_q[i] + lq)
        rk = slice(starts_kv[i], starts_kv[i] + lk)
        qs = q[rq].to(dtype).transpose(0, 1)  # (H, lq, d)
        ks = k[rk].to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[rk].to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        vis = masks.dense_mask(mask, lq, lk, device=q.device)
        s = (qs @ ks.transpose(1, 2)) * scale
        s = s.masked_fill(~vis, float("-inf"))
        m = s.amax(-1, keepdim=True) if lk else s.new_zeros(s.shape[0], lq, 1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
        p = torch.exp(s - m) * vis
        denom = p.sum(-1, keepdim=True)
        empty = denom == 0
        o = (p / torch.where(empty, torch.ones_like(denom), denom)) @ vs
        out = out.index_copy(0, torch.arange(rq.start, rq.stop, device=q.device), o.transpose(0, 1))
        row_lse = torch.where(empty, torch.full_like(denom, float("-inf")), m + torch.log(denom.where(~empty, 1)))
        lse[:, rq] = row_lse[..., 0].double()
    return out, lse


def run_triton(q, k, v, seqs, dout, **opts):
    out, lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


def run_brute(q, k, v, seqs, dout, dtype=torch.float64, **opts):
    mask = Mask.make(opts.get("causal", False), opts.get("window"), opts.get("chunk_size"))
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = brute_force(*leaves, seqs, mask, 1.0 / math.sqrt(q.shape[-1]), dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return out, lse, grads


def check_fp32(lengths_q, lengths_kv=None, heads=(2, 2), head_dim=32, pad=None, atol=1e-4, **opts):
    seqs, q, k, v, dout = make_inputs(lengths_q, lengths_kv, heads, head_dim, torch.float32, pad)
    out, lse, grads = run_triton(q, k, v, seqs, dout, **opts)
    ref_out, ref_lse, ref_grads = run_brute(q, k, v, seqs, dout, **opts)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (heads[0], seqs.total_q)
    for name, got in (("out", out), ("lse", lse), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert not torch.isnan(got).any(), f"{name} has NaN"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse = -inf on the wrong rows"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=atol, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    return seqs, out, lse, grads


LENGTHS = [17, 0, 1, 37, 100, 129]


@pytest.mark.parametrize("opts", SELF_MASKS, ids=lambda o: Mask.make(**o).describe())
def test_self_attention_masks_fp32(opts):
    check_fp32(LENGTHS, **opts)


CROSS_MASKS = [
    {},
    {"causal": True},
    {"causal": "top_left"},
    {"causal": True, "window": (6, 0)},
    {"window": (3, 9), "causal": False},
    {"causal": True, "chunk_size": 8},
    {"causal": "top_left", "chunk_size": 16, "window": (12, 0)},
]


@pytest.mark.parametrize("opts", CROSS_MASKS, ids=lambda o: Mask.make(**o).describe())
def test_cross_attention_fp32(opts):
    # q longer than kv (bottom-right alignment leaves rows with no key), shorter, empty on either side
    check_fp32([17, 0, 37, 5, 64, 40], [40, 9, 3, 0, 64, 33], **opts)


@pytest.mark.parametrize("seed", range(8))
def test_random_problems(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 4)

    def length():
        return rng.choice([0, 1] + [rng.randint(2, 90)] * 4)

    lengths_q = [length() for _ in range(n)]
    lengths_kv = None if rng.random() < 0.5 else [length() for _ in range(n)]
    opts = {"causal": rng.choice([False, True, "top_left"])}
    if rng.random() < 0.5:
        opts["window"] = (rng.choice([-1, 0, 3, 17]), rng.choice([-1, 0, 5]))
    if rng.random() < 0.4:
        opts["chunk_size"] = rng.choice([1, 7, 16, 33])
    heads = rng.choice([(2, 2), (4, 2), (3, 1)])
    check_fp32(lengths_q, lengths_kv, heads=heads, pad=rng.choice([None, 8, 16]), **opts)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 1.7])
def test_explicit_scale_of_any_sign(scale):
    # the kernels fold the scale after the row max (needs scale >= 0); a negative scale flips q
    seqs, q, k, v, dout = make_inputs([37, 1, 70], heads=(2, 2))
    out, lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, causal=True, scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = brute_force(*leaves, seqs, Mask.make(True), scale)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    # float32 gradients reach ~13 at scale 1.7: a few float32 ulps of them exceed an absolute 1e-4
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=2e-5)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_gqa_mqa(heads):
    check_fp32([37, 1, 70], heads=heads, causal=True, window=(24, 0))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_head_dims(head_dim):
    """Every head dim a model uses (the portable kernels pad 96 / 192 to their block widths), fp32."""
    check_fp32([33, 70], head_dim=head_dim, causal=True)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_padding_rows_are_exact_zeros(cross):
    lengths_kv = [20, 3, 0, 50] if cross else None
    seqs, out, lse, grads = check_fp32([17, 0, 1, 37], lengths_kv, heads=(4, 2), pad=16, causal=True, chunk_size=24)
    valid_q = seqs.row_map_q()[0] >= 0
    valid_kv = seqs.row_map_kv()[0] >= 0
    assert (~valid_q).any() and (~valid_kv).any()
    assert torch.equal(out[~valid_q], torch.zeros_like(out[~valid_q]))
    assert torch.isneginf(lse[:, ~valid_q]).all()
    assert torch.equal(grads[0][~valid_q], torch.zeros_like(grads[0][~valid_q]))
    for g in grads[1:]:
        assert torch.equal(g[~valid_kv], torch.zeros_like(g[~valid_kv]))


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_fp16_within_twice_torch_fp16_error(head_dim):
    opts = {"causal": True, "window": (40, 0)}
    seqs, q, k, v, dout = make_inputs([37, 0, 100], heads=(4, 2), head_dim=head_dim, dtype=torch.float16)
    out, lse, grads = run_triton(q, k, v, seqs, dout, **opts)
    ref = run_brute(q, k, v, seqs, dout, **opts)
    same_dtype = run_brute(q, k, v, seqs, dout, dtype=torch.float16, **opts)  # plain fp16 torch
    assert out.dtype == torch.float16
    for name, got, truth, low in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2]),
                                     (same_dtype[0], *same_dtype[2])):
        err = (got.double() - truth).abs().max().item()
        torch_err = (low.double() - truth).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3g} vs fp16 torch {torch_err:.3g}"
    torch.testing.assert_close(lse.double(), ref[1], atol=1e-2, rtol=0)


def test_backward_is_deterministic():
    seqs, q, k, v, dout = make_inputs([37, 1, 100], heads=(4, 1), pad=16)
    first = run_triton(q, k, v, seqs, dout, causal=True, deterministic=True)[2]
    second = run_triton(q, k, v, seqs, dout, causal=True, deterministic=True)[2]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opts", [{"causal": True, "window": (20, 0)}, {"causal": "top_left", "chunk_size": 24}])
def test_deterministic_backward_matches_brute_force(opts):
    """deterministic=True (a no-op for this backend: its backward has no atomics) with harder masks."""
    seqs, q, k, v, dout = make_inputs([37, 1, 0, 70], [40, 1, 5, 70], heads=(4, 2), pad=16)
    _, _, grads = run_triton(q, k, v, seqs, dout, deterministic=True, **opts)
    _, _, truth = run_brute(q, k, v, seqs, dout, **opts)
    for got, want in zip(grads, truth):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


def test_gradient_through_lse():
    seqs, q, k, v, dout = make_inputs([37, 0, 20], [10, 5, 30])
    opts = {"causal": True}
    out, lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
    weight = torch.linspace(-1, 1, lse.numel()).view_as(lse).to(lse.device)
    loss = (out.float() * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * weight).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r_out, r_lse = brute_force(*leaves, seqs, Mask.make(**opts), 1.0 / math.sqrt(q.shape[-1]))
    r_loss = (r_out * dout.double()).sum() + (torch.where(torch.isfinite(r_lse), r_lse, 0) * weight.double()).sum()
    for got, ref in zip(grads, torch.autograd.grad(r_loss, leaves)):
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)


def test_strided_inputs_and_dense_layout():
    # q/k/v views with a row stride larger than heads * head_dim
    seqs, q, k, v, dout = make_inputs([30, 45], head_dim=64)
    qs, ks, vs = (x.detach()[..., :32].requires_grad_() for x in (q, k, v))
    out, lse, grads = run_triton(qs, ks, vs, seqs, dout[..., :32].contiguous(), causal=True)
    ref = run_brute(qs, ks, vs, seqs, dout[..., :32].contiguous(), causal=True)
    torch.testing.assert_close(out.double(), ref[0], atol=1e-4, rtol=0)
    for got, want in zip(grads, ref[2]):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    # bshd goes through a uniform Varlen
    x = torch.randn(2, 24, 2, 32, device=DEVICE)
    dense = packattn.attention(x, x, x, causal=True, layout="bshd", backend="triton")
    ref = packattn.attention(x, x, x, causal=True, layout="bshd", backend="reference")
    torch.testing.assert_close(dense, ref, atol=1e-4, rtol=0)


def test_empty_batches():
    for lengths in ([], [0, 0]):
        seqs, q, k, v, dout = make_inputs(lengths)
        out, lse, grads = run_triton(q, k, v, seqs, dout, causal=True)
        assert out.shape == q.shape and lse.shape == (2, 0) and all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    seqs, q, k, v, dout = make_inputs([5, 7], [0, 0])  # queries but no keys
    out, lse, grads = run_triton(q, k, v, seqs, dout, causal=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    assert torch.equal(grads[0], torch.zeros_like(grads[0]))


# ---------------------------------------------------------------- padding rows of outputs (torch only, no kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(10, 16, 8), (10, 1, 1), (7, 3, 1), (0, 2, 4)])
def test_zero_rows_zeroes_exactly_the_padding_rows(dtype, shape):
    """Padding rows of outputs are zeroed through a wide-integer view of the rows; every other element
    keeps what it held, and the zeros are +0 in the output's dtype."""
    out = torch.full(shape, float("nan"), dtype=dtype)
    rows = torch.tensor([r for r in (0, 3, 4, 9) if r < shape[0]], dtype=torch.int64)
    launch_triton._zero_rows(out, rows)
    expect = torch.full(shape, float("nan"), dtype=dtype)
    expect[rows] = 0
    assert torch.equal(out.isnan(), expect.isnan())
    assert (out[rows] == 0).all() and not torch.signbit(out[rows]).any()
