"""The small_seq backend (one query over at most 16 keys) and `small_seq_attention`, against a
float64 brute-force loop per item written here. On CPU the kernels run in Triton's interpreter."""

import math

import pytest
import torch
from triton_varlen_harness import DEVICE
from triton_varlen_harness import make_inputs as make_packed_inputs

import packattn
from packattn import NoBackendError, dispatch, small_seq_attention
from packattn.backends import REGISTRY
from packattn.backends.small_seq import SmallSeqBackend
from packattn.mask import Mask


# ---------------------------------------------------------------- ground truth
def brute_force(q, k, v, seqs, scale, dtype=torch.float64):
    """Loop per item and head: ``(out, lse)``; rows in no item stay zero / -inf."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((heads_q, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for i, (len_q, len_kv) in enumerate(zip(seqs.lengths_q, seqs.lengths_kv)):
        if len_q == 0 or len_kv == 0:
            continue
        row, first = seqs.host_starts_q[i], seqs.host_starts_kv[i]
        for h in range(heads_q):
            keys = k[first:first + len_kv, h // group].to(dtype)
            values = v[first:first + len_kv, h // group].to(dtype)
            scores = (keys @ q[row, h].to(dtype)) * scale
            out[row, h] = torch.softmax(scores, 0) @ values
            lse[h, row] = torch.logsumexp(scores.double(), 0)
    return out, lse


def make_inputs(lengths_kv, lengths_q=None, heads=(4, 2), head_dim=64, dtype=torch.float32, pad=None, seed=0):
    """`triton_varlen_harness.make_inputs` with the key lengths first: one query per item by default."""
    lengths_q = [1] * len(lengths_kv) if lengths_q is None else lengths_q
    return make_packed_inputs(lengths_q, lengths_kv, heads, head_dim, dtype, pad, seed)


def run_kernel(q, k, v, seqs, dout, **opts):
    out, lse = packattn.attention(q, k, v, seqs, backend="small_seq", return_lse=True, **opts)
    return out, lse, torch.autograd.grad(out, (q, k, v), dout)


def run_brute(q, k, v, seqs, dout, scale=None, dtype=torch.float64):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = brute_force(*leaves, seqs, scale, dtype)
    return out, lse, torch.autograd.grad(out, leaves, dout.to(dtype), allow_unused=True, materialize_grads=True)


def check_fp32(lengths_kv, lengths_q=None, heads=(4, 2), head_dim=64, pad=None, atol=2e-5, **opts):
    seqs, q, k, v, dout = make_inputs(lengths_kv, lengths_q, heads, head_dim, torch.float32, pad)
    out, lse, grads = run_kernel(q, k, v, seqs, dout, **opts)
    ref_out, ref_lse, ref_grads = run_brute(q, k, v, seqs, dout, opts.get("scale"))
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


def assert_zero_rows(x, rows):
    assert rows.any()
    assert torch.equal(x[rows], torch.zeros_like(x[rows]))


# ---------------------------------------------------------------- correctness
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_head_dims(head_dim):
    check_fp32([16, 0, 1, 5], head_dim=head_dim, heads=(2, 1))


def test_every_kv_length():
    check_fp32(list(range(17)), heads=(2, 2))


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_gqa_mqa(heads):
    check_fp32([7, 16, 0, 3], heads=heads)


@pytest.mark.parametrize("pad", [4, 8])
def test_padding_rows_are_exact_zeros(pad):
    lengths_kv, lengths_q = [3, 16, 0, 9, 5], [1, 1, 1, 0, 1]
    seqs, out, lse, (dq, dk, dv) = check_fp32(lengths_kv, lengths_q, heads=(4, 2), pad=pad)
    valid_q = seqs.row_map_q()[0] >= 0
    valid_kv = seqs.row_map_kv()[0] >= 0
    assert_zero_rows(out, ~valid_q)
    assert_zero_rows(dq, ~valid_q)
    assert torch.isneginf(lse[:, ~valid_q]).all()
    # the keys of the item with no query are seen by nobody: zero gradients, like padding
    unseen = ~valid_kv
    start = seqs.host_starts_kv[3]
    unseen[start:start + 9] = True
    for g in (dk, dv):
        assert_zero_rows(g, unseen)


def test_no_keys_gives_zeros_and_minus_inf():
    seqs, q, k, v, dout = make_inputs([0, 0, 2])
    out, lse, grads = run_kernel(q, k, v, seqs, dout)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isneginf(lse[:, :2]).all()
    assert torch.equal(grads[0][:2], torch.zeros_like(grads[0][:2]))
    assert not any(torch.isnan(x).any() for x in (out, lse, *grads))


@pytest.mark.parametrize("scale", [-0.4, 0.0, 2.0])
def test_explicit_scale_of_any_sign(scale):
    check_fp32([5, 16, 1], scale=scale)


def test_causal_bottom_right_is_no_mask():
    seqs, q, k, v, dout = make_inputs([5, 16, 0, 1])
    plain = run_kernel(q, k, v, seqs, dout)
    causal = run_kernel(q, k, v, seqs, dout, causal=True)
    for a, b in zip((plain[0], plain[1], *plain[2]), (causal[0], causal[1], *causal[2])):
        assert torch.equal(a, b)


def test_fp16_within_twice_torch_fp16_error():
    seqs, q, k, v, dout = make_inputs([16, 3, 0, 11, 1], heads=(4, 1), head_dim=128, dtype=torch.float16)
    out, lse, grads = run_kernel(q, k, v, seqs, dout)
    truth = run_brute(q, k, v, seqs, dout)
    low = run_brute(q, k, v, seqs, dout, dtype=torch.float16)  # the same loop in plain fp16 torch
    assert out.dtype == torch.float16 and all(g.dtype == torch.float16 for g in grads)
    for name, got, want, same in zip(("out", "dq", "dk", "dv"), (out, *grads), (truth[0], *truth[2]),
                                     (low[0], *low[2])):
        err = (got.double() - want).abs().max().item()
        torch_err = (same.double() - want).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3g} vs fp16 torch {torch_err:.3g}"
    finite = torch.isfinite(truth[1])
    torch.testing.assert_close(lse[finite].double(), truth[1][finite], atol=1e-3, rtol=0)


def test_gradient_through_lse():
    seqs, q, k, v, dout = make_inputs([4, 0, 16, 1], pad=2)
    out, lse = packattn.attention(q, k, v, seqs, backend="small_seq", return_lse=True)
    weight = torch.linspace(-1, 1, lse.numel()).view_as(lse).to(lse.device)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * weight).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r_out, r_lse = brute_force(*leaves, seqs, 1.0 / math.sqrt(q.shape[-1]))
    r_loss = (r_out * dout.double()).sum() + (torch.where(torch.isfinite(r_lse), r_lse, 0) * weight.double()).sum()
    for got, ref in zip(grads, torch.autograd.grad(r_loss, leaves)):
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)


def test_deterministic():
    seqs, q, k, v, dout = make_inputs([16, 3, 0, 9], heads=(4, 1), pad=4)
    first = run_kernel(q, k, v, seqs, dout, deterministic=True)
    second = run_kernel(q, k, v, seqs, dout, deterministic=True)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2])):
        assert torch.equal(a, b)


def test_dense_layout_through_attention():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 1, 4, 64, generator=gen).to(DEVICE)
    k, v = (torch.randn(3, 7, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
    got = packattn.attention(q, k, v, layout="bshd", backend="small_seq")
    want = packattn.attention(q, k, v, layout="bshd", backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_custom_ops_opcheck():
    seqs, q, k, v, dout = make_inputs([3, 0, 16], [1, 0, 1], heads=(2, 1), pad=2)
    from packattn.ops.small_seq.op import item_table

    args = (q.detach(), k.detach(), v.detach(), item_table(seqs), 0.3, True, True, 0)
    torch.library.opcheck(torch.ops.packattn.small_seq_fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    torch.ops.packattn.small_seq_fwd(*args)
    torch.library.opcheck(torch.ops.packattn.small_seq_bwd.default,
                          (dout, None, *args), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------- dense entry point
def dense_brute(q, k, v, lengths, scale):
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[2]
    for b, n in enumerate(lengths):
        for h in range(q.shape[1]):
            if n:
                p = torch.softmax((k[b, :n, h // group].double() @ q[b, h].double()) * scale, 0)
                out[b, h] = p @ v[b, :n, h // group].double()
    return out


@pytest.mark.parametrize("backend", ["small_seq", "reference"])
@pytest.mark.parametrize("seqlen_kv", [16, 5])
def test_dense_api(backend, seqlen_kv):
    gen = torch.Generator().manual_seed(seqlen_kv)
    lengths = [seqlen_kv, 0, 1, seqlen_kv - 2, 3]
    q = torch.randn(5, 4, 64, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(5, seqlen_kv, 2, 64, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    dout = torch.randn(5, 4, 64, generator=gen).to(DEVICE)
    out = small_seq_attention(q, k, v, torch.tensor(lengths, device=DEVICE), backend=backend)
    assert out.shape == (5, 4, 64) and out.dtype == q.dtype
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_brute(*leaves, lengths, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    # key slots past each length get exact zeros
    unused = torch.arange(seqlen_kv)[None, :] >= torch.tensor(lengths)[:, None]
    for g in grads[1:]:
        assert_zero_rows(g, unused.to(g.device))


@pytest.mark.parametrize("backend", ["reference", "small_seq"])
def test_dense_api_ignores_what_unused_slots_hold(backend):
    """K/V slots past each length holding NaN / inf change nothing: an item with no key gives zeros, the
    others the result of their valid keys; gradients are finite, and zeros in the unused slots."""
    gen = torch.Generator().manual_seed(3)
    lengths = [0, 3, 16, 1]
    q = torch.randn(4, 4, 64, generator=gen).to(DEVICE)
    k, v = (torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
    unused = (torch.arange(16)[None, :] >= torch.tensor(lengths)[:, None]).to(DEVICE)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf")], device=DEVICE).repeat(4 * 16 * 2 * 64 // 3 + 1)
    garbage = garbage[: 4 * 16 * 2 * 64].view(4, 16, 2, 64)
    dirty = [torch.where(unused[:, :, None, None], garbage, x) for x in (k, v)]
    leaves = [x.clone().requires_grad_() for x in (q, *dirty)]
    out = small_seq_attention(*leaves, lengths, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()  # no key: zeros, not NaN
    clean = small_seq_attention(q, k, v, lengths, backend=backend)
    torch.testing.assert_close(out, clean, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), dense_brute(q, k, v, lengths, 0.125), atol=2e-5, rtol=0)
    grads = torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=gen).to(DEVICE))
    assert all(torch.isfinite(g).all() for g in grads)
    for g in grads[1:]:
        assert_zero_rows(g, unused)


def test_dense_api_auto_and_lists():
    q = torch.randn(2, 2, 32, device=DEVICE)
    k = torch.randn(2, 4, 1, 32, device=DEVICE)
    out = small_seq_attention(q, k, k, [4, 2], scale=0.5)  # head_dim 32: the plain computation
    ref = dense_brute(q, k, k, [4, 2], 0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_dense_api_validation():
    q, k = torch.randn(2, 4, 64, device=DEVICE), torch.randn(2, 16, 2, 64, device=DEVICE)
    cases = [
        (TypeError, "q must be a torch.Tensor", (q.tolist(), k, k, [1, 2])),
        (TypeError, "share a dtype", (q.half(), k, k, [1, 2])),
        (TypeError, "dtype torch.int64", (q.long(), k.long(), k.long(), [1, 2])),
        (ValueError, "q must be 3-D", (q[None], k, k, [1, 2])),
        (ValueError, "17 keys per item; .* at most 16", (q, k.new_zeros(2, 17, 2, 64), k.new_zeros(2, 17, 2, 64),
                                                         [1, 2])),
        (ValueError, r"heads_q \(4\) must be a multiple of heads_kv \(3\)", (q, k.new_zeros(2, 16, 3, 64),
                                                                           k.new_zeros(2, 16, 3, 64), [1, 2])),
        (ValueError, "batch/key/head sizes disagree", (q, k, k[:1], [1, 2])),
        (ValueError, "head_dim 64 != k head_dim 32", (q, k[..., :32], k[..., :32], [1, 2])),
        (ValueError, r"kv_lengths must have shape \(2,\)", (q, k, k, [1, 2, 3])),
        (ValueError, r"kv_lengths\[1\] = 17 is outside \[0, 16\]", (q, k, k, torch.tensor([1, 17]))),
        (ValueError, r"kv_lengths\[0\] = -1", (q, k, k, [-1, 2])),
        (TypeError, "kv_lengths must hold integers", (q, k, k, torch.tensor([1.0, 2.0]))),
        (TypeError, r"kv_lengths\[1\] must be an int", (q, k, k, [1, 2.5])),
    ]
    for error, match, args in cases:
        with pytest.raises(error, match=match):
            small_seq_attention(*args)
    with pytest.raises(ValueError, match="backend must be one of"):
        small_seq_attention(q, k, k, [1, 2], backend="fast")
    with pytest.raises(ValueError, match="scale must be a finite number"):
        small_seq_attention(q, k, k, [1, 2], scale=float("nan"))
    with pytest.raises(ValueError, match=r"backend='small_seq' cannot run this call: head_dim 32 not in"):
        small_seq_attention(q[..., :32], k[..., :32], k[..., :32], [1, 2], backend="small_seq")


# ---------------------------------------------------------------- dispatch
def params(**overrides):
    fields = {"device_type": "cuda", "dtype": torch.bfloat16, "heads_q": 16, "heads_kv": 16, "head_dim": 128,
              "head_dim_v": 128, "kind": "varlen", "pad_between_seqs": False, "is_self": False, "host_lengths": True,
              "max_seqlen_q": 1, "max_seqlen_kv": 16, "mask": Mask.make(), "return_lse": False,
              "deterministic": False, "requires_grad": True}
    fields.update(overrides)
    return dispatch.Params(**fields)


def test_supported_params():
    backend = SmallSeqBackend()
    assert REGISTRY[0].name == "small_seq"
    for kw in ({}, {"max_seqlen_kv": 1}, {"max_seqlen_kv": 0}, {"kind": "dense"}, {"mask": Mask.make(True)},
               {"dtype": torch.float16}, {"dtype": torch.float32}, {"head_dim": 512, "head_dim_v": 512},
               {"heads_kv": 1}, {"pad_between_seqs": True}, {"return_lse": True, "deterministic": True},
               {"is_self": True, "max_seqlen_kv": 1, "mask": Mask.make("top_left")}):
        assert backend.unsupported(params(**kw)) is None, kw
    if backend.unavailable() is None:  # CUDA, or Triton's interpreter
        listing = dispatch.reasons(params())
        assert next(name for name, why in listing if why is None) == "small_seq"


def test_unsupported_params_say_why():
    backend = SmallSeqBackend()
    cases = [
        ({"max_seqlen_kv": 17}, "at most 16 keys per sequence; got max_seqlen_q 1, max_seqlen_kv > 16"),
        ({"max_seqlen_q": 2}, "got max_seqlen_q 2, max_seqlen_kv 16"),
        ({"mask": Mask.make(window=(3, 0))}, "no windows or chunks"),
        ({"mask": Mask.make(chunk_size=4)}, "no windows or chunks"),
        ({"mask": Mask.make("top_left")}, "top_left"),
        ({"kind": "tree"}, "tree descriptors"),
        ({"head_dim": 96, "head_dim_v": 96}, "head_dim 96 not in"),
        ({"head_dim_v": 64}, "must be equal"),
        ({"dtype": torch.float64}, "dtype torch.float64"),
        ({"device_type": "mps"}, "needs CUDA"),
    ]
    for kw, text in cases:
        why = backend.unsupported(params(**kw))
        assert why is not None and text in why, (kw, why)


def test_forced_backend_that_does_not_fit_says_why():
    seqs, q, k, v, _ = make_inputs([3, 17], [1, 2], heads=(2, 2))
    with pytest.raises(NoBackendError, match=r"small_seq: only one query over at most 16 keys per sequence; "
                                             r"got max_seqlen_q 2, max_seqlen_kv > 16"):
        packattn.attention(q, k, v, seqs, backend="small_seq")
    seqs, q, k, v, _ = make_inputs([3, 5], heads=(2, 2))
    with pytest.raises(NoBackendError, match=r"small_seq: no windows or chunks \(mask window=\(1, 0\)\)"):
        packattn.attention(q, k, v, seqs, backend="small_seq", window=(1, 0))


def test_torch_compile_keeps_one_graph():
    seqs, q, k, v, dout = make_inputs([3, 16, 0], pad=2)

    def step(q, k, v):
        return packattn.attention(q, k, v, seqs, backend="small_seq")

    eager = step(q, k, v)  # fills the dispatch cache (a miss logs, which dynamo cannot trace)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(eager, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
