"""The oracle itself, against cases worked out by hand (so the ground truth is not taken on faith)."""

import math

import pytest
import torch

from oracle import (
    DOCSTRING_PICTURES,
    picture,
    oracle_attention,
    oracle_grads,
    oracle_mask,
    oracle_visible,
    packed_layout,
    same_dtype_attention,
    valid_rows,
)

@pytest.mark.parametrize("name", sorted(DOCSTRING_PICTURES))
def test_oracle_mask_matches_docstring_pictures(name):
    opts, rows = DOCSTRING_PICTURES[name]
    assert torch.equal(oracle_mask(4, 6, **opts), picture(rows))


def test_oracle_visible_rules_by_hand():
    # non-causal, no window/chunk: everything in range
    assert oracle_mask(3, 2).all()
    assert oracle_mask(0, 3).shape == (0, 3) and oracle_mask(3, 0).shape == (3, 0)
    # out of range is never visible
    assert not oracle_visible(-1, 0, 2, 2) and not oracle_visible(0, 2, 2, 2) and not oracle_visible(2, 0, 2, 2)
    # bottom-right causal with more queries than keys: the first Lq - Lk queries see nothing
    m = oracle_mask(5, 2, causal=True)
    assert not m[:3].any() and m[3].tolist() == [True, False] and m[4].tolist() == [True, True]
    # "bottom_right" is the same as True
    assert torch.equal(oracle_mask(3, 5, causal="bottom_right"), oracle_mask(3, 5, causal=True))
    # a non-causal window is aligned bottom-right too: Lq=2, Lk=4 -> a = (2, 3)
    assert oracle_mask(2, 4, window=(0, 0)).tolist() == [[False, False, True, False], [False, False, False, True]]
    # window right side only (-1 left = unbounded)
    assert oracle_mask(3, 3, window=(-1, 1)).tolist() == [[True, True, False], [True, True, True], [True, True, True]]
    # chunk without causal: whole chunk of the aligned position; a(i) < 0 sees nothing
    assert oracle_mask(2, 4, chunk_size=2).tolist() == [[False, False, True, True], [False, False, True, True]]
    assert not oracle_mask(3, 1, chunk_size=2)[:2].any()  # a = -2, -1
    # non-causal chunk is aligned bottom-right (a = 1, 2, 3); top-left causal chunk: a(i) = i
    assert oracle_mask(3, 4, chunk_size=3).tolist() == [[True] * 3 + [False]] * 2 + [[False] * 3 + [True]]
    assert oracle_mask(3, 4, chunk_size=3, causal="top_left").tolist() == [
        [True, False, False, False], [True, True, False, False], [True, True, True, False]
    ]
    assert oracle_mask(2, 2, chunk_size=3, window=(0, -1)).tolist() == [[True, True], [False, True]]


def test_one_query_one_key():
    q = torch.tensor([[[0.5, -1.0]]], dtype=torch.float64)
    k = torch.tensor([[[2.0, 3.0]]], dtype=torch.float64)
    v = torch.tensor([[[7.0, -4.0, 1.5]]], dtype=torch.float64)
    out, lse = oracle_attention(q, k, v, [1], [1], [0], [0], 1)
    assert torch.equal(out, v)
    score = (0.5 * 2.0 - 1.0 * 3.0) / math.sqrt(2)
    assert lse.shape == (1, 1) and lse.item() == pytest.approx(score, abs=1e-15)
    _, lse = oracle_attention(q, k, v, [1], [1], [0], [0], 1, scale=3.0)
    assert lse.item() == pytest.approx(3.0 * (1.0 - 3.0), abs=1e-15)


def test_two_keys_by_hand():
    q = torch.tensor([[[1.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.0]], [[math.log(3.0)]]], dtype=torch.float64)  # scores 0 and log 3 (scale 1)
    v = torch.tensor([[[4.0]], [[8.0]]], dtype=torch.float64)
    out, lse = oracle_attention(q, k, v, [1], [2], [0], [0], 1)
    # weights 1/4, 3/4 -> 1 + 6 = 7; lse = log(1 + 3)
    assert out.item() == pytest.approx(7.0, abs=1e-14)
    assert lse.item() == pytest.approx(math.log(4.0), abs=1e-14)
    # causal bottom-right with Lq = 1 sees both keys; top-left sees only key 0
    out, lse = oracle_attention(q, k, v, [1], [2], [0], [0], 1, causal="top_left")
    assert out.item() == 4.0 and lse.item() == 0.0


