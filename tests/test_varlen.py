"""`Varlen`: builders, derived attributes, row maps, and every validation error."""

import dataclasses
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oracle import packed_layout
from packattn import Varlen

I32 = torch.int32


def cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------ from_lengths
def test_from_lengths_self_attention():
    s = Varlen.from_lengths([3, 0, 5])
    assert s.cu_seqlens_q.dtype == I32 and s.cu_seqlens_q.tolist() == [0, 3, 3, 8]
    assert s.cu_seqlens_kv is s.cu_seqlens_q
    assert s.cu_seqlens_q_padded is None and s.cu_seqlens_kv_padded is None and not s.pad_between_seqs
    assert (s.total_q, s.total_kv, s.max_seqlen_q, s.max_seqlen_kv, s.num_seqs) == (8, 8, 5, 5, 3)
    assert s.is_self
    assert s.lengths_q == s.lengths_kv == (3, 0, 5)
    assert s.host_starts_q == s.host_starts_kv == (0, 3, 3)
    assert s.starts_q.tolist() == [0, 3, 3] and s.seqlens_q.tolist() == [3, 0, 5] and s.seqlens_kv.tolist() == [3, 0, 5]
    assert s.device == torch.device("cpu")
    assert s.to("cpu") is s
    assert "num_seqs=3" in repr(s) and "pad_between_seqs" not in repr(s)


def test_from_lengths_cross_attention():
    s = Varlen.from_lengths([2, 3], [4, 0])
    assert not s.is_self
    assert s.cu_seqlens_q.tolist() == [0, 2, 5] and s.cu_seqlens_kv.tolist() == [0, 4, 4]
    assert s.cu_seqlens_kv.dtype == I32
    assert (s.total_q, s.total_kv, s.max_seqlen_q, s.max_seqlen_kv, s.num_seqs) == (5, 4, 3, 4, 2)
    assert s.host_starts_kv == (0, 4)
    # equal lengths given explicitly are still described as cross attention
    assert not Varlen.from_lengths([2], [2]).is_self


def test_from_lengths_accepts_tensors_tuples_and_numpy_ints():
    a = Varlen.from_lengths(torch.tensor([1, 2], dtype=torch.int64))
    b = Varlen.from_lengths((1, 2))
    c = Varlen.from_lengths([np.int64(1), np.int32(2)])
    for s in (a, b, c):
        assert s.cu_seqlens_q.tolist() == [0, 1, 3] and s.lengths_q == (1, 2)
        assert all(type(n) is int for n in s.lengths_q)


def test_from_lengths_empty_and_zero_length_batches():
    s = Varlen.from_lengths([])
    assert s.cu_seqlens_q.tolist() == [0] and (s.total_q, s.max_seqlen_q, s.num_seqs) == (0, 0, 0)
    assert s.row_map_q()[0].numel() == 0
    z = Varlen.from_lengths([0, 0], [0, 0], pad_to_multiple=8)
    assert z.cu_seqlens_q_padded.tolist() == [0, 0, 0] and z.total_q == z.total_kv == 0 and z.max_seqlen_kv == 0


def test_pad_to_multiple():
    s = Varlen.from_lengths([3, 0, 5, 8], pad_to_multiple=4)
    assert s.pad_between_seqs
    assert s.cu_seqlens_q.tolist() == [0, 3, 3, 8, 16]  # logical lengths unchanged
    assert s.cu_seqlens_q_padded.dtype == I32 and s.cu_seqlens_q_padded.tolist() == [0, 4, 4, 12, 20]
    assert s.cu_seqlens_kv_padded is s.cu_seqlens_q_padded and s.is_self
    assert s.total_q == s.total_kv == 20 and s.max_seqlen_q == 8
    assert s.starts_q.tolist() == [0, 4, 4, 12] and s.host_starts_q == (0, 4, 4, 12)
    assert "pad_between_seqs" in repr(s)
    # pad_to_multiple=1 is no padding
    one = Varlen.from_lengths([3, 5], pad_to_multiple=1)
    assert not one.pad_between_seqs and one.total_q == 8
    # cross attention pads q and kv separately
    c = Varlen.from_lengths([1, 6], [9, 0], pad_to_multiple=4)
    assert c.cu_seqlens_q_padded.tolist() == [0, 4, 12] and c.cu_seqlens_kv_padded.tolist() == [0, 12, 12]
    assert (c.total_q, c.total_kv) == (12, 12) and c.host_starts_kv == (0, 12)


