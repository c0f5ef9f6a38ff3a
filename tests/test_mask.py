"""`packattn.mask`: Mask.make validation / canonicalisation, the docstring pictures, and the element and
block rules held against the independent oracle rule."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oracle import DOCSTRING_PICTURES, oracle_mask, picture
from packattn import mask as masks
from packattn.mask import Mask

CAUSAL = st.sampled_from([False, True, "top_left", "bottom_right", None])
WINDOW = st.one_of(st.none(), st.tuples(st.integers(-1, 7), st.integers(-1, 7)))
CHUNK = st.one_of(st.none(), st.integers(1, 6))


# ------------------------------------------------------------------------------------ make
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(causal="yes"), r"causal must be True, False, 'bottom_right' or 'top_left', got 'yes'"),
        (dict(causal="TOP_LEFT"), r"causal must be .* got 'TOP_LEFT'"),
        (dict(causal=2), r"causal must be .* got 2"),
        (dict(window=3), r"window must be a \(left, right\) pair, got 3"),
        (dict(window=(1,)), r"window must be a \(left, right\) pair, got \(1,\)"),
        (dict(window=(1, 2, 3)), r"window must be a \(left, right\) pair"),
        (dict(window="ab"), r"window must be a \(left, right\) pair"),
        (dict(window=(-2, 0)), r"window left must be an int >= -1 \(-1 = unbounded\), got -2"),
        (dict(window=(0, -5)), r"window right must be an int >= -1 .* got -5"),
        (dict(window=(1.5, 0)), r"window left must be an int >= -1 .* got 1.5"),
        (dict(window=(0, True)), r"window right must be an int"),
        (dict(window=(None, 0)), r"window left must be an int"),
        (dict(chunk_size=0), r"chunk_size must be a positive int, got 0"),
        (dict(chunk_size=-3), r"chunk_size must be a positive int, got -3"),
        (dict(chunk_size=2.0), r"chunk_size must be a positive int, got 2.0"),
        (dict(chunk_size=True), r"chunk_size must be a positive int, got True"),
    ],
)
def test_make_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mask.make(**kwargs)


@pytest.mark.parametrize(
    "kwargs,want",
    [
        (dict(), Mask(False, None, None, "bottom_right")),
        (dict(causal=None), Mask(False, None, None, "bottom_right")),
        (dict(causal=True), Mask(True, None, None, "bottom_right")),
        (dict(causal="bottom_right"), Mask(True, None, None, "bottom_right")),
        (dict(causal="top_left"), Mask(True, None, None, "top_left")),
        # causal already cuts everything right of the diagonal
        (dict(causal=True, window=(3, 5)), Mask(True, (3, 0), None, "bottom_right")),
        (dict(causal=True, window=(3, -1)), Mask(True, (3, 0), None, "bottom_right")),
        (dict(causal="top_left", window=(2, 0)), Mask(True, (2, 0), None, "top_left")),
        # windows that restrict nothing disappear
        (dict(window=(-1, -1)), Mask(False, None, None, "bottom_right")),
        (dict(causal=True, window=(-1, 0)), Mask(True, None, None, "bottom_right")),
        (dict(causal=True, window=(-1, 7)), Mask(True, None, None, "bottom_right")),
        (dict(causal=True, window=[-1, -1]), Mask(True, None, None, "bottom_right")),
        # lists become tuples (hashable)
        (dict(window=[2, 3]), Mask(False, (2, 3), None, "bottom_right")),
        (dict(window=(-1, 2), chunk_size=4), Mask(False, (-1, 2), 4, "bottom_right")),
        (dict(causal=True, chunk_size=1), Mask(True, None, 1, "bottom_right")),
    ],
)
def test_make_canonicalises(kwargs, want):
    got = Mask.make(**kwargs)
    assert got == want and hash(got) == hash(want)
    assert got.window is None or type(got.window) is tuple


def test_mask_properties_and_describe():
    assert Mask.make().is_full and Mask.make().describe() == "full"
    assert not Mask.make(chunk_size=2).is_full and not Mask.make(window=(1, 1)).is_full
    assert Mask.make(causal=True).left == -1 and Mask.make(causal=True).right == 0
    assert Mask.make().right == -1 and Mask.make(window=(2, 5)).right == 5 and Mask.make(window=(2, 5)).left == 2
    assert Mask.make(causal="top_left", window=(4, 0), chunk_size=8).describe() == "causal(top_left)+window=(4, 0)+chunk=8"
    assert Mask.make(causal=True).describe() == "causal"
    with pytest.raises(Exception):
        Mask.make().causal = True  # frozen: safe as a dispatch key


@pytest.mark.parametrize("name", sorted(DOCSTRING_PICTURES))
def test_docstring_pictures(name):
    opts, rows = DOCSTRING_PICTURES[name]
    assert torch.equal(masks.dense_mask(Mask.make(**opts), 4, 6), picture(rows))


# ------------------------------------------------------------------------------------ element rule
@given(lq=st.integers(0, 13), lk=st.integers(0, 13), causal=CAUSAL, window=WINDOW, chunk=CHUNK)
def test_visible_agrees_with_oracle(lq, lk, causal, window, chunk):
    m = Mask.make(causal, window, chunk)
    want = oracle_mask(lq, lk, causal=causal, window=window, chunk_size=chunk)
    got = masks.dense_mask(m, lq, lk)
    assert got.dtype == torch.bool and torch.equal(got, want)
    # each visible row is one interval, and key_range returns exactly it
    for i in range(lq):
        lo, hi = masks.key_range(m, i + masks.offset(m, lq, lk), lk)
        keys = want[i].nonzero().flatten().tolist()
        if keys:
            assert (lo, hi) == (keys[0], keys[-1] + 1)
        else:
            assert lo >= hi


@given(
    lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4),
    causal=CAUSAL, window=WINDOW, chunk=CHUNK,
)
def test_visible_broadcasts_over_per_sequence_lengths(lengths, causal, window, chunk):
    """Tensors of lengths (one per sequence), as the reference backend uses them, and positions out of range."""
    m = Mask.make(causal, window, chunk)
    lq = torch.tensor([a for a, _ in lengths])[:, None, None]
    lk = torch.tensor([b for _, b in lengths])[:, None, None]
    qp = torch.arange(-1, 11)[None, :, None]
    kp = torch.arange(-1, 11)[None, None, :]
    got = masks.visible(m, qp, kp, lq, lk)
    for n, (a, b) in enumerate(lengths):
        want = torch.zeros(12, 12, dtype=torch.bool)
        want[1 : a + 1, 1 : b + 1] = oracle_mask(a, b, causal=causal, window=window, chunk_size=chunk)
        assert torch.equal(got[n], want)


# ------------------------------------------------------------------------------------ block rule
@given(
    lq=st.integers(1, 24), lk=st.integers(0, 24), causal=CAUSAL, window=WINDOW, chunk=CHUNK,
    block=st.tuples(st.integers(0, 23), st.integers(1, 24)),
)
def test_block_key_range_bounds(lq, lk, causal, window, chunk, block):
    start = min(block[0], lq - 1)
    end = min(lq, start + block[1])
    m = Mask.make(causal, window, chunk)
    vis = oracle_mask(lq, lk, causal=causal, window=window, chunk_size=chunk)[start:end]
    lo, hi, full_lo, full_hi = masks.block_key_range(m, start, end, lq, lk)
    # every visible key of every query in the block lies in [lo, hi)
    cols = vis.any(dim=0).nonzero().flatten().tolist()
    assert all(lo <= j < hi for j in cols), (lo, hi, cols)
    # every key in [full_lo, full_hi) is visible to every query of the block
    for j in range(full_lo, full_hi):
        assert 0 <= j < lk and vis[:, j].all(), (full_lo, full_hi, j)
    # the union is tight at its ends when the block sees anything: the first row's first key and
    # the last row's last key are visible (what lets kernels skip every block outside [lo, hi))
    if vis[0].any():
        assert vis[0, lo]
    if vis[-1].any():
        assert vis[-1, hi - 1]


def test_block_key_range_by_hand():
    causal = Mask.make(causal=True)
    # 8 x 8 causal, queries 4..7: keys 0..7 may be seen, keys 0..4 are seen by all
    assert masks.block_key_range(causal, 4, 8, 8, 8) == (0, 8, 0, 5)
    # window (2, 0): query 4 sees 2..4, query 7 sees 5..7 -> union [2, 8), nobody sees all of any key
    lo, hi, flo, fhi = masks.block_key_range(Mask.make(causal=True, window=(2, 0)), 4, 8, 8, 8)
    assert (lo, hi) == (2, 8) and flo >= fhi
    # chunk 4, queries 4..7 of 8: own chunk [4, 8); full part is key 4 only (query 4 sees only key 4)
    assert masks.block_key_range(Mask.make(causal=True, chunk_size=4), 4, 8, 8, 8) == (4, 8, 4, 5)


@given(
    lq=st.integers(0, 24), lk=st.integers(1, 24), causal=CAUSAL, window=WINDOW, chunk=CHUNK,
    block=st.tuples(st.integers(0, 23), st.integers(1, 24)),
)
def test_block_query_range_is_exact(lq, lk, causal, window, chunk, block):
    """The inverse rule (per key block, for backward kernels): the queries that see some key of the
    block are exactly [lo, hi), those that see every key exactly [full_lo, full_hi) (empty: lo >= hi)."""
    start = min(block[0], lk - 1)
    end = min(lk, start + block[1])
    m = Mask.make(causal, window, chunk)
    vis = oracle_mask(lq, lk, causal=causal, window=window, chunk_size=chunk)[:, start:end]
    lo, hi, full_lo, full_hi = masks.block_query_range(m, start, end, lq, lk)
    assert 0 <= lo and hi <= lq and 0 <= full_lo and full_hi <= lq
    some = vis.any(dim=1).nonzero().flatten().tolist()
    every = vis.all(dim=1).nonzero().flatten().tolist()
    assert (list(range(lo, hi)) == some) if some else lo >= hi, (lo, hi, some)
    assert (list(range(full_lo, full_hi)) == every) if every else full_lo >= full_hi, (full_lo, full_hi, every)


@pytest.mark.parametrize("bad", [1, 0, 1.0, "yes"])
def test_causal_takes_bools_or_alignment_names_only(bad):
    with pytest.raises(ValueError, match="causal must be"):
        Mask.make(causal=bad)