def test_empty_rows_and_padding():
    torch.manual_seed(0)
    # seq 0: 2 queries, no keys; seq 1: 3 queries / 2 keys causal -> query 0 sees nothing; rows 2, 6 are padding
    lengths_q, lengths_kv = [2, 3], [0, 2]
    starts_q, starts_kv, total_q = [0, 3], [0, 0], 7
    q, k, v = torch.randn(total_q, 2, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 3)
    out, lse = oracle_attention(q, k, v, lengths_q, lengths_kv, starts_q, starts_kv, total_q, causal=True)
    assert out.shape == (7, 2, 3) and lse.shape == (2, 7)
    empty = torch.tensor([True, True, True, True, False, False, True])
    assert (out[empty] == 0).all() and torch.isneginf(lse[:, empty]).all()
    assert torch.isfinite(lse[:, ~empty]).all()
    # row 4 (query 1 of seq 1, a = 0) sees key 0 only: out = v[0]
    assert torch.allclose(out[4], v[0].double().expand(2, 3))


def test_gqa_head_mapping():
    # 4 query heads over 2 kv heads: heads 0, 1 read kv head 0, heads 2, 3 read kv head 1
    q = torch.randn(1, 4, 3)
    k = torch.randn(1, 2, 3)
    v = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    out, _ = oracle_attention(q, k, v, [1], [1], [0], [0], 1)
    assert out[0].tolist() == [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0], [3.0, 4.0]]
    # MQA: every head reads kv head 0
    out, _ = oracle_attention(q, k[:, :1], v[:, :1], [1], [1], [0], [0], 1)
    assert (out[0] == torch.tensor([1.0, 2.0], dtype=torch.float64)).all()


def test_matches_dense_softmax_formula():
    """Full attention of one sequence equals softmax(q k^T * scale) v computed as matrices."""
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 2, 8, dtype=torch.float64), torch.randn(7, 2, 8, dtype=torch.float64), torch.randn(7, 2, 6, dtype=torch.float64)
    for opts in (dict(), dict(causal=True), dict(causal="top_left", window=(2, 0)), dict(chunk_size=3)):
        out, lse = oracle_attention(q, k, v, [5], [7], [0], [0], 5, scale=0.3, **opts)
        vis = oracle_mask(5, 7, **opts)
        s = torch.einsum("qhd,khd->hqk", q, k) * 0.3
        s = s.masked_fill(~vis, float("-inf"))
        want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(0.0), v)
        want_lse = torch.logsumexp(s, -1)
        assert torch.allclose(out, want, atol=1e-12, rtol=0)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        assert torch.allclose(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], atol=1e-12)


def test_oracle_gradients_by_finite_differences():
    torch.manual_seed(2)
    q = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 1, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 1, 2, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return oracle_attention(q, k, v, [3, 2], [2, 3], [0, 4], [0, 2], 6, causal=True, window=(1, 0))[0]

    assert torch.autograd.gradcheck(f, (q, k, v))
    dout = torch.randn(6, 2, 2, dtype=torch.float64)
    _, _, (dq, dk, dv) = oracle_grads(q, k, v, dout, [3, 2], [2, 3], [0, 4], [0, 2], 6, causal=True, window=(1, 0))
    assert (dq[3] == 0).all()  # padding row
    assert dq.abs().sum() > 0 and dk.abs().sum() > 0 and dv.abs().sum() > 0


def test_oracle_grads_when_nothing_is_visible():
    q, k, v = torch.randn(3, 1, 2), torch.randn(0, 1, 2), torch.randn(0, 1, 2)
    out, lse, (dq, dk, dv) = oracle_grads(q, k, v, torch.randn(3, 1, 2), [3], [0], [0], [0], 3)
    assert (out == 0).all() and torch.isneginf(lse).all() and (dq == 0).all() and dk.shape == (0, 1, 2)


def test_layout_helpers():
    assert packed_layout([3, 0, 5]) == ([0, 3, 3], 8)
    assert packed_layout([3, 0, 5], 4) == ([0, 4, 4], 12)
    assert packed_layout([], 4) == ([], 0)
    assert valid_rows([3, 0, 5], [0, 4, 4], 12).tolist() == [True] * 3 + [False] + [True] * 5 + [False] * 3


def test_same_dtype_baseline_is_the_same_computation():
    torch.manual_seed(3)
    q, k, v = torch.randn(9, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    args = ([4, 0, 3], [5, 2, 1], [0, 5, 5], [0, 5, 7], 9)
    for opts in (dict(causal=True), dict(window=(1, 1), chunk_size=2), dict(causal="top_left")):
        want, _ = oracle_attention(q, k, v, *args, **opts)
        got = same_dtype_attention(q.double(), k.double(), v.double(), *args, **opts)
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