def test_row_map_by_hand():
    s = Varlen.from_lengths([3, 0, 2], pad_to_multiple=4)
    seq, pos = s.row_map_q()
    assert seq.tolist() == [0, 0, 0, -1, 2, 2, -1, -1]
    assert pos.tolist() == [0, 1, 2, 0, 0, 1, 0, 0]
    assert s.row_map_q() is s.row_map_q()  # cached per batch


@given(
    lengths=st.lists(st.integers(0, 9), max_size=6),
    lengths_kv=st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=6, max_size=6)),
    pad=st.sampled_from([None, 1, 2, 3, 8]),
)
def test_from_lengths_matches_layout_arithmetic(lengths, lengths_kv, pad):
    if lengths_kv is not None:
        lengths_kv = lengths_kv[: len(lengths)]
    s = Varlen.from_lengths(lengths, lengths_kv, pad_to_multiple=pad)
    lk = lengths if lengths_kv is None else lengths_kv
    for name, ls in (("q", lengths), ("kv", lk)):
        starts, total = packed_layout(ls, pad)
        assert getattr(s, f"total_{name}") == total
        assert getattr(s, f"host_starts_{name}") == tuple(starts)
        assert getattr(s, f"starts_{name}").tolist() == starts
        assert getattr(s, f"cu_seqlens_{name}").tolist() == np.cumsum([0, *ls]).tolist()
        assert getattr(s, f"max_seqlen_{name}") == max(ls, default=0)
        seq, pos = getattr(s, f"row_map_{name}")()
        want_seq, want_pos = [-1] * total, [0] * total
        for i, (st_, n) in enumerate(zip(starts, ls)):
            for p in range(n):
                want_seq[st_ + p], want_pos[st_ + p] = i, p
        assert seq.tolist() == want_seq and pos.tolist() == want_pos
    assert s.num_seqs == len(lengths)
    assert s.pad_between_seqs == (pad is not None and pad > 1)
    assert s.is_self == (lengths_kv is None)


# ------------------------------------------------------------------------------------ from_cu_seqlens
def test_from_cu_seqlens_self():
    c = cu([0, 2, 2, 7], torch.int64)
    s = Varlen.from_cu_seqlens(c, max_seqlen_q=5)
    assert s.cu_seqlens_q.dtype == I32 and s.cu_seqlens_q.tolist() == [0, 2, 2, 7]
    assert s.is_self and s.cu_seqlens_kv is s.cu_seqlens_q
    assert (s.total_q, s.total_kv, s.max_seqlen_q, s.max_seqlen_kv, s.num_seqs) == (7, 7, 5, 5, 3)
    assert s.lengths_q == (2, 0, 5) and not s.pad_between_seqs
    # same tensor object for kv is self-attention too
    assert Varlen.from_cu_seqlens(c, c, max_seqlen_q=5).is_self
    # a larger max_seqlen than needed is kept (callers may bucket it)
    big = Varlen.from_cu_seqlens(c, max_seqlen_q=64)
    assert big.max_seqlen_q == big.max_seqlen_kv == 64


def test_from_cu_seqlens_cross_and_padded():
    s = Varlen.from_cu_seqlens(
        cu([0, 2, 5]), cu([0, 4, 5]), max_seqlen_q=3, max_seqlen_kv=4,
        cu_seqlens_q_padded=cu([0, 4, 8]), cu_seqlens_kv_padded=cu([0, 4, 6]),
    )
    assert not s.is_self and s.pad_between_seqs
    assert (s.total_q, s.total_kv, s.max_seqlen_q, s.max_seqlen_kv) == (8, 6, 3, 4)
    assert s.starts_q.tolist() == [0, 4] and s.starts_kv.tolist() == [0, 4]
    assert s.lengths_kv == (4, 1)
    assert s.row_map_q()[0].tolist() == [0, 0, -1, -1, 1, 1, 1, -1]
    # self-attention with q padding: kv shares the padded offsets
    p = Varlen.from_cu_seqlens(cu([0, 1, 3]), max_seqlen_q=2, cu_seqlens_q_padded=cu([0, 2, 4]))
    assert p.is_self and p.cu_seqlens_kv_padded.tolist() == [0, 2, 4] and p.total_kv == 4
    assert p.starts_kv.tolist() == [0, 2] and p.row_map_kv()[0].tolist() == [0, -1, 1, 1]
    # max_seqlen_kv defaults to the real longest kv sequence for cross attention
    assert Varlen.from_cu_seqlens(cu([0, 2]), cu([0, 6]), max_seqlen_q=2).max_seqlen_kv == 6


