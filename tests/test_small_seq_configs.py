"""The small-sequence kernels at every head dim and GQA group, and under every launch shape of
`packattn.ops.small_seq.configs` (units of several kv heads, head-dim chunks, several units per program,
the pipelined unit loop, several items' query rows stacked a unit), against the float64 loop of tests/test_small_seq.py.
On CPU the kernels run in Triton's interpreter, so item counts stay small."""

import math

import pytest
import torch
from test_small_seq import (
    assert_zero_rows,
    check_fp32,
    dense_brute,
    make_inputs,
    run_brute,
    run_kernel,
)
from triton_varlen_harness import DEVICE

import packattn
from packattn.ops.small_seq import configs
from packattn.ops.small_seq.op import MAX_KEYS

LENGTHS = [16, 0, 1, 5, 9, 3]  # full, empty, one key, and others: six items
CONFIGS = [
    "h1 c1 u1 w4 s1",  # one unit per program, no pipelining
    "h1 c2 u3 w2 s5",  # head-dim chunks (the chunk tiles reloaded for the gradients), 3 units a program
    "h2 c1 u4 w2 s3",  # two kv heads per unit (3-D tiles)
    "h4 c4 u5 w4 s5",  # four kv heads per unit and four chunks
    "h1 c1 u3 w2 s5 i4",  # four items a unit (stacked query rows, block-diagonal scores)
    "h1 c2 u2 w1 s3 i2",  # two items a unit (backward rows padded to 8 an item), chunks
]


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_head_dim_and_group(head_dim, group):
    """The default configs: out, lse, dq, dk, dv against float64, two kv heads."""
    check_fp32(LENGTHS, heads=(2 * group, 2), head_dim=head_dim)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("heads", [(6, 6), (6, 3), (8, 2), (8, 1)], ids=["mha6", "gqa2-kv3", "gqa4", "mqa8"])
def test_launch_shapes(config, heads):
    """Every launch shape on kv head counts that are no power of two (a unit's last kv heads masked) and
    span several units of kv heads, GQA and MQA; head dim 64 (chunks of 16 columns at c4)."""
    c = configs.SmallSeqConfig.parse(config)
    with configs.override(fwd=c, bwd=c):
        check_fp32(LENGTHS + [2, 16, 7], heads=heads, head_dim=64)


@pytest.mark.parametrize("config", ["h2 c2 u3 w2 s5", "h1 c2 u2 w4 s3 i2"])
def test_launch_shapes_at_512(config):
    c = configs.SmallSeqConfig.parse(config)
    with configs.override(fwd=c, bwd=c):
        check_fp32([16, 0, 3], heads=(4, 2), head_dim=512)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_stacked_items_at_head_dims(head_dim, group):
    """Two items a unit at the head dims `test_launch_shapes` does not take (one and two chunks)."""
    for text in ("h1 c1 u2 w2 s3 i2", "h1 c2 u3 w4 s5 i2"):
        c = configs.SmallSeqConfig.parse(text)
        with configs.override(fwd=c, bwd=c):
            check_fp32([16, 0, 7], heads=(2 * group, 2), head_dim=head_dim)


@pytest.mark.parametrize("config", ["h2 c1 u4", "h1 c1 u4 i4"])
def test_every_kv_length_gqa(config):
    c = configs.SmallSeqConfig.parse(config)
    with configs.override(fwd=c, bwd=c):
        check_fp32(list(range(MAX_KEYS + 1)), heads=(8, 2), head_dim=64)


