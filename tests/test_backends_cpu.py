"""The CPU backends ("reference", "sdpa") against the float64 oracle on random packed and dense batches:
forward out and lse, gradients, padding rows, rows that see no key, dtypes fp32/fp16/bf16/fp64."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle import (
    LOW_PRECISION,
    assert_close,
    assert_lse_close,
    oracle_grads,
    packed_layout,
    same_dtype_grads,
    valid_rows,
)
from packattn import DotProductAttention, Varlen, attention
from packattn.backends.base import Problem
from packattn.backends.reference import reference_attention
from packattn.mask import Mask

BACKENDS = ["reference", "sdpa"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the oracle comparisons are cheap at these sizes: at least 150 examples even in the "ci" profile
MANY = settings(max_examples=max(150, settings.default.max_examples))

# lengths: 0, 1, around powers of two, anything up to 40 (4 sequences -> at most ~160 rows)
LENGTH = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 9, 15, 17, 31, 33]), st.integers(0, 40))
HEAD_DIMS = [8, 16, 24, 40, 64, 72, 128, 160, 256]
CAUSAL = st.sampled_from([False, True, "top_left"])
WINDOW = st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12)))
CHUNK = st.one_of(st.none(), st.integers(1, 12))


@dataclass
class Case:
    lengths_q: list
    lengths_kv: list | None  # None = self-attention
    pad: int | None
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    causal: object
    window: tuple | None
    chunk_size: int | None
    scale: float | None
    dtype: torch.dtype
    seed: int

    @property
    def mask_kwargs(self):
        return dict(causal=self.causal, window=self.window, chunk_size=self.chunk_size, scale=self.scale)


@st.composite
def head_config(draw):
    heads_kv = draw(st.sampled_from([1, 2]))
    heads_q = heads_kv * draw(st.sampled_from([1, 2, 3]))  # MHA, GQA, MQA (heads_kv = 1)
    d = draw(st.sampled_from(HEAD_DIMS))
    dv = draw(st.sampled_from([d, d, d, 8, 32]))
    scale = draw(st.one_of(st.none(), st.floats(0.25, 2.0).map(lambda f: f / math.sqrt(d))))
    return heads_q, heads_kv, d, dv, scale


@st.composite
def packed_cases(draw, dtypes=tuple(DTYPES)):
    n = draw(st.integers(0, 4))
    lengths_q = draw(st.lists(LENGTH, min_size=n, max_size=n))
    lengths_kv = draw(st.one_of(st.none(), st.lists(LENGTH, min_size=n, max_size=n)))
    heads_q, heads_kv, d, dv, scale = draw(head_config())
    return Case(
        lengths_q, lengths_kv, draw(st.sampled_from([None, 1, 4, 7, 16])), heads_q, heads_kv, d, dv,
        draw(CAUSAL), draw(WINDOW), draw(CHUNK), scale, draw(st.sampled_from(dtypes)), draw(st.integers(0, 2**31 - 1)),
    )


def randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def make_inputs(case: Case, total_q: int, total_kv: int):
    gen = torch.Generator().manual_seed(case.seed)
    q = randn(gen, total_q, case.heads_q, case.head_dim, dtype=case.dtype)
    k = randn(gen, total_kv, case.heads_kv, case.head_dim, dtype=case.dtype)
    v = randn(gen, total_kv, case.heads_kv, case.head_dim_v, dtype=case.dtype)
    dout = randn(gen, total_q, case.heads_q, case.head_dim_v, dtype=case.dtype)
    return q, k, v, dout


def run_backend(backend, q, k, v, dout, seqs, *, return_lse, **kwargs):
    """Forward + backward through attention(); returns out, lse (or None), (dq, dk, dv)."""
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    res = attention(qb, kb, vb, seqs, backend=backend, return_lse=return_lse, **kwargs)
    out, lse = res if return_lse else (res, None)
    assert out.requires_grad, "the output must stay attached to the graph (even when empty)"
    grads = torch.autograd.grad(out, (qb, kb, vb), dout)
    return out.detach(), lse, grads


def check_semantics(out, lse, grads, ref_lse, valid_q, valid_kv, where=""):
    """Padding rows exact zeros in out/dq/dk/dv; rows that see no key: out 0 and lse -inf; no NaN."""
    dq, dk, dv = grads
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any() and torch.isfinite(t).all(), f"{where}: non-finite values in {name}"
    assert (out[~valid_q] == 0).all(), f"{where}: padding rows of out are not exact zeros"
    assert (dq[~valid_q] == 0).all(), f"{where}: padding rows of dq are not exact zeros"
    assert (dk[~valid_kv] == 0).all() and (dv[~valid_kv] == 0).all(), f"{where}: padding rows of dk/dv are not exact zeros"
    empty = torch.isneginf(ref_lse).all(dim=0)  # rows in no sequence or seeing no key (same for every head)
    assert (out[empty] == 0).all(), f"{where}: rows that see no key must be exact zeros"
    if lse is not None:
        assert torch.isneginf(lse[:, empty]).all(), f"{where}: rows that see no key must have lse = -inf"
        assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), f"{where}: NaN/+inf in lse"


def compare(case_dtype, out, grads, ref_out, ref_grads, base_out=None, base_grads=None, where=""):
    low = case_dtype in LOW_PRECISION
    assert_close(f"{where} out", out, ref_out, base_out if low else None)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads or (None,) * 3):
        assert_close(f"{where} {name}", g, r, b if low else None)


# ------------------------------------------------------------------------------------ packed (thd)
@pytest.mark.parametrize("backend", BACKENDS)
@MANY
@given(case=packed_cases())
def test_packed_against_oracle(backend, case: Case):
    lk = case.lengths_q if case.lengths_kv is None else case.lengths_kv
    seqs = Varlen.from_lengths(case.lengths_q, case.lengths_kv, pad_to_multiple=case.pad)
    starts_q, total_q = packed_layout(case.lengths_q, case.pad)
    starts_kv, total_kv = packed_layout(lk, case.pad)
    assert (seqs.total_q, seqs.total_kv) == (total_q, total_kv)
    q, k, v, dout = make_inputs(case, total_q, total_kv)
    layout = (case.lengths_q, lk, starts_q, starts_kv, total_q)
    mask = dict(causal=case.causal, window=case.window, chunk_size=case.chunk_size, scale=case.scale)
    ref_out, ref_lse, ref_grads = oracle_grads(q, k, v, dout, *layout, **mask)

    want_lse = backend == "reference"  # sdpa does not return the lse
    out, lse, grads = run_backend(backend, q, k, v, dout, seqs, return_lse=want_lse, **mask)

    assert out.shape == (total_q, case.heads_q, case.head_dim_v) and out.dtype == case.dtype
    assert all(g.dtype == case.dtype for g in grads)
    where = f"{backend} {case.dtype}"
    check_semantics(out, lse, grads, ref_lse, valid_rows(case.lengths_q, starts_q, total_q),
                    valid_rows(lk, starts_kv, total_kv), where)
    if lse is not None:
        assert lse.shape == (case.heads_q, total_q)
        assert_lse_close(f"{where} lse", lse, ref_lse)
    base_out = base_grads = None
    if case.dtype in LOW_PRECISION:
        base_out, base_grads = same_dtype_grads(q, k, v, dout, *layout, **mask)
    compare(case.dtype, out, grads, ref_out, ref_grads, base_out, base_grads, where)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "lengths_q,lengths_kv,opts,empty_rows",
    [
        # bottom-right causal, more queries than keys: the first 3 queries see nothing
        ([5], [2], dict(causal=True), [0, 1, 2]),
        # sequence without keys
        ([2, 3], [0, 4], dict(), [0, 1]),
        # non-causal chunk (bottom-right): queries aligned at -2, -1 are in chunk -1, which has no key
        ([6], [4], dict(chunk_size=2, causal=False, window=(0, -1)), [0, 1]),
        # top-left diagonal window: queries aligned past the last key see nothing
        ([4], [2], dict(causal="top_left", window=(0, 0)), [2, 3]),
        # several sequences, padding-free, with an empty one in the middle
        ([2, 3, 1], [1, 0, 2], dict(causal=True), [0, 2, 3, 4]),
    ],
)
def test_rows_that_see_no_key(backend, lengths_q, lengths_kv, opts, empty_rows):
    torch.manual_seed(0)
    seqs = Varlen.from_lengths(lengths_q, lengths_kv)
    q = torch.randn(seqs.total_q, 2, 8)
    k, v = torch.randn(seqs.total_kv, 1, 8), torch.randn(seqs.total_kv, 1, 8)
    dout = torch.randn_like(q)
    want_lse = backend == "reference"
    out, lse, grads = run_backend(backend, q, k, v, dout, seqs, return_lse=want_lse, **opts)
    starts_q, _ = packed_layout(lengths_q)
    starts_kv, _ = packed_layout(lengths_kv)
    ref_out, ref_lse, ref_grads = oracle_grads(q, k, v, dout, lengths_q, lengths_kv, starts_q, starts_kv, seqs.total_q, **opts)
    assert torch.isneginf(ref_lse).all(dim=0).nonzero().flatten().tolist() == empty_rows  # the case is what it says
    check_semantics(out, lse, grads, ref_lse, torch.ones(seqs.total_q, dtype=torch.bool),
                    torch.ones(seqs.total_kv, dtype=torch.bool), backend)
    if lse is not None:
        assert_lse_close("lse", lse, ref_lse)
    compare(torch.float32, out, grads, ref_out, ref_grads, where=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend):
    for lengths_q, lengths_kv in (([], []), ([0, 0], [0, 0]), ([3], [0]), ([0], [4])):
        seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=4)
        q = torch.randn(seqs.total_q, 2, 8)
        k, v = torch.randn(seqs.total_kv, 2, 8), torch.randn(seqs.total_kv, 2, 8)
        out, lse, (dq, dk, dv) = run_backend(
            backend, q, k, v, torch.randn_like(q), seqs, return_lse=backend == "reference", causal=True
        )
        assert out.shape == q.shape and (out == 0).all() and (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
        if lse is not None:
            assert lse.shape == (2, seqs.total_q) and lse.dtype == torch.float32 and torch.isneginf(lse).all()


# ------------------------------------------------------------------------------------ dense (bshd / sbhd)
def to_thd(x, layout):
    if layout == "sbhd":
        x = x.transpose(0, 1)
    return x.reshape(-1, *x.shape[2:])


def from_thd(x, layout, batch, seq):
    x = x.reshape(batch, seq, *x.shape[1:])
    return x.transpose(0, 1) if layout == "sbhd" else x


@st.composite
def dense_cases(draw):
    heads_q, heads_kv, d, dv, scale = draw(head_config())
    batch = draw(st.integers(0, 3))
    sq = draw(st.integers(0, 20))
    sk = draw(st.one_of(st.just(sq), st.integers(0, 20)))
    case = Case(
        [sq] * batch, [sk] * batch, None, heads_q, heads_kv, d, dv, draw(CAUSAL), draw(WINDOW), draw(CHUNK), scale,
        draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1)),
    )
    return case, draw(st.sampled_from(["bshd", "sbhd"])), batch, sq, sk


@pytest.mark.parametrize("backend", BACKENDS)
@MANY
@given(dense=dense_cases())
def test_dense_against_oracle(backend, dense):
    case, layout, batch, sq, sk = dense
    q, k, v, dout = make_inputs(case, batch * sq, batch * sk)  # thd, then laid out densely
    qd, kd, vd, doutd = (from_thd(t, layout, batch, n) for t, n in ((q, sq), (k, sk), (v, sk), (dout, sq)))
    assert qd.shape == ((batch, sq) if layout == "bshd" else (sq, batch)) + (case.heads_q, case.head_dim)
    starts_q, starts_kv = [i * sq for i in range(batch)], [i * sk for i in range(batch)]
    args = ([sq] * batch, [sk] * batch, starts_q, starts_kv, batch * sq)
    mask = dict(causal=case.causal, window=case.window, chunk_size=case.chunk_size, scale=case.scale)
    ref_out, ref_lse, ref_grads = oracle_grads(q, k, v, dout, *args, **mask)

    want_lse = backend == "reference"
    out, lse, grads = run_backend(backend, qd, kd, vd, doutd, None, return_lse=want_lse, layout=layout, **mask)
    assert out.shape == qd.shape[:2] + (case.heads_q, case.head_dim_v)
    assert out.dtype == case.dtype
    out_t = to_thd(out, layout)
    grads_t = tuple(to_thd(g, layout) for g in grads)
    where = f"{backend} {layout} {case.dtype}"
    ones_q, ones_kv = torch.ones(batch * sq, dtype=torch.bool), torch.ones(batch * sk, dtype=torch.bool)
    lse_t = None
    if lse is not None:
        assert lse.shape == (batch, case.heads_q, sq) and lse.dtype == torch.float32
        lse_t = lse.permute(1, 0, 2).reshape(case.heads_q, batch * sq)
        assert_lse_close(f"{where} lse", lse_t, ref_lse)
    check_semantics(out_t, lse_t, grads_t, ref_lse, ones_q, ones_kv, where)
    base_out = base_grads = None
    if case.dtype in LOW_PRECISION:
        base_out, base_grads = same_dtype_grads(q, k, v, dout, *args, **mask)
    compare(case.dtype, out_t, grads_t, ref_out, ref_grads, base_out, base_grads, where)


# ------------------------------------------------------------------------------------ reference specifics
@given(case=packed_cases(dtypes=(torch.float32,)), budget=st.integers(1, 400))
def test_reference_chunking_and_grouping(case: Case, budget):
    """A tiny score budget forces query chunks and sequence groups (and checkpointed recompute in
    backward); the result must not change."""
    lk = case.lengths_q if case.lengths_kv is None else case.lengths_kv
    seqs = Varlen.from_lengths(case.lengths_q, case.lengths_kv, pad_to_multiple=case.pad)
    starts_q, total_q = packed_layout(case.lengths_q, case.pad)
    starts_kv, total_kv = packed_layout(lk, case.pad)
    q, k, v, dout = make_inputs(case, total_q, total_kv)
    mask = Mask.make(case.causal, case.window, case.chunk_size)
    scale = case.scale if case.scale is not None else 1 / math.sqrt(case.head_dim)
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(Problem(qb, kb, vb, seqs, mask, scale, True, False), score_budget=budget)
    grads = torch.autograd.grad(out, (qb, kb, vb), dout)
    args = (case.lengths_q, lk, starts_q, starts_kv, total_q)
    ref_out, ref_lse, ref_grads = oracle_grads(
        q, k, v, dout, *args, causal=case.causal, window=case.window, chunk_size=case.chunk_size, scale=scale
    )
    assert_lse_close("lse", lse, ref_lse)
    compare(torch.float32, out.detach(), grads, ref_out, ref_grads, where=f"budget={budget}")


def test_reference_float64():
    torch.manual_seed(5)
    lengths_q, lengths_kv = [5, 0, 9, 1], [7, 3, 9, 0]
    seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=4)
    starts_q, total_q = packed_layout(lengths_q, 4)
    starts_kv, total_kv = packed_layout(lengths_kv, 4)
    q = torch.randn(total_q, 4, 16, dtype=torch.float64)
    k, v = torch.randn(total_kv, 2, 16, dtype=torch.float64), torch.randn(total_kv, 2, 12, dtype=torch.float64)
    dout = torch.randn(total_q, 4, 12, dtype=torch.float64)
    for opts in (dict(causal=True), dict(causal="top_left", window=(3, 0)), dict(window=(2, 1), chunk_size=4)):
        out, lse, grads = run_backend("reference", q, k, v, dout, seqs, return_lse=True, **opts)
        assert out.dtype == torch.float64 and lse.dtype == torch.float32
        ref_out, ref_lse, ref_grads = oracle_grads(q, k, v, dout, lengths_q, lengths_kv, starts_q, starts_kv, total_q, **opts)
        compare(torch.float64, out, grads, ref_out, ref_grads, where=f"fp64 {opts}")
        assert_lse_close("lse", lse, ref_lse, rtol=1e-6)  # fp64 math, rounded to float32
        check_semantics(out, lse, grads, ref_lse, valid_rows(lengths_q, starts_q, total_q),
                        valid_rows(lengths_kv, starts_kv, total_kv), "fp64")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_and_deterministic_give_the_same_forward(backend):
    torch.manual_seed(6)
    seqs = Varlen.from_lengths([7, 0, 12], pad_to_multiple=8)
    q, k, v = (torch.randn(seqs.total_q, 2, 16) for _ in range(3))
    with_grad = attention(q.clone().requires_grad_(), k, v, seqs, causal=True, backend=backend)
    with torch.no_grad():
        plain = attention(q, k, v, seqs, causal=True, backend=backend)
        det = attention(q, k, v, seqs, causal=True, backend=backend, deterministic=True)
    assert torch.equal(with_grad.detach(), plain) and torch.equal(plain, det)


# ------------------------------------------------------------------------------------ module
@pytest.mark.parametrize("backend", BACKENDS)
def test_dot_product_attention_module(backend):
    torch.manual_seed(7)
    lengths = [4, 9, 0, 6]
    seqs = Varlen.from_lengths(lengths, pad_to_multiple=4)
    starts, total = packed_layout(lengths, 4)
    q = torch.randn(total, 4, 16, requires_grad=True)
    k, v = torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    module = DotProductAttention(causal=True, window=(3, 0), scale=0.2, backend=backend)
    assert isinstance(module, torch.nn.Module) and list(module.parameters()) == []
    assert "causal+window=(3, 0)" in repr(module) and backend in repr(module)
    out = module(q, k, v, seqs)
    ref, ref_lse = oracle_attention_plain(q, k, v, lengths, starts, total, causal=True, window=(3, 0), scale=0.2)
    assert_close("module out", out.detach(), ref)
    assert torch.equal(out, attention(q, k, v, seqs, causal=True, window=(3, 0), scale=0.2, backend=backend))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    if backend == "reference":
        out2, lse = module(q, k, v, seqs, return_lse=True)
        assert torch.equal(out2, out) and lse.shape == (4, total)
        assert_lse_close("module lse", lse, ref_lse)
    # dense module
    dense = DotProductAttention(causal="top_left", layout="bshd", backend=backend)
    qd = torch.randn(2, 5, 4, 16)
    kd, vd = torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    got = dense(qd, kd, vd)
    ref, _ = oracle_attention_plain(qd.reshape(10, 4, 16), kd.reshape(14, 2, 16), vd.reshape(14, 2, 16), [5, 5], [0, 5],
                                    10, lengths_kv=[7, 7], starts_kv=[0, 7], causal="top_left")
    assert_close("dense module", got.reshape(10, 4, 16), ref)


def oracle_attention_plain(q, k, v, lengths_q, starts_q, total_q, *, lengths_kv=None, starts_kv=None, **kwargs):
    from oracle import oracle_attention

    out, lse = oracle_attention(
        q.detach(), k.detach(), v.detach(), lengths_q, lengths_kv or lengths_q, starts_q, starts_kv or starts_q, total_q, **kwargs
    )
    return out, lse
