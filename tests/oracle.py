"""Ground truth for the tests (DESIGN.md section 5): a float64 brute-force loop per sequence and query.

It is written from the rules stated in the docstring of ``packattn/mask.py`` and deliberately does
NOT import ``packattn.mask`` (nor any other packattn code), so a mistake there cannot hide in here:

* query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys is aligned to key position
  ``a(i) = i + Lk - Lq`` (bottom-right, the default, also when not causal) or ``a(i) = i``
  (``causal="top_left"``);
* key ``j`` is visible iff ``0 <= j < Lk`` and every enabled rule lets it through:
  causal ``j <= a(i)``; window ``(left, right)`` (-1 = unbounded) ``a(i) - left <= j <= a(i) + right``;
  chunk ``c``: ``floor(j / c) == floor(a(i) / c)``;
* a query row that sees no key, or that belongs to no sequence (padding), gives ``out = 0`` and
  ``lse = -inf``;
* GQA/MQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``.

Also here: `oracle_grads` (the oracle under float64 autograd), `same_dtype_attention` (the plain
PyTorch computation in the inputs' own low precision, whose error sets the low-precision
tolerance, flash-attn style), the packed layout arithmetic, and the tolerance checks.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------- mask rule
def aligned(i: int, len_q: int, len_kv: int, causal=False) -> int:
    """Key position query ``i`` is aligned to."""
    return i if causal == "top_left" else i + len_kv - len_q


def oracle_visible(i: int, j: int, len_q: int, len_kv: int, *, causal=False, window=None, chunk_size=None) -> bool:
    """Does query ``i`` see key ``j``? ``causal`` is False/None, True, "bottom_right" or "top_left"."""
    if not (0 <= i < len_q and 0 <= j < len_kv):
        return False
    a = aligned(i, len_q, len_kv, causal)
    if causal and j > a:  # True, "bottom_right" and "top_left" are all causal
        return False
    if window is not None:
        left, right = window
        if left != -1 and j < a - left:
            return False
        if right != -1 and j > a + right:
            return False
    if chunk_size is not None and math.floor(j / chunk_size) != math.floor(a / chunk_size):
        return False
    return True


def oracle_mask(len_q: int, len_kv: int, **mask) -> torch.Tensor:
    """The (len_q, len_kv) boolean visibility matrix of one sequence."""
    rows = [[oracle_visible(i, j, len_q, len_kv, **mask) for j in range(len_kv)] for i in range(len_q)]
    return torch.tensor(rows, dtype=torch.bool).reshape(len_q, len_kv)


# The pictures in packattn/mask.py's docstring: 4 queries, 6 keys (x = visible).
DOCSTRING_PICTURES = {
    "causal": (dict(causal=True), ["xxx...", "xxxx..", "xxxxx.", "xxxxxx"]),
    "top_left": (dict(causal="top_left"), ["x.....", "xx....", "xxx...", "xxxx.."]),
    "window": (dict(window=(1, 0)), [".xx...", "..xx..", "...xx.", "....xx"]),
    "chunk": (dict(chunk_size=2, causal=True), ["..x...", "..xx..", "....x.", "....xx"]),
}


def picture(rows):
    return torch.tensor([[c == "x" for c in row] for row in rows])


# ---------------------------------------------------------------------------------------- layout
def packed_layout(lengths, pad_to_multiple=None) -> tuple[list[int], int]:
    """First physical row of each sequence and the total rows when every sequence gets a slot
    rounded up to ``pad_to_multiple`` (None or 1: back to back)."""
    m = pad_to_multiple or 1
    starts, row = [], 0
    for n in lengths:
        starts.append(row)
        row += math.ceil(n / m) * m
    return starts, row


def valid_rows(lengths, starts, total) -> torch.Tensor:
    """Boolean (total,): True for rows that belong to a sequence."""
    valid = torch.zeros(total, dtype=torch.bool)
    for n, s in zip(lengths, starts):
        valid[s : s + n] = True
    return valid


# ---------------------------------------------------------------------------------------- oracle
def _check_layout(lengths_q, lengths_kv, starts_q, starts_kv, total_q, q, k, v):
    assert len(lengths_q) == len(lengths_kv) == len(starts_q) == len(starts_kv)
    assert q.shape[0] == total_q and k.shape[0] == v.shape[0]
    assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1] and q.shape[2] == k.shape[2]
    for n, s in zip(lengths_q, starts_q):
        assert 0 <= s and s + n <= total_q
    for n, s in zip(lengths_kv, starts_kv):
        assert 0 <= s and s + n <= k.shape[0]


def oracle_attention(
    q, k, v, lengths_q, lengths_kv, starts_q, starts_kv, total_q, *, causal=False, window=None, chunk_size=None, scale=None
):
    """``out (total_q, Hq, Dv)`` float64 and ``lse (Hq, total_q)`` float64 by brute force.

    Differentiable (float64 autograd) when the inputs require grad.
    """
    _check_layout(lengths_q, lengths_kv, starts_q, starts_kv, total_q, q, k, v)
    q64, k64, v64 = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    kv_head = torch.tensor([h // group for h in range(hq)], dtype=torch.long)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    rows: list = [None] * total_q
    lses: list = [None] * total_q
    for lq, lk, sq, sk in zip(lengths_q, lengths_kv, starts_q, starts_kv):
        for i in range(lq):
            r = sq + i
            assert rows[r] is None, f"row {r} belongs to two sequences"
            keys = [j for j in range(lk) if oracle_visible(i, j, lq, lk, causal=causal, window=window, chunk_size=chunk_size)]
            if not keys:
                rows[r] = "empty"
                continue
            key_rows = torch.tensor([sk + j for j in keys], dtype=torch.long)
            kk = k64[key_rows][:, kv_head]  # (n, Hq, D)
            vv = v64[key_rows][:, kv_head]  # (n, Hq, Dv)
            s = torch.einsum("hd,nhd->hn", q64[r], kk) * scale  # (Hq, n)
            m = s.max(dim=1).values.detach()
            e = torch.exp(s - m[:, None])
            z = e.sum(dim=1)
            rows[r] = torch.einsum("hn,nhd->hd", e / z[:, None], vv)
            lses[r] = m + torch.log(z)
    zero_row = torch.zeros(hq, dv, dtype=torch.float64)
    no_lse = torch.full((hq,), NEG_INF, dtype=torch.float64)
    if total_q == 0:
        return torch.zeros(0, hq, dv, dtype=torch.float64), torch.zeros(hq, 0, dtype=torch.float64)
    out = torch.stack([row if isinstance(row, torch.Tensor) else zero_row for row in rows])
    lse = torch.stack([x if x is not None else no_lse for x in lses], dim=1)
    return out, lse


def oracle_grads(q, k, v, dout, *args, **kwargs):
    """``(out, lse, (dq, dk, dv))`` of `oracle_attention` (float64, detached) for upstream ``dout``."""
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    out, lse = oracle_attention(q64, k64, v64, *args, **kwargs)
    if out.requires_grad:
        grads = torch.autograd.grad(out, (q64, k64, v64), dout.to(torch.float64), allow_unused=True)
        grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip((q64, k64, v64), grads))
    else:  # no row sees any key
        grads = tuple(torch.zeros_like(t) for t in (q64, k64, v64))
    return out.detach(), lse.detach(), grads


# ---------------------------------------------------------------------------------------- low-precision baseline
def same_dtype_attention(
    q, k, v, lengths_q, lengths_kv, starts_q, starts_kv, total_q, *, causal=False, window=None, chunk_size=None, scale=None
):
    """Plain PyTorch attention per sequence, every op in the inputs' dtype (matmul, masked softmax,
    matmul): the yardstick for low-precision error. Differentiable; rows that see no key are 0."""
    _check_layout(lengths_q, lengths_kv, starts_q, starts_kv, total_q, q, k, v)
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out = q.new_zeros(total_q, hq, v.shape[2])
    tie = q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()
    out = out + tie
    for lq, lk, sq, sk in zip(lengths_q, lengths_kv, starts_q, starts_kv):
        if lq == 0:
            continue
        vis = oracle_mask(lq, lk, causal=causal, window=window, chunk_size=chunk_size)
        qs = q[sq : sq + lq].transpose(0, 1)  # (Hq, Lq, D)
        ks = k[sk : sk + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[sk : sk + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        s = s.masked_fill(~vis, NEG_INF)
        any_key = vis.any(dim=1)[:, None]
        s = torch.where(any_key, s, torch.zeros_like(s))
        p = torch.softmax(s, dim=-1)
        p = torch.where(any_key, p, torch.zeros_like(p))
        o = torch.matmul(p, vs).transpose(0, 1)  # (Lq, Hq, Dv)
        out = out.index_copy(0, torch.arange(sq, sq + lq), o)
    return out


def same_dtype_grads(q, k, v, dout, *args, **kwargs):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = same_dtype_attention(qs, ks, vs, *args, **kwargs)
    grads = torch.autograd.grad(out, (qs, ks, vs), dout)
    return out.detach(), grads


# ---------------------------------------------------------------------------------------- tolerances
LOW_PRECISION = (torch.float16, torch.bfloat16)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def max_abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    return (got.to(torch.float64) - ref.to(torch.float64)).abs().max().item()


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor | None = None) -> None:
    """fp32/fp64: ``max|err| <= rtol * max(1, max|ref|)``. fp16/bf16: ``err(got) <= 2 * err(baseline) + 1e-3``
    where the baseline is the same computation in plain PyTorch in that dtype."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = max_abs_err(got, ref)
    if got.dtype in LOW_PRECISION:
        assert baseline is not None, f"{name}: low precision needs a same-dtype baseline"
        base = max_abs_err(baseline, ref)
        bound = 2 * base + 1e-3
        assert err <= bound, f"{name}: max|err| {err:.3e} > 2 * baseline {base:.3e} + 1e-3"
    else:
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
        bound = RTOL[got.dtype] * scale
        assert err <= bound, f"{name}: max|err| {err:.3e} > {RTOL[got.dtype]:g} * {scale:.3g}"


def assert_lse_close(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """lse is float32; -inf exactly where the oracle has -inf, fp32-accurate elsewhere."""
    assert got.dtype == torch.float32, f"{name}: lse dtype {got.dtype}, want float32"
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in lse"
    ref_empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), ref_empty), f"{name}: -inf positions differ from the oracle"
    assert torch.isfinite(got[~ref_empty]).all(), f"{name}: non-finite lse for a row that sees keys"
    if (~ref_empty).any():
        g, r = got[~ref_empty].double(), ref[~ref_empty]
        err = (g - r).abs().max().item()
        bound = rtol * max(1.0, r.abs().max().item())
        assert err <= bound, f"{name}: max|err| {err:.3e} > {bound:.3e}"