@pytest.mark.parametrize("config", ["h2 c2 u3 w2 s5", "h1 c1 u2 w2 s5 i4"])
def test_padding_and_items_without_query(config):
    """Rows in no item: zeros / -inf; an item with no query: zero dK/dV on its keys."""
    lengths_kv, lengths_q = [3, 16, 0, 9, 5], [1, 1, 1, 0, 1]
    c = configs.SmallSeqConfig.parse(config)
    with configs.override(fwd=c, bwd=c):
        seqs, out, lse, (dq, dk, dv) = check_fp32(lengths_kv, lengths_q, heads=(8, 2), pad=4)
    valid_q = seqs.row_map_q()[0] >= 0
    unseen = seqs.row_map_kv()[0] < 0
    start = seqs.host_starts_kv[3]
    unseen[start:start + 9] = True
    assert_zero_rows(out, ~valid_q)
    assert_zero_rows(dq, ~valid_q)
    assert torch.isneginf(lse[:, ~valid_q]).all()
    for g in (dk, dv):
        assert_zero_rows(g, unseen)


@pytest.mark.parametrize("head_dim", [64, 512])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("config", [None, "h1 c1 u2 w2 s5 i4"])
def test_fp16_within_twice_torch_fp16_error(head_dim, group, config):
    """fp16 (P and dS rounded to fp16 before their products): within twice the error of the same loop in
    plain fp16 torch, lse within 1e-3; the default configs and four items a unit."""
    seqs, q, k, v, dout = make_inputs([16, 3, 0, 11, 1], heads=(2 * group, 2), head_dim=head_dim,
                                      dtype=torch.float16)
    c = configs.SmallSeqConfig.parse(config) if config else None
    with configs.override(fwd=c, bwd=c):
        out, lse, grads = run_kernel(q, k, v, seqs, dout)
    truth = run_brute(q, k, v, seqs, dout)
    low = run_brute(q, k, v, seqs, dout, dtype=torch.float16)
    for name, got, want, same in zip(("out", "dq", "dk", "dv"), (out, *grads), (truth[0], *truth[2]),
                                     (low[0], *low[2])):
        assert got.dtype == torch.float16
        err = (got.double() - want).abs().max().item()
        torch_err = (same.double() - want).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3g} vs fp16 torch {torch_err:.3g}"
    finite = torch.isfinite(truth[1])
    torch.testing.assert_close(lse[finite].double(), truth[1][finite], atol=1e-3, rtol=0)


def test_large_scores_keep_gradients_accurate():
    """Scores in the hundreds: the backward's softmax is recomputed from the row maximum (from lse it
    would lose bits in ``s - lse``)."""
    check_fp32([16, 4, 9], heads=(8, 2), head_dim=128, scale=8.0, atol=1e-4)


@pytest.mark.parametrize("config", ["h2 c2 u3 w2 s5", "h1 c1 u1 w4 s1", "h1 c1 u3 w2 s5 i4"])
def test_dense_gqa_unused_slots(config):
    """The dense entry point (keys read in place, ``kv_fill`` zero rows) with GQA 4 at head dim 128."""
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 0, 16, 1]
    q = torch.randn(4, 8, 128, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(4, 6, 2, 128, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    dout = torch.randn(4, 8, 128, generator=gen).to(DEVICE)
    c = configs.SmallSeqConfig.parse(config)
    lengths = [min(n, 6) for n in lengths]
    with configs.override(fwd=c, bwd=c):
        out = packattn.small_seq_attention(q, k, v, torch.tensor(lengths, device=DEVICE), backend="small_seq")
        grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_brute(*leaves, lengths, 1 / math.sqrt(128))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, dout.double())):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    unused = torch.arange(6)[None, :] >= torch.tensor(lengths)[:, None]
    for g in grads[1:]:
        assert_zero_rows(g, unused.to(g.device))


