"""The sm_90 Gluon kernels at head dims other than 64 / 128 against the float32 reference, at full size (bf16 / fp16):
d = 256 (forward 128 x 32 tiles; the key-split dK/dV, two warp groups sharing one 64-key tile; the
one-consumer dQ computing delta), every mask, GQA / MHA, padding, empty and length-1 sequences, the deterministic
backward, and a tree at d = 256 (its dK/dV is the key-split kernel's TREE branch)."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.bench.workloads import doc_lengths, grpo_sequences
from packattn.ops.varlen import configs, op
from packattn.tree import Tree
from packattn.varlen import Varlen
from tests.gpu.test_triton_varlen_gpu import check_against_reference, forward_backward, inputs, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="the sm_90 Gluon kernels need a Hopper GPU")

MASKS = [{"causal": True}, {"causal": "top_left", "window": (100, 0)}, {"chunk_size": 100}, {"window": (70, 30)}, {}]
MASK_IDS = ["causal", "top_left_window", "chunk", "window", "full"]
NASTY_Q = [300, 1, 0, 64, 65, 500, 129, 37, 1000]
NASTY_KV = [200, 5, 40, 64, 1, 500, 300, 0, 1100]


def test_plan_takes_the_gluon_kernels_at_256():
    seqs = Varlen.from_lengths([1000, 300], device="cuda")
    q, k, v, _ = inputs(seqs, 8, 2, 256)
    tables, options = op.forward_plan(q, k, v, seqs, packattn.mask.Mask(), need_grad=True)
    assert options[op.FWD_OPTIONS.index("gluon")]
    plan = op.bwd_plan(q, k, v)
    assert plan.dkdv == configs.DKDV_CONFIGS[256] and plan.dkdv.key_split
    assert plan.dq == configs.DQ_CONFIGS[256] and op.fuses_delta(plan, None)


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("opts", MASKS, ids=MASK_IDS)
def test_d256_masks(opts, heads):
    seqs = Varlen.from_lengths(NASTY_Q, NASTY_KV, pad_to_multiple=16, device="cuda")
    check_against_reference(*inputs(seqs, *heads, 256), seqs, **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_d256_long_documents(dtype):
    seqs = Varlen.from_lengths(doc_lengths(16384, seed=0), device="cuda")
    check_against_reference(*inputs(seqs, 16, 4, 256, dtype), seqs, causal=True)


@pytest.mark.parametrize("cfg", [configs.GluonConfig(128, 64, 2, 8), configs.GluonConfig(64, 64, 2, 4)],
                         ids=["128x64x2", "64x64x2"])
def test_d256_forward_configs(cfg):
    seqs = Varlen.from_lengths(NASTY_Q, NASTY_KV, device="cuda")
    with configs.override(fwd=cfg):
        check_against_reference(*inputs(seqs, 8, 2, 256), seqs, causal=True, window=(300, 0))


def test_d256_backward_is_bitwise_deterministic():
    seqs = Varlen.from_lengths(doc_lengths(16384, seed=1), pad_to_multiple=64, device="cuda")
    q, k, v, dout = inputs(seqs, 16, 4, 256)
    first = forward_backward(q, k, v, dout, seqs, "triton", causal=True, deterministic=True)
    second = forward_backward(q, k, v, dout, seqs, "triton", causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_d256_padding_rows_stay_zero():
    seqs = Varlen.from_lengths(NASTY_Q, pad_to_multiple=64, device="cuda")
    out, lse, dq, dk, dv = check_against_reference(*inputs(seqs, 8, 2, 256), seqs, causal=True)
    padding = seqs.row_map_q()[0] < 0
    assert padding.any()
    for t in (out, dq, dk, dv):
        assert torch.equal(t[padding], torch.zeros_like(t[padding]))


def test_tree_d256():
    tree = Tree.from_sequences(grpo_sequences(2, 300, 4, 150), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tree.total, h, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
               for h in (8, 2, 2))
    dout = torch.randn(tree.total, 8, 256, device="cuda", generator=gen).bfloat16()
    out = packattn.attention(q, k, v, tree, backend="triton_tree")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = packattn.attention(*leaves, tree, backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    errors = {name: rel_l2(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    assert all(e < 1e-2 for e in errors.values()), errors


PART_DIMS = [(96, 96), (192, 192), (192, 128), (128, 64)]


@pytest.mark.parametrize("dims", PART_DIMS, ids=[f"{a}-{b}" for a, b in PART_DIMS])
@pytest.mark.parametrize("opts", MASKS[:3] + MASKS[4:], ids=MASK_IDS[:3] + MASK_IDS[4:])
def test_part_and_mla_dims_gluon_forward_and_backward(dims, opts):
    """Head dims in two column parts (96, 192) and MLA value dims: the Gluon forward (`fwd_sm90_parts`) and
    backward (`bwd_dkdv_sm90_parts`, `bwd_dq_sm90_parts`), against the reference; GQA, padding, empty and length-1
    sequences."""
    d, d_v = dims
    seqs = Varlen.from_lengths(NASTY_Q, NASTY_KV, pad_to_multiple=16, device="cuda")
    q, k, _, dout = inputs(seqs, 8, 2, d)
    _, _, v, dout = inputs(seqs, 8, 2, d_v, seed=1)
    _, options = op.forward_plan(q, k, v, seqs, packattn.mask.Mask.make(**opts), need_grad=True)
    assert options[op.FWD_OPTIONS.index("gluon")]
    plan = op.bwd_plan(q, k, v)
    assert plan.dkdv is not None and plan.dq is not None
    check_against_reference(q, k, v, dout, seqs, **opts)


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
@pytest.mark.parametrize("opts", MASKS[:3], ids=MASK_IDS[:3])
def test_short_documents_at_every_head_dim(head_dim, opts):
    """Batches of documents <= 512 tokens (`configs.SHORT_DEFAULT_CONFIGS` where it has the dim, under a mask
    `SHORT_MASKED_CONFIGS` where that has it, else `CONFIGS`), with empty, length-1 and block-crossing documents
    and padding, forward and backward against the reference."""
    seqs = Varlen.from_lengths([512] * 12 + [1, 0, 37, 160, 129, 300], pad_to_multiple=16, device="cuda")
    check_against_reference(*inputs(seqs, 8, 2, head_dim), seqs, **opts)
