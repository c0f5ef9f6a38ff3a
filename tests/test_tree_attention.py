"""Tree attention (`packattn.attention(q, k, v, tree)`) against every original sequence run alone
with causal attention in float64 (the oracle of the issue), on the reference backend and on the
Triton tree kernels (Triton's interpreter on CPU, float32; the real kernels on a GPU)."""

from __future__ import annotations

import math
import random

import pytest
import torch

import packattn
from packattn import Tree
from packattn.ops.tree import tables as tree_tables
from packattn.varlen import Varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton_tree"]


def grpo(prompts: int, group: int, prompt_len: int, response_len, seed: int = 0) -> list[list[int]]:
    """Prompts with ``group`` responses each (vocabulary large enough that responses differ)."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        for _ in range(group):
            n = response_len if isinstance(response_len, int) else rng.randint(*response_len)
            out.append(prompt + [1000 + rng.randrange(1000) for _ in range(n)])
    return out


def random_tree(seed: int) -> list[list[int]]:
    """Sequences over a tiny vocabulary: lots of sharing, prefixes of others, duplicates."""
    rng = random.Random(seed)
    return [[rng.randrange(3) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 7))]


CASES = {
    "grpo": lambda: grpo(2, 3, 37, (5, 70)),
    "deep_chain_1_token_nodes": lambda: [list(range(k)) for k in range(1, 33)],  # depth 32, every prefix
    "fan_out_64": lambda: [[7, 7, 7] + [100 + i] for i in range(64)],
    "duplicates_and_prefix": lambda: [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2], [1, 2, 3, 4, 5, 6], [9]],
    "no_sharing": lambda: [[i] * n for i, n in enumerate([17, 1, 37, 100, 3])],
    "random_3": lambda: random_tree(3),
    "random_8": lambda: random_tree(8),
}


def inputs(tree: Tree, heads=(2, 2), head_dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h):
        return torch.randn(tree.total, h, head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()

    return rand(heads[0]), rand(heads[1]), rand(heads[1])


def oracle(q, k, v, tree: Tree, weights: torch.Tensor):
    """Every sequence alone, causal, float64; ``loss = sum(out_seq * weights)`` over the
    concatenation of all sequences; gradients land on the packed rows (shared rows summed)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    outs = []
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    for rows in torch.split(tree.sequence_index, tree.sequence_lengths):
        qs, ks, vs = (x[rows] for x in leaves)
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        n = len(rows)
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
    out = torch.cat(outs)
    grads = torch.autograd.grad((out * weights.double()).sum(), leaves)
    return out.detach(), grads


def run(q, k, v, tree, backend, weights):
    out = packattn.attention(q, k, v, tree, backend=backend)
    gathered = tree.gather(out)
    grads = torch.autograd.grad((gathered * weights).sum(), (q, k, v))
    return gathered, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_tree_matches_each_sequence_alone(case, backend):
    tree = Tree.from_sequences(CASES[case](), device=DEVICE)
    q, k, v = inputs(tree, heads=(4, 2) if case == "grpo" else (2, 2))
    weights = torch.randn(tree.unpacked.total_q, q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(1))
    weights = weights.to(DEVICE)
    got, grads = run(q, k, v, tree, backend, weights)
    want, want_grads = oracle(q, k, v, tree, weights)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    for name, g, w in zip("qkv", grads, want_grads):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sharing_equals_varlen(backend):
    seqs = [[i] * n for i, n in enumerate([17, 1, 37, 100, 3])]
    tree = Tree.from_sequences(seqs, device=DEVICE)
    varlen = Varlen.from_lengths([len(s) for s in seqs], device=DEVICE)
    q, k, v = inputs(tree)
    out_tree, lse_tree = packattn.attention(q, k, v, tree, backend=backend, return_lse=True)
    out_var, lse_var = packattn.attention(q, k, v, varlen, causal=True, backend="reference", return_lse=True)
    torch.testing.assert_close(out_tree, out_var, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse_tree, lse_var, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sibling_order_does_not_change_per_sequence_results(backend):
    seqs = grpo(1, 4, 20, (3, 40), seed=5)
    a = Tree.from_sequences(seqs, device=DEVICE)
    b = Tree.from_sequences(seqs[::-1], device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    table = {tok: torch.randn(3, 32, generator=gen) for s in seqs for tok in s}

    def per_sequence(tree, order):
        # identical token embeddings as q = k = v, so rows depend only on the token prefix
        x = torch.stack([table[t] for t in tree.tokens.tolist()]).to(DEVICE)
        out = tree.gather(packattn.attention(x, x, x, tree, backend=backend))
        return list(torch.split(out, tree.sequence_lengths))[::order]

    for x, y in zip(per_sequence(a, 1), per_sequence(b, -1)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_tree_backward_refuses_a_dkdv_pass_changed_after_the_forward(monkeypatch):
    """As for varlen: the tree's dK/dV key tiles were built for the forward's plan (`op.bwd_plan`)."""
    import dataclasses

    from packattn.ops.tree import op as tree_op

    tree = Tree.from_sequences(grpo(1, 2, 9, 5), device=DEVICE)
    q, k, v = inputs(tree)
    out = packattn.attention(q, k, v, tree, backend="triton_tree")
    plan = tree_op.bwd_plan(q, k, v)
    block_n, block_m, gluon = plan.dkdv_choice
    changed = dataclasses.replace(plan, dkdv_choice=(block_n, 2 * block_m, not gluon))
    monkeypatch.setattr(tree_op, "bwd_plan", lambda *a: changed)
    with pytest.raises(RuntimeError, match="changed between forward and backward"):
        torch.autograd.grad(out.sum(), (q, k, v))


def test_tree_rejects_foreign_mask_options():
    tree = Tree.from_sequences([[1, 2], [1, 3]], device=DEVICE)
    q, k, v = inputs(tree)
    with pytest.raises(ValueError, match="own mask"):
        packattn.attention(q, k, v, tree, window=(4, 0))
    with pytest.raises(ValueError, match="own mask"):
        packattn.attention(q, k, v, tree, causal="top_left")
    with pytest.raises(ValueError, match="tree packs"):
        packattn.attention(q[:-1], k[:-1], v[:-1], tree)


def test_tree_is_causal_by_definition():
    """``causal=False`` with a Tree is an error (it used to run the tree's causal mask anyway, while "top_left"
    was refused); left unset, causal means the descriptor's own rule: the tree's, or none for a Varlen."""
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4]], device=DEVICE)
    q, k, v = inputs(tree)
    with pytest.raises(ValueError, match="a Tree is causal by definition"):
        packattn.attention(q, k, v, tree, causal=False, backend="reference")
    with pytest.raises(ValueError, match="a Tree is causal by definition"):
        packattn.DotProductAttention(causal=False, backend="reference")(q, k, v, tree)
    unset = packattn.attention(q, k, v, tree, backend="reference")
    torch.testing.assert_close(unset, packattn.attention(q, k, v, tree, causal=True, backend="reference"),
                               atol=0, rtol=0)
    torch.testing.assert_close(packattn.DotProductAttention(backend="reference")(q, k, v, tree), unset, atol=0, rtol=0)
    seqs = Varlen.from_lengths([3, 2], device=DEVICE)
    x = torch.randn(5, 2, 16, device=DEVICE)
    full = packattn.attention(x, x, x, seqs, causal=False, backend="reference")
    torch.testing.assert_close(packattn.attention(x, x, x, seqs, backend="reference"), full, atol=0, rtol=0)