def test_override_checks_configs():
    bad = [("block_h must be a power of two", {"fwd": configs.SmallSeqConfig(block_h=3)}),
           ("d_chunks must leave chunks of >= 16 columns", {"bwd": configs.SmallSeqConfig(d_chunks=8)}),
           ("items must be a power of two", {"fwd": configs.SmallSeqConfig(items=3)}),
           ("items > 1 takes block_h 1", {"bwd": configs.SmallSeqConfig(block_h=2, items=2)}),
           ("at most 16 items", {"bwd": configs.SmallSeqConfig(items=32)})]
    for match, kwargs in bad:
        with pytest.raises(ValueError, match=match), configs.override(**kwargs):
            pass
    for text in ("x2", "fma w1", "", " ", "h", "h2 c1 q3", "mma h2 c1 u8 w2 s5"):  # no kernel word
        with pytest.raises(ValueError, match="not a small-seq config"):
            configs.SmallSeqConfig.parse(text)
    assert configs.SmallSeqConfig.parse("c2 h4 u3") == configs.SmallSeqConfig(block_h=4, d_chunks=2, units=3)
    for text in ("h2 c1 u8 w2 s5", "h1 c2 u4 w8 s3 i2"):
        assert configs.SmallSeqConfig.parse(text).describe() == text
    assert configs.block_g(1, True) == 1 and configs.block_g(3, True) == 16 and configs.block_g(3, False) == 4
    # stacked items: the backward's rows of a unit reach 16, the forward's stay the group's
    assert configs.block_g(1, True, 4) == 4 and configs.block_g(4, True, 2) == 8 and configs.block_g(8, True, 4) == 8
    assert configs.block_g(1, False, 4) == 1
    assert configs.block_h(configs.SmallSeqConfig(block_h=8), 3) == 4


def test_config_too_large_for_an_sm_shrinks(monkeypatch):
    """A config whose shared memory does not fit launches with fewer kv heads a unit, then fewer items a
    unit, then fewer pipeline buffers (remembered per call shape), with a warning; results are those of the
    config that ran."""
    from triton.runtime.errors import OutOfResources

    from packattn.ops.small_seq import op

    real, tried, limit = op._launch_config, [], {"stages": 3}

    def launch(kind, config, *args):
        tried.append((kind, config.block_h, config.items, config.num_stages))
        if config.block_h > 1 or config.items > 1 or config.num_stages > limit["stages"]:
            raise OutOfResources(300000, 232448, "shared memory")
        real(kind, config, *args)

    monkeypatch.setattr(op, "_launch_config", launch)
    monkeypatch.setattr(op, "_shrunk", {})
    c = configs.SmallSeqConfig(block_h=4, num_stages=5)
    with configs.override(fwd=c, bwd=c), pytest.warns(UserWarning, match="h4 .* -> h2"):
        check_fp32([16, 0, 5], heads=(8, 4), head_dim=64)
    assert tried[:4] == [("fwd", 4, 1, 5), ("fwd", 2, 1, 5), ("fwd", 1, 1, 5), ("fwd", 1, 1, 3)]
    assert ("bwd", 1, 1, 3) in tried and len(op._shrunk) == 2
    tried.clear()
    with configs.override(fwd=c, bwd=c):
        check_fp32([3, 1], heads=(8, 4), head_dim=64)
    assert tried == [("fwd", 1, 1, 3), ("bwd", 1, 1, 3)]  # straight to the config that fitted
    tried.clear()
    limit["stages"] = 1
    c = configs.SmallSeqConfig(items=4, num_stages=3)
    with configs.override(fwd=c, bwd=c), pytest.warns(UserWarning, match="i4 -> .* i2"):
        check_fp32([3, 1], heads=(8, 4), head_dim=64)
    assert [t for t in tried if t[0] == "fwd"] == [("fwd", 1, 4, 3), ("fwd", 1, 2, 3), ("fwd", 1, 1, 3), ("fwd", 1, 1, 1)]
    with configs.override(fwd=configs.SmallSeqConfig(num_stages=1)):
        monkeypatch.setattr(op, "_launch_config", lambda *a: (_ for _ in ()).throw(OutOfResources(1, 0, "x")))
        with pytest.raises(OutOfResources):
            check_fp32([3], heads=(2, 2), head_dim=64)
