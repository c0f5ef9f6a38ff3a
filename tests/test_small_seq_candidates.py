"""The launch configs proposed for d = 64 at GQA 4 (heads 8/2; benchmarks/small_seq_sweep.py PROPOSED["d64-8/2"]),
exactly as the sweep launches them, against the float64 loop of tests/test_small_seq.py: every kv length 0..16,
programs whose last unit is partly past the items, items without a query. Each config runs both passes."""

import pytest
import torch
from test_small_seq import assert_zero_rows, check_fp32

from packattn.ops.small_seq import configs
from packattn.ops.small_seq.op import MAX_KEYS

CANDIDATES = [
    "h1 c1 u8 w1 s5",  # a warp per (item, kv head)
    "h1 c1 u8 w1 s3 i4",  # four items stacked, one pipeline buffer
    "h1 c2 u8 w1 s3 i4",  # four items stacked, two head-dim chunks of 32 columns
    "h1 c1 u8 w1 s3 i2",  # two items stacked (backward rows padded to 8 an item), one buffer
]


@pytest.mark.parametrize("config", CANDIDATES)
def test_every_kv_length_gqa4(config):
    c = configs.SmallSeqConfig.parse(config)
    with configs.override(fwd=c, bwd=c):
        check_fp32(list(range(MAX_KEYS + 1)), heads=(8, 2), head_dim=64)


@pytest.mark.parametrize("config", CANDIDATES)
def test_padding_and_items_without_query_gqa4(config):
    """Rows in no item: zeros / -inf; an item with no query (16 keys) writes zero dK/dV on its keys."""
    lengths_kv, lengths_q = [1, 16, 0, 16, 5], [1, 1, 1, 0, 1]
    c = configs.SmallSeqConfig.parse(config)
    with configs.override(fwd=c, bwd=c):
        seqs, out, lse, (dq, dk, dv) = check_fp32(lengths_kv, lengths_q, heads=(8, 2), pad=4)
    valid_q = seqs.row_map_q()[0] >= 0
    unseen = seqs.row_map_kv()[0] < 0
    start = seqs.host_starts_kv[3]
    unseen[start:start + 16] = True
    assert_zero_rows(out, ~valid_q)
    assert_zero_rows(dq, ~valid_q)
    assert torch.isneginf(lse[:, ~valid_q]).all()
    for g in (dk, dv):
        assert_zero_rows(g, unseen)