# ------------------------------------------------------------------------------------ uniform
@pytest.mark.parametrize("batch,sq,sk", [(3, 4, 5), (2, 4, 4), (2, 0, 3), (0, 4, 4), (1, 1, 0)])
def test_uniform(batch, sq, sk):
    s = Varlen.uniform(batch, sq, sk, "cpu")
    ref = Varlen.from_lengths([sq] * batch, [sk] * batch)
    assert s.cu_seqlens_q.dtype == s.cu_seqlens_kv.dtype == I32
    assert s.cu_seqlens_q.tolist() == ref.cu_seqlens_q.tolist()
    assert s.cu_seqlens_kv.tolist() == ref.cu_seqlens_kv.tolist()
    for attr in ("total_q", "total_kv", "max_seqlen_q", "max_seqlen_kv", "num_seqs", "lengths_q", "lengths_kv",
                 "host_starts_q", "host_starts_kv"):
        if batch == 0 and attr.startswith("max_seqlen"):
            continue  # an empty dense batch keeps its nominal sequence length as the bound
        assert getattr(s, attr) == getattr(ref, attr), attr
    assert not s.pad_between_seqs and s.is_self == (sq == sk)
    assert s.row_map_q()[0].tolist() == ref.row_map_q()[0].tolist()


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        (([3, -1],), {}, ValueError, r"lengths_q\[1\] is negative \(-1\)"),
        (([3], [-2]), {}, ValueError, r"lengths_kv\[0\] is negative"),
        (([1.0, 2],), {}, TypeError, r"lengths_q\[0\] must be an int, got 1.0"),
        (([1, True],), {}, TypeError, r"lengths_q\[1\] must be an int"),
        (([1], ["2"]), {}, TypeError, r"lengths_kv\[0\] must be an int"),
        ((torch.tensor([1.0, 2.0]),), {}, TypeError, r"lengths_q must hold integers, got dtype torch.float32"),
        ((torch.tensor([True]),), {}, TypeError, r"must hold integers"),
        ((torch.tensor([[1, 2]]),), {}, ValueError, r"lengths_q must be 1-D"),
        (("12",), {}, TypeError, r"lengths_q must be a sequence of ints, got str"),
        ((5,), {}, TypeError, r"sequence of ints, got int"),
        (([1, 2], [3]), {}, ValueError, r"lengths_q has 2 sequences but lengths_kv has 1"),
        (([1],), {"pad_to_multiple": 0}, ValueError, r"pad_to_multiple must be a positive int, got 0"),
        (([1],), {"pad_to_multiple": -4}, ValueError, r"pad_to_multiple"),
        (([1],), {"pad_to_multiple": 2.0}, ValueError, r"pad_to_multiple must be a positive int, got 2.0"),
        (([1],), {"pad_to_multiple": True}, ValueError, r"pad_to_multiple"),
        (([2**31],), {}, ValueError, r"lengths_q total 2147483648 overflows int32"),
        (([2**30, 2**30],), {}, ValueError, r"overflows int32"),
        (([1], [2**31]), {}, ValueError, r"lengths_kv total .* overflows int32"),
        (([2**31 - 1],), {"pad_to_multiple": 2}, ValueError, r"padded lengths_q total 2147483648 overflows int32"),
        (([1], [2**31 - 1]), {"pad_to_multiple": 4}, ValueError, r"padded lengths_kv total .* overflows"),
    ],
)
def test_from_lengths_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Varlen.from_lengths(*args, **kwargs)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((cu([0, 2.0], torch.float32),), {"max_seqlen_q": 2}, TypeError, r"cu_seqlens_q must be int32 or int64, got torch.float32"),
        ((cu([0, 2], torch.int16),), {"max_seqlen_q": 2}, TypeError, r"int32 or int64, got torch.int16"),
        (([0, 2],), {"max_seqlen_q": 2}, TypeError, r"cu_seqlens_q must be a torch.Tensor, got list"),
        ((cu([0, 2]), cu([0, 1.5], torch.float64)), {"max_seqlen_q": 2}, TypeError, r"cu_seqlens_kv must be int32 or int64"),
        ((cu([[0, 2]]),), {"max_seqlen_q": 2}, ValueError, r"cu_seqlens_q must be 1-D with at least one entry"),
        ((cu([]),), {"max_seqlen_q": 0}, ValueError, r"at least one entry"),
        ((cu([1, 3]),), {"max_seqlen_q": 2}, ValueError, r"cu_seqlens_q must start at 0"),
        ((cu([0, 3]), cu([2, 3])), {"max_seqlen_q": 3}, ValueError, r"cu_seqlens_kv must start at 0"),
        ((cu([0, 3, 2]),), {"max_seqlen_q": 3}, ValueError, r"cu_seqlens_q is not monotonic: cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 3"),
        ((cu([0, 2]), cu([0, 5, 1])), {"max_seqlen_q": 2}, ValueError, r"cu_seqlens_q has 1 sequences but cu_seqlens_kv has 2"),
        ((cu([0, 2, 7]),), {"max_seqlen_q": 4}, ValueError, r"max_seqlen_q=4 is smaller than the longest sequence \(5\)"),
        ((cu([0, 2]), cu([0, 9])), {"max_seqlen_q": 2, "max_seqlen_kv": 8}, ValueError, r"max_seqlen_kv=8 is smaller"),
        ((cu([0, 2]),), {"max_seqlen_q": 2.0}, TypeError, r"max_seqlen_q must be an int, got 2.0"),
        ((cu([0, 2]),), {"max_seqlen_q": None}, TypeError, r"max_seqlen_q must be an int, got None"),
        ((cu([0, 2]), cu([0, 3])), {"max_seqlen_q": 2, "max_seqlen_kv": "3"}, TypeError, r"max_seqlen_kv must be an int"),
        ((cu([0, 2**31], torch.int64),), {"max_seqlen_q": 2**31}, ValueError, r"cu_seqlens_q total 2147483648 overflows int32"),
        ((cu([0, 2, 4]),), {"max_seqlen_q": 2, "cu_seqlens_q_padded": cu([0, 1, 4])}, ValueError,
         r"cu_seqlens_q_padded gives sequence 0 a slot of 1 rows, smaller than its length 2"),
        ((cu([0, 2]), cu([0, 3])), {"max_seqlen_q": 2, "cu_seqlens_kv_padded": cu([0, 2])}, ValueError,
         r"cu_seqlens_kv_padded gives sequence 0 a slot of 2 rows, smaller than its length 3"),
        ((cu([0, 2, 4]),), {"max_seqlen_q": 2, "cu_seqlens_q_padded": cu([0, 4])}, ValueError,
         r"cu_seqlens_q_padded has 2 entries but cu_seqlens_q has 3"),
        ((cu([0, 2]),), {"max_seqlen_q": 2, "cu_seqlens_q_padded": cu([1, 4])}, ValueError, r"cu_seqlens_q_padded must start at 0"),
        ((cu([0, 1, 2]),), {"max_seqlen_q": 1, "cu_seqlens_q_padded": cu([0, 4, 3])}, ValueError, r"cu_seqlens_q_padded is not monotonic"),
        ((cu([0, 2]),), {"max_seqlen_q": 2, "cu_seqlens_q_padded": cu([0, 4.0], torch.float32)}, TypeError,
         r"cu_seqlens_q_padded must be int32 or int64"),
    ],
)
def test_from_cu_seqlens_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Varlen.from_cu_seqlens(*args, **kwargs)


def test_from_lengths_accepts_numpy_arrays():
    np = pytest.importorskip("numpy")
    seqs = Varlen.from_lengths(np.array([3, 0, 5], dtype=np.int64), pad_to_multiple=4)
    assert seqs.cu_seqlens_q.tolist() == [0, 3, 3, 8]
    assert seqs.cu_seqlens_q_padded.tolist() == [0, 4, 4, 12]
    with pytest.raises(TypeError, match="integers"):
        Varlen.from_lengths(np.array([1.5, 2.0]))


def test_padding_rows_match_the_row_map():
    seqs = Varlen.from_lengths([5, 0, 13, 1, 9], [3, 4, 0, 2, 64], pad_to_multiple=4)
    for side, row_map in (("q", seqs.row_map_q), ("kv", seqs.row_map_kv)):
        expected = (row_map()[0] < 0).nonzero().flatten()
        assert torch.equal(seqs.padding_rows(side), expected) and expected.numel() > 0
    assert Varlen.from_lengths([3, 4]).padding_rows("q").numel() == 0
    no_host_copies = dataclasses.replace(seqs, lengths_q=None, host_starts_q=None, _cache={})
    assert no_host_copies.padding_rows("q") is None
