"""`packattn.tree`: trie packing against a per-token dict trie, the node contract, visibility
against ancestor walks, validation errors, gather and sequence_logprobs against float64 per sequence."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import packattn
from packattn.tree import Tree, sequence_logprobs

sequences_st = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=8)


def brute_force(seqs):
    """Per-token dict trie in DFS pre-order, children in order of first appearance:
    (tokens, cu_node_lens, node_parent, sequence_nodes, sequence_index)."""
    children = {(): []}
    for s in seqs:
        for j in range(len(s)):
            p = tuple(s[: j + 1])
            if p not in children:
                children[p] = []
                children[p[:-1]].append(p)
    ends = {tuple(s) for s in seqs}
    order, stack = [], children[()][::-1]
    while stack:
        p = stack.pop()
        order.append(p)
        stack.extend(children[p][::-1])
    row = {p: r for r, p in enumerate(order)}
    starts = [r for r, p in enumerate(order) if len(p) == 1 or len(children[p[:-1]]) > 1 or p[:-1] in ends]
    node_of_row = [sum(1 for st_ in starts if st_ <= r) - 1 for r in range(len(order))]
    parent = [node_of_row[row[order[r][:-1]]] if len(order[r]) > 1 else -1 for r in starts]
    seq_index = [row[tuple(s[: j + 1])] for s in seqs for j in range(len(s))]
    return ([p[-1] for p in order], starts + [len(order)], parent,
            [node_of_row[row[tuple(s)]] for s in seqs], seq_index)


def grpo(prompts, group, prompt_len, response_len, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        out += [prompt + [1000 + rng.randrange(1000) for _ in range(response_len)] for _ in range(group)]
    return out


def agent(seed=0, width=(1, 3), depth=4, turn=(1, 6)):
    """Multi-turn rollouts: every turn branches into 1..3 continuations, up to ``depth`` turns."""
    rng = random.Random(seed)
    out = []

    def grow(prefix, level):
        if level == depth:
            out.append(prefix)
            return
        for _ in range(rng.randint(*width)):
            grow(prefix + [rng.randrange(10_000) for _ in range(rng.randint(*turn))], level + 1)

    grow([rng.randrange(10_000) for _ in range(5)], 0)
    return out


CASES = {
    "grpo": grpo(3, 4, 7, 5),
    "agent": agent(),
    "prefixes": [[1, 2, 3, 4, 5], [1, 2], [1, 2, 3, 4, 5, 6], [1], [1, 2, 3]],
    "duplicates": [[4, 5, 6], [4, 5, 6], [4, 5], [4, 5, 6]],
    "single": [[9, 8, 7, 6]],
    "no_sharing": [[i] * n for i, n in enumerate([3, 1, 5, 2], start=1)],
    "later_branch_first": [[1, 2, 3], [4], [1, 2, 5], [4, 6], [1, 7]],
    "tensor_inputs": [torch.tensor([1, 2, 3]), torch.tensor([1, 2], dtype=torch.int32), [1, 5]],
}


def as_lists(seqs):
    return [s.tolist() if isinstance(s, torch.Tensor) else list(s) for s in seqs]


def check_structure(seqs):
    """Every structural property of ``Tree.from_sequences(seqs)``; returns the tree."""
    seqs = as_lists(seqs)
    tree = Tree.from_sequences(seqs)
    tokens, cu, parent, seq_nodes, seq_index = brute_force(seqs)
    assert tree.tokens.tolist() == tokens
    assert tree.cu_node_lens.tolist() == cu
    assert tree.node_parent.tolist() == parent
    assert tree.sequence_nodes.tolist() == seq_nodes
    assert tree.sequence_index.tolist() == seq_index
    assert tree.cu_node_lens.dtype == tree.node_parent.dtype == tree.node_last_desc.dtype == torch.int32
    assert tree.sequence_index.dtype == tree.position_ids.dtype == tree.sequence_nodes.dtype == torch.int64
    # read back through sequence_index: tokens and positions of every sequence
    assert tree.tokens[tree.sequence_index].tolist() == [t for s in seqs for t in s]
    assert tree.position_ids[tree.sequence_index].tolist() == [j for s in seqs for j in range(len(s))]
    assert tree.sequence_lengths == [len(s) for s in seqs]
    assert tree.unpacked.cu_seqlens_q.tolist() == [0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()
    assert (tree.num_sequences, tree.max_depth) == (len(seqs), max(map(len, seqs)))
    assert (tree.num_nodes, tree.total) == (len(cu) - 1, cu[-1])
    assert tree.total <= sum(map(len, seqs))
    # every sequence ends at the end of its last node
    last_rows = [rows[-1] for rows in tree.sequence_index.split(tree.sequence_lengths)]
    assert (tree.cu_node_lens[tree.sequence_nodes + 1] - 1).tolist() == last_rows
    check_visibility(tree)
    return tree


def ancestors(parent, node):
    out = []
    while parent[node] >= 0:
        node = parent[node]
        out.append(node)
    return out


def check_visibility(tree):
    """node_last_desc and row_subtree_end against ancestor walks on parent pointers, every pair."""
    parent = tree.node_parent.tolist()
    n = len(parent)
    assert all(p < i for i, p in enumerate(parent))
    for i in range(1, n):  # pre-order: the parent is an ancestor-or-self of the previous node
        assert parent[i] == -1 or parent[i] in [i - 1] + ancestors(parent, i - 1)
    last = tree.node_last_desc.tolist()
    for a in range(n):
        assert [b for b in range(n) if b == a or a in ancestors(parent, b)] == list(range(a, last[a] + 1))
    row_node = tree.row_node().tolist()
    assert row_node == [i for i in range(n) for _ in range(tree.cu_node_lens[i + 1] - tree.cu_node_lens[i])]
    end = tree.row_subtree_end().tolist()
    for s in range(tree.total):
        for t in range(tree.total):
            a, b = row_node[s], row_node[t]
            visible = a in ancestors(parent, b) or (a == b and s <= t)
            assert visible == (s <= t < end[s]), (s, t)


@pytest.mark.parametrize("case", list(CASES))
def test_trie_matches_brute_force(case):
    check_structure(CASES[case])


@given(sequences_st)
def test_trie_random(seqs):
    check_structure(seqs)
    check_round_trip(Tree.from_sequences(seqs))


def test_trie_shapes():
    tree = Tree.from_sequences(grpo(2, 4, 10, 6))  # a prompt node with 4 response children, twice
    assert tree.node_parent.tolist() == [-1, 0, 0, 0, 0, -1, 5, 5, 5, 5]
    assert tree.total == 2 * (10 + 4 * 6)
    tree = Tree.from_sequences([[5, 6, 7, 8]])
    assert (tree.num_nodes, tree.total, tree.sequence_index.tolist()) == (1, 4, [0, 1, 2, 3])
    seqs = [[i] * n for i, n in enumerate([3, 1, 5], start=1)]
    tree = Tree.from_sequences(seqs)  # no sharing: one root per sequence, nothing saved
    assert tree.node_parent.tolist() == [-1, -1, -1] and tree.total == 9
    tree = Tree.from_sequences([[1, 2, 3, 4], [1, 2]])  # a prefix ends a node inside the other's run
    assert tree.cu_node_lens.tolist() == [0, 2, 4] and tree.sequence_nodes.tolist() == [1, 0]
    tree = Tree.from_sequences([[1, 2], [1, 2], [1, 2, 3]])  # duplicates share rows
    assert tree.sequence_index.tolist() == [0, 1, 0, 1, 0, 1, 2]
    deep = [list(range(k)) for k in range(1, 9)]  # every prefix: a chain of one-token nodes
    tree = Tree.from_sequences(deep[::-1])
    assert tree.node_parent.tolist() == [-1] + list(range(7)) and tree.total == 8


def test_children_in_order_of_first_appearance():
    tree = Tree.from_sequences([[1, 9], [2], [1, 3], [1, 0]])
    assert tree.tokens.tolist() == [1, 9, 3, 0, 2]
    assert tree.node_parent.tolist() == [-1, 0, 0, 0, -1]


def test_large_tree_against_brute_force():
    seqs = [s for seed in range(3) for s in agent(seed, width=(1, 4), depth=3, turn=(1, 40))] + grpo(2, 3, 50, 30)
    tree = Tree.from_sequences(seqs)
    tokens, cu, parent, seq_nodes, seq_index = brute_force(seqs)
    assert tree.tokens.tolist() == tokens and tree.cu_node_lens.tolist() == cu
    assert tree.node_parent.tolist() == parent and tree.sequence_index.tolist() == seq_index
    check_round_trip(tree)


def check_round_trip(tree):
    again = Tree.from_nodes(tree.cu_node_lens, tree.node_parent, sequence_nodes=tree.sequence_nodes, tokens=tree.tokens)
    for name in ("tokens", "position_ids", "cu_node_lens", "node_parent", "node_last_desc", "sequence_nodes",
                 "sequence_index"):
        a, b = getattr(tree, name), getattr(again, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("num_nodes", "num_sequences", "total", "sequence_lengths", "max_depth"):
        assert getattr(tree, name) == getattr(again, name), name
    assert torch.equal(tree.row_subtree_end(), again.row_subtree_end())


@pytest.mark.parametrize("case", list(CASES))
def test_from_nodes_round_trip(case):
    check_round_trip(Tree.from_sequences(CASES[case]))


def test_from_nodes_defaults_and_lists():
    tree = Tree.from_nodes([0, 2, 3, 5, 6], [-1, 0, 0, -1])  # lists, sequences = leaves in node order
    assert tree.tokens is None
    assert tree.sequence_nodes.tolist() == [1, 2, 3]
    assert tree.sequence_index.tolist() == [0, 1, 2, 0, 1, 3, 4, 5]
    assert tree.position_ids.tolist() == [0, 1, 2, 2, 3, 0]
    assert tree.node_last_desc.tolist() == [2, 1, 2, 3]
    assert tree.row_subtree_end().tolist() == [5, 5, 3, 5, 5, 6]
    with pytest.raises(ValueError, match="no tokens"):
        sequence_logprobs(torch.zeros(6, 4), tree)


CU, PARENT = torch.tensor([0, 2, 3, 5]), torch.tensor([-1, 0, 0])


@pytest.mark.parametrize(
    ("cu", "parent", "kwargs", "error", "match"),
    [
        (CU.float(), PARENT, {}, TypeError, "cu_node_lens must hold integers"),
        (CU, PARENT.double(), {}, TypeError, "node_parent must hold integers"),
        (CU[None], PARENT, {}, ValueError, "cu_node_lens must be 1-D"),
        (CU, PARENT[None], {}, ValueError, "node_parent must be 1-D"),
        ([0], [], {}, ValueError, "at least 2 entries"),
        ([1, 2, 3, 5], PARENT, {}, ValueError, "must start at 0"),
        ([0, 2, 1, 5], PARENT, {}, ValueError, r"decreasing: cu_node_lens\[2\] = 1 < cu_node_lens\[1\] = 2"),
        ([0, 2, 2, 5], PARENT, {}, ValueError, "node 1 is empty"),
        (CU, [-1, 0], {}, ValueError, "node_parent has 2 entries but cu_node_lens describes 3 nodes"),
        (CU, [-1, 0, 3], {}, ValueError, r"node_parent\[2\] = 3 is out of range"),
        (CU, [-1, 0, -2], {}, ValueError, r"node_parent\[2\] = -2 is out of range"),
        (CU, [-1, 2, 0], {}, ValueError, r"node_parent\[1\] = 2: a parent must come before its child"),
        (CU, [-1, 1, 0], {}, ValueError, r"node_parent\[1\] = 1: a parent must come before"),
        ([0, 1, 2, 3, 4], [-1, -1, 0, 1], {}, ValueError, "not in DFS pre-order: the parent of node 2"),
        ([0, 1, 2, 3, 4], [-1, 0, 1, 0], {}, None, None),  # valid: node 3 goes back up to the root
        ([0, 1, 2, 3, 4], [-1, 0, -1, 1], {}, ValueError, "parent of node 3 .node 1. is not an ancestor of node 2"),
        ([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2], {}, ValueError, "parent of node 3 .node 1. is not an ancestor"),
        (CU, PARENT, {"tokens": torch.arange(4)}, ValueError, "tokens has 4 entries but the nodes hold 5"),
        (CU, PARENT, {"tokens": torch.ones(5)}, TypeError, "tokens must hold integers"),
        (CU, PARENT, {"sequence_nodes": [0, 3]}, ValueError, r"sequence_nodes\[1\] = 3 is out of range \[0, 3\)"),
        (CU, PARENT, {"sequence_nodes": [-1]}, ValueError, r"sequence_nodes\[0\] = -1 is out of range"),
        (CU, PARENT, {"sequence_nodes": torch.tensor([0.0])}, TypeError, "sequence_nodes must hold integers"),
    ],
)
def test_from_nodes_validation(cu, parent, kwargs, error, match):
    if error is None:
        Tree.from_nodes(cu, parent, **kwargs)
        return
    with pytest.raises(error, match=match):
        Tree.from_nodes(cu, parent, **kwargs)


parents_st = st.lists(st.integers(0, 100), min_size=1, max_size=10).map(
    lambda xs: [x % (i + 1) - 1 for i, x in enumerate(xs)])  # parent[i] in [-1, i - 1]


@given(parents_st)
def test_preorder_check_random(parent):
    """Any parent < child array: accepted iff every parent is an ancestor-or-self of the previous node."""
    parent[0] = -1
    ok = all(p == -1 or p in [i - 1] + ancestors(parent, i - 1) for i, p in enumerate(parent) if i)
    cu = list(range(len(parent) + 1))
    if ok:
        check_visibility(Tree.from_nodes(cu, parent))
    else:
        with pytest.raises(ValueError, match="not in DFS pre-order"):
            Tree.from_nodes(cu, parent)


@pytest.mark.parametrize(
    ("seqs", "error", "match"),
    [
        ([], ValueError, "sequences is empty"),
        ([[1, 2], []], ValueError, r"sequences\[1\] is empty"),
        ([[1], torch.tensor([], dtype=torch.long)], ValueError, r"sequences\[1\] is empty"),
        ([[1.5, 2]], TypeError, r"sequences\[0\] must be a list of int"),
        ([torch.tensor([1.0])], TypeError, r"sequences\[0\] must hold integer"),
        ([torch.ones(2, 2, dtype=torch.long)], ValueError, r"sequences\[0\] must be 1-D"),
        (torch.ones(2, 2, dtype=torch.long), TypeError, "sequences must be a list"),
    ],
)
def test_from_sequences_validation(seqs, error, match):
    with pytest.raises(error, match=match):
        Tree.from_sequences(seqs)


def test_gather_sums_gradients_of_shared_rows():
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5]])
    x = torch.randn(tree.total, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 3, dtype=torch.float64)
    out = tree.gather(x)
    assert torch.equal(out, x.detach()[tree.sequence_index])
    out.backward(w)
    assert torch.allclose(x.grad[0], w[0] + w[3] + w[6])  # token 1: shared by all three
    assert torch.allclose(x.grad[1], w[1] + w[4])  # token 2: shared by two
    assert torch.allclose(x.grad, torch.zeros_like(x).index_add(0, tree.sequence_index, w))
    y = torch.randn(2, tree.total, dtype=torch.float64)
    assert torch.equal(tree.gather(y, dim=1), y[:, tree.sequence_index])
    with pytest.raises(ValueError, match="x has 4 rows along dim 0 but the tree packs 5"):
        tree.gather(torch.zeros(4))


def logprobs_oracle(logits, tree, tokens):
    """Every sequence alone, float64: log_softmax over its own rows, the first token gets 0."""
    out = []
    for rows in tree.sequence_index.split(tree.sequence_lengths):
        lp = torch.log_softmax(logits.double()[rows], -1)
        toks = tokens[rows]
        out.append(torch.cat([lp.new_zeros(1), lp[:-1].gather(1, toks[1:, None])[:, 0]]))
    return torch.cat(out)


@pytest.mark.parametrize("case", ["grpo", "agent", "prefixes", "duplicates", "single", "later_branch_first"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sequence_logprobs_match_each_sequence_alone(case, dtype):
    seqs = as_lists(CASES[case])
    vocab = max(t for s in seqs for t in s) + 1
    tree = Tree.from_sequences(seqs)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(tree.total, vocab, generator=gen)).to(dtype).requires_grad_()
    weights = torch.randn(sum(tree.sequence_lengths), generator=gen, dtype=torch.float64)
    got = sequence_logprobs(logits, tree)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == (tree.unpacked.total_q,)
    (grad,) = torch.autograd.grad((got.double() * weights).sum(), logits)
    leaf = logits.detach().double().requires_grad_()
    want = logprobs_oracle(leaf, tree, tree.tokens)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), leaf)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    torch.testing.assert_close(got.double(), want.detach(), atol=tol, rtol=0)
    grad_tol = 1e-2 if dtype == torch.bfloat16 else tol  # the gradient itself is rounded to bfloat16
    torch.testing.assert_close(grad.double(), want_grad, atol=grad_tol, rtol=grad_tol)
    assert (got[tree.unpacked.cu_seqlens_q[:-1].long()] == 0).all()


def test_sequence_logprobs_at_a_branch_point():
    tree = Tree.from_sequences([[0, 1, 2], [0, 1, 3]])  # rows: 0 1 | 2 | 3
    logits = torch.randn(tree.total, 4, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)
    got = sequence_logprobs(logits, tree)
    want = [0, lp[0, 1], lp[1, 2], 0, lp[0, 1], lp[1, 3]]  # row 1 predicts both children
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    other = torch.tensor([3, 2, 1, 0])  # explicit tokens override tree.tokens
    got = sequence_logprobs(logits, tree, other)
    torch.testing.assert_close(got, torch.tensor([0, lp[0, 2], lp[1, 1], 0, lp[0, 2], lp[1, 0]], dtype=torch.float64))


def test_sequence_logprobs_validation():
    tree = Tree.from_sequences([[0, 1], [0, 2]])
    with pytest.raises(TypeError, match="logits must be a floating-point"):
        sequence_logprobs(torch.zeros(3, 4, dtype=torch.long), tree)
    with pytest.raises(ValueError, match=r"logits must be \(total=3, vocab\)"):
        sequence_logprobs(torch.zeros(4, 4), tree)
    with pytest.raises(ValueError, match=r"tokens must have shape \(3,\)"):
        sequence_logprobs(torch.zeros(3, 4), tree, torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        sequence_logprobs(torch.zeros(3, 4), tree, torch.zeros(3))


def test_sequence_logprobs_names_a_token_id_outside_the_vocab():
    """A ValueError naming the id, not a raw IndexError (or a device-side assert on a GPU)."""
    tree = Tree.from_sequences([[0, 1], [0, 2]])  # packed tokens 0 1 2
    with pytest.raises(ValueError, match=r"tokens\[2\] = 2 is not a token id of logits with vocab 2"):
        sequence_logprobs(torch.zeros(3, 2), tree)
    with pytest.raises(ValueError, match=r"tokens\[1\] = -1 is not a token id of logits with vocab 4"):
        sequence_logprobs(torch.zeros(3, 4), tree, torch.tensor([0, -1, 1]))
    assert sequence_logprobs(torch.zeros(3, 3), tree).shape == (4,)  # the largest id, 2, fits a vocab of 3


def test_cache_to_and_exports():
    tree = Tree.from_sequences([[1, 2], [1, 3]])
    assert packattn.Tree is Tree and packattn.tree.sequence_logprobs is sequence_logprobs
    assert tree.row_node() is tree.row_node()
    assert tree.cached("k", lambda: 1) == 1 and tree.cached("k", lambda: 2) == 1
    assert tree.to("cpu") is tree and tree.to(torch.device("cpu")) is tree
    moved = tree.to("meta")
    assert moved is tree.to("meta") and moved.device.type == "meta"
    assert moved.sequence_index.device.type == moved.unpacked.device.type == "meta"
    assert "k" not in moved._cache and moved.total == tree.total
    assert repr(tree) == "Tree(num_sequences=2, num_nodes=3, total=3, unpacked=4, max_depth=2, device=cpu)"
