"""The Triton varlen kernels (backend "triton") against a float64 brute force, in Triton's
interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) or on a GPU.

Shapes are tiny (the interpreter is slow); tests/gpu/test_triton_varlen_gpu.py has full sizes.
No bf16 here: the interpreter stores bf16 as raw 16-bit integers, so its bf16 dot is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import packattn
from packattn import dispatch
from packattn import mask as masks
from packattn.backends import triton_varlen
from packattn.mask import Mask
from packattn.varlen import Varlen

pytestmark = pytest.mark.skipif(
    triton_varlen.TritonVarlenBackend().unavailable() is not None, reason="triton backend unavailable here"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


def make_inputs(lengths_q, lengths_kv=None, heads=(2, 2), head_dim=32, dtype=torch.float32, pad=None, seed=0):
    seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=pad, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()

    q, k, v = rand(seqs.total_q, heads[0]), rand(seqs.total_kv, heads[1]), rand(seqs.total_kv, heads[1])
    dout = torch.randn(seqs.total_q, heads[0], head_dim, generator=gen).to(DEVICE, dtype)
    return seqs, q, k, v, dout


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


@pytest.mark.parametrize("head_dim", [64, 96])
def test_head_dims(head_dim):
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


@pytest.mark.parametrize("head_dim", [32, 96])
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


@pytest.mark.parametrize("pass_name", ["dkdv_choice", "dq_choice"])
def test_backward_refuses_a_pass_changed_after_the_forward(monkeypatch, pass_name):
    """The forward builds dK/dV key tiles and dQ query tiles for one pass each (`dkdv_choice`,
    `dq_choice`); a backward that would run another (the environment switches changed in between)
    stops with a clear error."""
    seqs, q, k, v, dout = make_inputs([37, 5], heads=(2, 1))
    out = packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    plan = triton_varlen.bwd_plan(q, k, v)
    rows, cols, gluon = getattr(plan, pass_name)
    changed = dataclasses.replace(plan, **{pass_name: (2 * rows, cols, not gluon)})
    monkeypatch.setattr(triton_varlen, "bwd_plan", lambda *a: changed)
    name = "dK/dV" if pass_name == "dkdv_choice" else "dQ"
    with pytest.raises(RuntimeError, match=f"the {name} pass changed between forward and backward"):
        torch.autograd.grad(out, (q, k, v), dout)
    monkeypatch.undo()
    out = packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    assert all(g is not None for g in torch.autograd.grad(out, (q, k, v), dout))


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


# ---------------------------------------------------------------- tile tables (torch only, no kernel)
@pytest.mark.parametrize("by_keys", [False, True], ids=["query_tiles", "key_tiles"])
def test_tile_tables_cover_exactly_the_visible_pairs(by_keys):
    block, step = (16, 8) if by_keys else (8, 16)
    cases = [([0, 1, 17, 37, 40], None), ([17, 0, 37, 5, 30], [40, 9, 3, 0, 30])]
    mask_opts = [{}, {"causal": True}, {"causal": "top_left"}, {"window": (5, 3)}, {"causal": True, "chunk_size": 12},
                 {"causal": True, "window": (9, 0), "chunk_size": 20}, {"window": (-1, 2), "chunk_size": 7}]
    bands = 0
    for lengths_q, lengths_kv in cases:
        seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=8)
        for opts in mask_opts:
            mask = Mask.make(**opts)
            table = triton_varlen.build_tile_table(seqs, mask, by_keys, block, step).tolist()
            own = seqs.lengths_kv if by_keys else seqs.lengths_q
            assert len(table) == -(-(seqs.total_kv if by_keys else seqs.total_q) // block) + seqs.num_seqs
            seen = set()
            for seq, start, lo, mid_lo, mid_hi, hi in table:
                if seq < 0:
                    continue
                seen.add((seq, start))
                vis = masks.dense_mask(mask, seqs.lengths_q[seq], seqs.lengths_kv[seq])
                vis = (vis.t() if by_keys else vis)[start:start + block]  # (own rows of the tile, other side)
                other = vis.any(0).nonzero().flatten().tolist()
                if other:
                    assert lo <= other[0] and other[-1] < hi, (opts, seq, start, lo, hi, other)
                if mid_lo < mid_hi:  # the unmasked band: whole blocks on the grid lo + i * step
                    assert lo <= mid_lo and mid_hi <= hi and (mid_lo - lo) % step == 0 and (mid_hi - mid_lo) % step == 0
                    assert vis[:, mid_lo:mid_hi].all(), (opts, seq, start, mid_lo, mid_hi)
                    bands += 1
                else:
                    assert mid_lo == mid_hi == hi
            assert seen == {(i, b) for i, n in enumerate(own) for b in range(0, n, block)}
    assert bands > 0


def test_tile_tables_put_the_longest_work_first():
    seqs = Varlen.from_lengths([5, 300, 40])
    table = triton_varlen.build_tile_table(seqs, Mask.make(causal=True), False, 32, 32)
    work = [(hi - lo) if seq >= 0 else -1 for seq, _, lo, _, _, hi in table.tolist()]
    assert work == sorted(work, reverse=True)


# ---------------------------------------------------------------- dispatch and the custom ops
def _params(device_type="cpu", **overrides):
    fields = dict(device_type=device_type, dtype=torch.float16, heads_q=4, heads_kv=2, head_dim=128, head_dim_v=128,
                  kind="varlen", pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=17,
                  max_seqlen_kv=17, mask=Mask.make(causal=True), return_lse=False, deterministic=True,
                  requires_grad=True)
    fields.update(overrides)
    return dispatch.Params(**fields)


def test_supported_and_unsupported_params():
    backend = triton_varlen.TritonVarlenBackend()
    assert backend.unsupported(_params("cuda")) is None
    for head_dim in (32, 64, 96, 128, 192, 256):
        assert backend.unsupported(_params("cuda", head_dim=head_dim, head_dim_v=head_dim)) is None
    assert "head_dim" in backend.unsupported(_params("cuda", head_dim=80, head_dim_v=80))
    assert "equal" in backend.unsupported(_params("cuda", head_dim_v=64))
    assert "dtype" in backend.unsupported(_params("cuda", dtype=torch.float64))
    assert "tree" in backend.unsupported(_params("cuda", kind="tree"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch rule")
def test_cpu_auto_dispatch_skips_triton_but_explicit_request_runs_it():
    reasons = dict(dispatch.reasons(_params("cpu")))
    assert reasons["triton"] is not None and "backend='triton'" in reasons["triton"]
    assert dict(dispatch.reasons(_params("cpu"), "triton"))["triton"] is None
    seqs, q, k, v, _ = make_inputs([9, 4])
    assert dispatch.select(_params("cpu", dtype=torch.float32, head_dim=32, head_dim_v=32)).name != "triton"
    packattn.attention(q, k, v, seqs, backend="triton")


def test_custom_ops_opcheck():
    seqs, q, k, v, dout = make_inputs([9, 0, 20], [12, 3, 20], heads=(2, 1))
    mask = Mask.make(causal=True)
    fwd, dkdv = (triton_varlen.launch_config(name, 32, q.dtype, q.device) for name in ("fwd", "dkdv"))
    q_tiles = triton_varlen.build_tile_table(seqs, mask, False, fwd.block_m, fwd.block_n)
    key_tiles = triton_varlen.build_tile_table(seqs, mask, True, dkdv.block_n, dkdv.block_m)
    tables = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.cu_seqlens_q, seqs.cu_seqlens_kv, q_tiles, q_tiles, key_tiles]
    args = (q, k, v, tables, None, None, 0.2, [-1, 0, 0, 0, 0, 0, 0, 0, 0])
    torch.library.opcheck(torch.ops.packattn.varlen_fwd.default, args)
    out, lse = torch.ops.packattn.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.packattn.varlen_bwd.default,
                          (dout, None, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *tables[:4],
                           q_tiles, key_tiles, 0.2, -1, 0, 0, False, False, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_keeps_one_graph():
    seqs, q, k, v, dout = make_inputs([17, 30])

    def step(q, k, v):
        return packattn.attention(q, k, v, seqs, causal=True, backend="triton")

    eager = step(q, k, v)  # also fills the dispatch cache (a miss logs, which dynamo cannot trace)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    out = compiled(q, k, v)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for got, want in zip(grads, torch.autograd.grad(step(q, k, v), (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_eager_fast_path_equals_custom_op(monkeypatch):
    # eager calls skip the custom-op machinery (packattn.backends.fast_op); with the op forced the
    # kernels and their arguments are the same, so out, lse and every gradient are bitwise equal
    from packattn.backends import fast_op

    seqs, q, k, v, dout = make_inputs([9, 0, 20, 1], heads=(4, 2), pad=8)
    dlse = torch.randn(4, seqs.total_q, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    used = []

    def record(path):
        def call(op, eager, *args):
            used.append(path)
            return op(*args) if path == "op" else eager(*args)
        return call

    results = {}
    for path in ("eager", "op"):
        monkeypatch.setattr(fast_op, "call", record(path))
        out, lse = packattn.attention(q, k, v, seqs, causal=True, window=(5, 0), backend="triton", return_lse=True)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
        results[path] = (out, lse, *grads)
    assert used == ["eager", "op"]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["eager"], results["op"]):
        assert torch.equal(a, b), name


def test_fast_op_uses_the_op_for_tensor_subclasses_and_under_compile(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from packattn.backends import fast_op

    def op(*args):
        return "op"

    def eager(*args):
        return "eager"

    plain = torch.ones(2)
    assert fast_op.call(op, eager, plain, [plain], 1.0) == "eager"
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(plain)
        assert fast_op.call(op, eager, plain, [fake], 1.0) == "op"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fast_op.call(op, eager, plain) == "op"


@pytest.mark.parametrize("length,short", [(512, True), (513, False)])
def test_short_sequences_select_the_short_configs(monkeypatch, length, short):
    """No sequence longer than SHORT_SEQLEN: the forward op is told ``short_seqs`` (which picks the
    short-sequence Gluon forward and dQ configs on a GPU; the forward builds the dQ tile table for the
    config `dq_choice` names with ``short_seqs``)."""
    from packattn.backends import triton_bwd_gluon, triton_fwd_gluon

    captured = {}

    def fake_call(op, eager, q, k, v, tables, pad_q, pad_kv, scale, options):
        captured.update(zip(triton_varlen.FWD_OPTIONS, options))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(triton_varlen.fast_op, "call", fake_call)
    seqs, q, k, v, _ = make_inputs([length, 7])
    packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    assert captured["short_seqs"] == short
    assert triton_varlen.SHORT_SEQLEN == 512
    short_dq, dq = triton_bwd_gluon.dq_config(128, True), triton_bwd_gluon.dq_config(128)
    assert short_dq != dq and short_dq == triton_bwd_gluon.DQ_SHORT_CONFIGS[128]
    # the 64 x 64 short forward only on the GPUs it was measured faster on (SHORT_CONFIG_GPUS)
    monkeypatch.setattr(triton_fwd_gluon, "_short_config_gpu", lambda index: True)
    assert triton_fwd_gluon.config_for(128, short_seqs=True) == triton_fwd_gluon.SHORT_CONFIGS[128]
    assert triton_fwd_gluon.config_for(64, short_seqs=True) == triton_fwd_gluon.CONFIGS[64]
    monkeypatch.setattr(triton_fwd_gluon, "_short_config_gpu", lambda index: False)
    assert triton_fwd_gluon.config_for(128, short_seqs=True) == triton_fwd_gluon.CONFIGS[128]
    assert triton_fwd_gluon.config_for(128, short_seqs=True, device=torch.device("cuda", 3)) == \
        triton_fwd_gluon.CONFIGS[128]


def test_short_config_gpus_by_name(monkeypatch):
    from packattn.backends import triton_fwd_gluon

    triton_fwd_gluon._short_config_gpu.cache_clear()
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    try:
        assert triton_fwd_gluon._short_config_gpu(0) and not triton_fwd_gluon._short_config_gpu(1)
        assert not triton_fwd_gluon._short_config_gpu(-1)  # no CUDA device
    finally:
        triton_fwd_gluon._short_config_gpu.cache_clear()


# ---------------------------------------------------------------- delta from O in the one-consumer Gluon dQ pass
class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` appends ``(name, args, kwargs)`` to ``log``."""

    def __init__(self, log, name):
        self.log, self.name, self.__name__ = log, name, name  # (`_launch` keys retries by kernel name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, args, kwargs))