# ---------------------------------------------------------------- the Triton tables
def _visible_pairs(tree: Tree) -> torch.Tensor:
    end = tree.row_subtree_end().long().cpu()
    t = torch.arange(tree.total)
    return (t[None, :] <= t[:, None]) & (t[:, None] < end[None, :])  # [query, key]


@pytest.mark.parametrize("case", ["grpo", "deep_chain_1_token_nodes", "random_8"])
@pytest.mark.parametrize("blocks", [(16, 8), (32, 16), (8, 32)])
def test_query_tile_intervals_cover_exactly_the_visible_blocks(case, blocks):
    tree = Tree.from_sequences(CASES[case](), device=DEVICE)
    bm, bn = blocks
    tiles, intervals = tree_tables.build_query_tiles(tree.row_subtree_end().int(), tree.total, bm, bn)
    vis = _visible_pairs(tree)
    covered = torch.zeros(tree.total, tree.total, dtype=torch.bool)
    seen_tiles = set()
    for q_start, first, count in tiles.tolist():
        seen_tiles.add(q_start)
        q_end = min(q_start + bm, tree.total)
        for lo, hi, kind in intervals[first:first + count].tolist():
            if kind == 0:
                continue
            assert lo % bn == 0 and hi % bn == 0 and lo < hi
            block = vis[q_start:q_end, lo:hi]
            if kind == tree_tables.FULL:  # no element mask there: every pair must be visible
                assert block.all() and hi <= tree.total
            covered[q_start:q_end, lo:min(hi, tree.total)] = True
    assert seen_tiles == set(range(0, tree.total, bm))
    assert not (vis & ~covered).any(), "a visible pair lies outside every interval"


@pytest.mark.parametrize("case", ["grpo", "deep_chain_1_token_nodes", "random_8"])
def test_key_tiles_cover_exactly_the_visible_queries(case):
    tree = Tree.from_sequences(CASES[case](), device=DEVICE)
    bn, step = 16, 8
    table = tree_tables.build_key_tiles(tree.row_subtree_end().int(), tree.total, bn, step)
    vis = _visible_pairs(tree)
    assert sorted(table[:, 1].tolist()) == list(range(0, tree.total, bn))
    for _, k_start, lo, mid_lo, mid_hi, hi in table.tolist():
        k_end = min(k_start + bn, tree.total)
        sees = vis[:, k_start:k_end].any(1).nonzero().flatten()
        assert sees.min() >= lo and sees.max() < hi  # every query that sees the tile is visited
        assert lo <= mid_lo <= mid_hi <= hi
        if mid_lo < mid_hi:  # a band: on the query-block grid from lo, every pair visible
            assert (mid_lo - lo) % step == 0 and (mid_hi - mid_lo) % step == 0
            assert vis[mid_lo:mid_hi, k_start:k_end].all()
        else:  # no band: the masked loops cover [lo, hi)
            assert mid_lo == mid_hi == hi