def _planned_launches(monkeypatch, dkdv_text, dq_text, with_dlse, short_seqs=False):
    """`_varlen_bwd_planned` with a plan of these Gluon configs (None: the Triton pass) on CPU tensors,
    every kernel replaced by a recorder: ``(plan, out, launches)``, launches in order."""
    from packattn.backends import triton_bwd_gluon as tb
    from packattn.backends import triton_fwd_gluon
    from packattn.kernels import (
        varlen_bwd,
        varlen_bwd_gluon,
        varlen_bwd_gluon_dq_ws,
        varlen_bwd_gluon_ws,
    )

    monkeypatch.setattr(triton_fwd_gluon, "_num_sms", lambda index: 132)  # (persistent grids: a fake device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    log = []
    for module, name, label in ((varlen_bwd_gluon_dq_ws, "varlen_bwd_dq_gluon_ws_kernel", "dq"),
                                (varlen_bwd_gluon, "varlen_bwd_dq_gluon_kernel", "dq"),
                                (varlen_bwd_gluon_ws, "varlen_bwd_dkdv_gluon_ws_kernel", "dkdv"),
                                (varlen_bwd, "bwd_dq_kernel", "dq"), (varlen_bwd, "bwd_dkdv_kernel", "dkdv"),
                                (varlen_bwd, "bwd_preprocess_kernel", "preprocess")):
        monkeypatch.setattr(module, name, _Recorder(log, label))
    dkdv = tb.parse_config(dkdv_text) if dkdv_text else None
    dq = tb.parse_config(dq_text) if dq_text else None
    plan = triton_varlen.BwdPlan(dkdv, dq, (64, 64, dkdv is not None), (64, 64, dq is not None), short_seqs)
    rows, heads, d = 256, 4, 128
    gen = torch.Generator().manual_seed(0)
    q, k, v, out, dout = (torch.randn(rows, heads, d, generator=gen).to(torch.bfloat16) for _ in range(5))
    lse = torch.randn(heads, rows, generator=gen)
    dlse = torch.randn(heads, rows, generator=gen) if with_dlse else None
    cu = torch.tensor([0, rows], dtype=torch.int32)
    tiles = torch.zeros(rows // 64 + 1, 6, dtype=torch.int32)
    triton_varlen._varlen_bwd_planned(plan, dout, dlse, q, k, v, out, lse, cu, cu, cu[:1] * 0, cu[:1] * 0, tiles,
                                      tiles, 0.1, -1, 0, 0, False, False, False)
    return plan, out, lse, log


@pytest.mark.parametrize("fused", [False, True])
def test_short_batches_run_the_backward_in_their_head_sections(monkeypatch, fused):
    """A plan for a batch of short sequences hands both warp-specialised passes the short work order
    (`triton_fwd_gluon.SHORT_HEAD_SECTION` kv-head groups per section), others the default one."""
    from packattn.backends import triton_fwd_gluon

    dq = "64,64,2,4,ws" if fused else "128,64,4,8,ws"
    for short, groups in ((False, triton_fwd_gluon.HEAD_SECTION), (True, triton_fwd_gluon.SHORT_HEAD_SECTION)):
        _, _, _, log = _planned_launches(monkeypatch, "64,64,2,4,ws", dq, False, short_seqs=short)
        sections = {name: args[-2] for name, args, _ in log if name in ("dq", "dkdv")}
        assert sections == {"dq": groups, "dkdv": groups}  # MHA: kv-head groups == heads


def test_fused_delta_runs_dq_first_without_the_preprocess(monkeypatch):
    """One-consumer WS dQ (the d = 128 short-sequence config), Gluon dK/dV, no dlse: no preprocess; the dQ
    pass (DELTA_FROM_O, an O descriptor) writes a zero-initialised delta that the dK/dV pass then reads."""
    from packattn.backends import triton_bwd_gluon as tb

    short = tb.DQ_SHORT_CONFIGS[128].label()
    plan, out, lse, log = _planned_launches(monkeypatch, "64,64,2,4,ws", short, False)
    assert triton_varlen.fuses_delta(plan, None)
    assert [name for name, _, _ in log] == ["dq", "dkdv"]
    (_, dq_args, dq_kwargs), (_, dkdv_args, _) = log
    assert dq_kwargs["DELTA_FROM_O"] is True and dq_kwargs["BLOCK_M"] == 64
    assert dq_args[4].base is out and list(dq_args[4].block_shape) == [64, 128]
    delta = dq_args[6]  # (q, k, v, dO, O descriptors, Lse, Delta, ...)
    assert dkdv_args[5] is delta  # (q, k, v, dO descriptors, Lse, Delta, ...): the same tensor
    assert delta.dtype == torch.float32 and delta.shape == lse.shape and delta.is_contiguous()
    assert torch.equal(delta, torch.zeros_like(lse))  # zeros: rows no dQ tile writes are read with P = 0


@pytest.mark.parametrize("dkdv,dq,with_dlse", [
    ("64,64,2,4,ws", "64,64,2,4,ws", True),      # dlse: its term stays in the preprocess
    ("64,64,2,4,ws", "128,64,4,8,ws", False),    # two-consumer dQ
    ("64,128,2,8,ws", "128,64,4,8,ws,persistent", False),
    (None, "64,64,2,4,ws", False),               # Triton dK/dV pass
    ("64,64,2,4,ws", None, False),               # Triton dQ pass
])
def test_other_plans_keep_preprocess_dkdv_dq(monkeypatch, dkdv, dq, with_dlse):
    plan, _, lse, log = _planned_launches(monkeypatch, dkdv, dq, with_dlse)
    assert not triton_varlen.fuses_delta(plan, lse if with_dlse else None)
    assert [name for name, _, _ in log] == ["preprocess", "dkdv", "dq"]
    (_, pre_args, pre_kwargs), (_, dkdv_args, _), (_, dq_args, dq_kwargs) = log
    assert pre_kwargs["HAS_DLSE"] is with_dlse
    delta = pre_args[4]  # (Out, dOut, Lse, dLse, Delta, ...)
    assert any(a is delta for a in dkdv_args) and any(a is delta for a in dq_args)
    assert dq_kwargs.get("DELTA_FROM_O", False) is False
    if "DELTA_FROM_O" in dq_kwargs:  # the WS dQ kernel (two consumers or one) without it: no O descriptor
        assert dq_args[4] is None
    else:  # the Triton dQ pass
        assert dq is None


@pytest.mark.parametrize("opts", SELF_MASKS, ids=lambda o: Mask.make(**o).describe())
@pytest.mark.parametrize("lengths", [([17, 0, 1, 37, 100, 129], None), ([70, 65, 130], [0, 3, 200])])
def test_fused_delta_rows_left_zero_see_no_key(opts, lengths):
    """What the dK/dV pass reads after the fused dQ pass: delta = rowsum(dO O) on the rows of 64-query tiles
    with key blocks (the tile table the one-consumer dQ runs), 0 elsewhere. Every query row whose delta is
    left 0 sees no key (P = 0 there in the dK/dV pass), so the 0 is never used."""
    mask = Mask.make(**opts)
    seqs = Varlen.from_lengths(*lengths)
    table = triton_varlen.build_tile_table(seqs, mask, False, 64, 64)
    written = torch.zeros(seqs.total_q, dtype=torch.bool)
    for seq, start, lo, _, _, hi in table.tolist():
        if seq >= 0 and hi > lo:  # num_blocks > 0: the tile computes and stores delta for its rows < len_q
            first = seqs.host_starts_q[seq] + start
            written[first:min(first + 64, seqs.host_starts_q[seq] + seqs.lengths_q[seq])] = True
    for i, (lq, lk) in enumerate(zip(seqs.lengths_q, seqs.lengths_kv)):
        if lq == 0:
            continue
        sees = masks.dense_mask(mask, lq, lk).any(dim=1) if lk else torch.zeros(lq, dtype=torch.bool)
        rows = written[seqs.host_starts_q[i]:seqs.host_starts_q[i] + lq]
        assert not (sees & ~rows).any(), f"sequence {i}: a row that sees a key has no delta"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(10, 16, 8), (10, 1, 1), (7, 3, 1), (0, 2, 4)])
def test_zero_rows_zeroes_exactly_the_padding_rows(dtype, shape):
    """Padding rows of outputs are zeroed through a wide-integer view of the rows; every other element
    keeps what it held, and the zeros are +0 in the output's dtype."""
    out = torch.full(shape, float("nan"), dtype=dtype)
    rows = torch.tensor([r for r in (0, 3, 4, 9) if r < shape[0]], dtype=torch.int64)
    triton_varlen._zero_rows(out, rows)
    expect = torch.full(shape, float("nan"), dtype=dtype)
    expect[rows] = 0
    assert torch.equal(out.isnan(), expect.isnan())
    assert (out[rows] == 0).all() and not torch.signbit(out[rows]).any()
