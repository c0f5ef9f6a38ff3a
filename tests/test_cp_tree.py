"""Context parallelism over a Tree (packattn.cp.tree): small roots whole per rank, large roots
cut across ranks (strategy "allgather").

Plans that keep every root whole (strategies other than "allgather") communicate nothing, so every
rank's plan runs in one process (``plan(..., world=W, rank=r)``). Cut roots all-gather their
ancestors' K/V: one gloo group per world size (2, 3, 4), spawned once for the module, runs every
such case (tests/cp_harness.py). Either way the ranks' local results, put back at their global
rows, must equal attention over the whole tree (reference backend, float64): outputs, lse and
gradients of q, k, v.
"""

import pytest
import torch

import packattn
from cp_harness import SPAWN_TIMEOUT_S, finish, grads, init_gloo, max_err, run_case, spawn
from packattn import cp
from packattn.cp import tree as cp_tree
from packattn.tree import Tree

WORLDS = (2, 3, 4)
TOL64 = 1e-10


def _grpo_forest(groups, prompt_len, responses, response_len, seed):
    """``groups`` roots: a prompt each, ``responses`` distinct continuations of random lengths."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(groups):
        prompt = torch.randint(0, 50, (int(torch.randint(1, prompt_len + 1, (1,), generator=g)),), generator=g)
        prompt[0] = 1000 + i  # distinct first tokens: one root per group
        for _ in range(responses):
            tail = torch.randint(0, 50, (int(torch.randint(0, response_len + 1, (1,), generator=g)),), generator=g)
            seqs.append(torch.cat([prompt, tail]))
    return Tree.from_sequences(seqs)


def _inputs(total, heads=(4, 2), d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, d, generator=g, dtype=torch.float64, requires_grad=True)
            for h in (heads[0], heads[1], heads[1])]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["p2p", "a2a"])  # whole roots; "allgather" cuts: see the gloo tests
def test_ranks_together_equal_the_whole_tree(world, strategy):
    tree = _grpo_forest(groups=9, prompt_len=12, responses=3, response_len=9, seed=world)
    q, k, v = _inputs(tree.total)
    dout = torch.randn(tree.total, 4, 16, dtype=torch.float64)
    out, lse = packattn.attention(q, k, v, tree, backend="reference", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    got_out, got_lse = torch.zeros_like(out), torch.zeros_like(lse)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    owned = torch.zeros(tree.total, dtype=torch.int64)
    for rank in range(world):
        plan = cp.plan(tree, world=world, rank=rank, strategy=strategy)
        rows = plan.local_rows
        owned[rows] += 1
        assert torch.equal(plan.position_ids, tree.position_ids[rows])
        local = [t.detach()[rows].requires_grad_() for t in (q, k, v)]
        o, lo = cp.attention(*local, plan, backend="reference", return_lse=True)
        got_out[rows], got_lse[:, rows] = o.detach(), lo.detach()
        for acc, g in zip(got_grads, torch.autograd.grad(o, local, dout[rows])):
            acc[rows] = g
    assert torch.equal(owned, torch.ones_like(owned))  # every row on exactly one rank
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, lse, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_local_tree_keeps_sequences_and_tokens():
    tree = _grpo_forest(groups=6, prompt_len=8, responses=4, response_len=6, seed=3)
    seen = []
    for rank in range(3):
        plan = cp.plan(tree, world=3, rank=rank, strategy="p2p")  # every root whole
        local = plan.local_tree
        assert torch.equal(local.tokens, tree.tokens[plan.local_rows])
        assert torch.equal(local.position_ids, plan.position_ids)
        # the rank's sequences, as token lists, are whole sequences of the global tree
        seen += [tuple(local.tokens[local.sequence_index][s:e].tolist())
                 for s, e in zip(local.unpacked.host_starts_q, [a + b for a, b in zip(
                     local.unpacked.host_starts_q, local.sequence_lengths)])]
    whole = [tuple(tree.tokens[tree.sequence_index][s:s + n].tolist())
             for s, n in zip(tree.unpacked.host_starts_q, tree.sequence_lengths)]
    assert sorted(seen) == sorted(whole)


def test_balances_tree_work_over_ranks():
    tree = _grpo_forest(groups=16, prompt_len=20, responses=4, response_len=20, seed=5)
    tokens = [cp.plan(tree, world=4, rank=r).num_local for r in range(4)]
    assert sum(tokens) == tree.total
    assert max(tokens) <= 1.5 * tree.total / 4


def test_rank_without_roots_gets_empty_results_with_gradients():
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4]])  # one root, kept whole
    q, k, v = _inputs(tree.total)
    plans = [cp.plan(tree, world=2, rank=r, strategy="p2p") for r in range(2)]
    empty = next(p for p in plans if p.num_local == 0)
    local = [t.detach()[empty.local_rows].requires_grad_() for t in (q, k, v)]
    out, lse = cp.attention(*local, empty, backend="reference", return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.numel() == 0 for t in local)


def test_a_root_larger_than_a_share_is_cut_by_allgather_only():
    tree = Tree.from_sequences([[1] * 40, [1] * 30 + [2] * 5, [2, 3], [4, 5]])
    whole = [cp.plan(tree, world=2, rank=r, strategy="p2p") for r in range(2)]
    assert sorted(p.num_local for p in whole) == [4, 45]  # the 45-row root on one rank, the rest on the other
    cut = [cp.plan(tree, world=2, rank=r) for r in range(2)]
    assert sorted(p.num_local for p in cut) == [24, 25]  # the 45-row root zigzag, 4 rows whole
    assert [p.local_tree is None for p in cut] == [True, True]  # both hold part of the cut root


def test_plan_refuses_what_it_cannot_do():
    small = _grpo_forest(groups=4, prompt_len=4, responses=2, response_len=4, seed=0)
    with pytest.raises(NotImplementedError, match="balance='zigzag'"):
        cp.plan(small, world=2, rank=0, balance="zigzag")

    class DeviceMesh:  # stands in for a 2-D torch DeviceMesh (plan looks at the type name and ndim)
        ndim = 2

    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        cp.plan(small, DeviceMesh(), world=2, rank=0)
    plan = cp.plan(small, world=2, rank=0)
    q, k, v = _inputs(plan.num_local)
    with pytest.raises(ValueError, match="Tree defines its own mask"):
        cp.attention(q, k, v, plan, window=(4, 0), backend="reference")


# ------------------------------------------------------------------ trees with roots to cut
def _huge_group(seed):
    """One GRPO group (long prompt, 24 responses) bigger than the whole batch's share, plus 6 small groups."""
    big = _grpo_forest(groups=1, prompt_len=24, responses=24, response_len=10, seed=seed)
    small = _grpo_forest(groups=6, prompt_len=5, responses=2, response_len=4, seed=seed + 1)
    return _concat(big, small)


def _chain(seed, depth=32):
    """A chain of ``depth`` nodes (1-3 rows each), a 1-2 row leaf under each, plus a small root:
    pre-order c0, l0, c1, l1, ... (each chain node's children: its leaf, then the next chain node)."""
    g = torch.Generator().manual_seed(seed)
    lens, parent = [], []
    for i in range(depth):
        parent += [2 * i - 2 if i else -1, 2 * i]
        lens += [int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 3, (1,), generator=g))]
    lens, parent = lens + [3], parent + [-1]
    return Tree.from_nodes(torch.tensor([0] + lens).cumsum(0), torch.tensor(parent))


def _long_node(seed):
    """A root that is a single 70-row node (longer than a rank's share), a root whose 40-row prompt
    has two short responses, and small roots."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 50, (40,), generator=g).tolist()
    return Tree.from_sequences([[900] * 70, [901] + prompt, [901] + prompt + [1, 2], [901] + prompt + [3],
                                [902, 4, 5], [903]])


def _fanout(seed, width=64):
    """One root: a 6-row prompt with ``width`` responses of 1-4 rows; plus two small roots."""
    g = torch.Generator().manual_seed(seed)
    seqs = [[800, 1, 2, 3, 4, 5] + [i] + torch.randint(0, 50, (int(torch.randint(0, 4, (1,), generator=g)),),
                                                       generator=g).tolist() for i in range(100, 100 + width)]
    return Tree.from_sequences(seqs + [[801, 1, 2], [802, 3]])


def _concat(*trees):
    """The forest of the roots of ``trees``, in order."""
    cu, parent, offset_rows, offset_nodes = [torch.zeros(1, dtype=torch.int64)], [], 0, 0
    for t in trees:
        cu.append(t.cu_node_lens[1:].long() + offset_rows)
        p = t.node_parent.long()
        parent.append(torch.where(p >= 0, p + offset_nodes, -1))
        offset_rows, offset_nodes = offset_rows + t.total, offset_nodes + t.num_nodes
    return Tree.from_nodes(torch.cat(cu), torch.cat(parent))


TREES = {
    "huge_group": lambda: _huge_group(seed=7),
    "chain32": lambda: _chain(seed=8),
    "long_node": lambda: _long_node(seed=9),
    "fanout64": lambda: _fanout(seed=10),
    "forest": lambda: _grpo_forest(groups=9, prompt_len=12, responses=3, response_len=9, seed=2),
    "tiny": lambda: Tree.from_sequences([[1, 2], [1, 3]]),  # at world 4 a rank holds nothing
}
CASES = {  # name: (tree, heads (q, kv), lse in the loss); all but "forest" cut a root at every world
    "huge_group": ("huge_group", (4, 2), False),
    "huge_group-lse": ("huge_group", (2, 2), True),
    "chain32": ("chain32", (4, 1), False),
    "chain32-lse": ("chain32", (2, 2), True),
    "long_node": ("long_node", (4, 2), False),
    "fanout64": ("fanout64", (4, 2), True),
    "forest": ("forest", (4, 4), False),
    "tiny": ("tiny", (2, 1), False),
}


def _cut_plans(tree, world):
    return [cp.plan(tree, world=world, rank=r) for r in range(world)]


def _row_root(tree):
    return torch.repeat_interleave(torch.cumsum(tree.node_parent.long() < 0, 0) - 1, tree.cu_node_lens.long().diff())


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("name", ["huge_group", "chain32", "long_node", "fanout64"])
def test_cut_plan_balances_and_gathers_only_ancestors(name, world):
    tree = TREES[name]()
    plans = _cut_plans(tree, world)
    owner = plans[0].owner
    assert all(torch.equal(p.owner, owner) for p in plans)
    row_root = _row_root(tree)
    assert len(set(owner[row_root == 0].tolist())) == world  # the large root is spread over every rank
    tokens = torch.tensor([p.num_local for p in plans], dtype=torch.float64)
    work = torch.tensor([float((p.position_ids + 1).sum()) for p in plans], dtype=torch.float64)
    assert tokens.max() <= 1.25 * tree.total / world + 2, tokens
    assert work.max() <= 1.3 * float((tree.position_ids + 1).sum()) / world + 8, work
    for p in plans:
        layout = cp_tree.build_layout(p, "cpu")
        own = layout.q_index < p.num_local
        assert torch.equal(layout.q_index[own], torch.arange(p.num_local))  # own rows, in order
        assert torch.equal(layout.out_index, own.nonzero().flatten())
        # the other ranks' rows are keys of the rank's rows: ancestors, at most two paths
        assert int((~own).sum()) <= 2 * tree.max_depth
        assert int(layout.tree.position_ids.max()) < tree.max_depth


@pytest.mark.parametrize("name", ["huge_group", "chain32", "long_node", "fanout64"])
def test_split_nodes_keeps_the_mask(name):
    tree = TREES[name]()
    owner = _cut_plans(tree, 4)[0].owner
    cu, parent = cp_tree.split_nodes(tree.cu_node_lens.long(), tree.node_parent.long(), owner)
    split = Tree.from_nodes(cu, parent)
    assert split.num_nodes > tree.num_nodes
    assert torch.equal(split.row_subtree_end(), tree.row_subtree_end())  # same keys for every query
    assert torch.equal(split.position_ids, tree.position_ids)
    part_owner = torch.repeat_interleave(owner[cu[:-1]], cu.diff())
    assert torch.equal(part_owner, owner)  # every part has one owner


def test_ancestor_queries_add_nothing_to_gradients():
    """The zero queries of gathered ancestor rows, with their outputs dropped, leave every gradient
    bitwise as it is with any other queries there: dS = P (dP - delta) = 0 for those rows."""
    tree = _huge_group(seed=3)
    plan = _cut_plans(tree, 3)[2]
    layout = cp_tree.build_layout(plan, "cpu")
    rows = layout.q_index.numel()
    dummy = layout.q_index >= plan.num_local
    assert dummy.any()
    q, k, v = _inputs(rows, seed=1)
    dout = torch.randn(rows, 4, 16, dtype=torch.float64).masked_fill(dummy[:, None, None], 0.0)
    dlse = torch.randn(4, rows).masked_fill(dummy, 0.0)
    got = []
    for fill in (0.0, 3.0):
        leaves = [q.detach().masked_fill(dummy[:, None, None], fill).requires_grad_(), k, v]
        out, lse = packattn.attention(*leaves, layout.tree, backend="reference", return_lse=True)
        got.append(torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves))
    keep = ~dummy
    assert torch.equal(got[0][0][keep], got[1][0][keep])  # dq of own rows
    assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][2], got[1][2])  # dk, dv of every row
    assert torch.equal(got[0][0][dummy], torch.zeros_like(got[0][0][dummy]))


def test_only_allgather_cuts_and_the_mask_is_checked_on_every_rank():
    tree = _huge_group(seed=4)
    row_root = _row_root(tree)
    for strategy in ("p2p", "a2a"):
        owner = cp.plan(tree, world=4, rank=0, strategy=strategy).owner
        assert torch.unique(row_root * 4 + owner).numel() == int(row_root.max()) + 1  # every root on one rank
    empty = next(p for p in _cut_plans(TREES["tiny"](), 4) if p.num_local == 0)
    q, k, v = _inputs(0)
    with pytest.raises(ValueError, match="Tree defines its own mask"):  # before any collective
        cp.attention(q, k, v, empty, chunk_size=4, backend="reference")


# ------------------------------------------------------------------ gloo: roots cut across ranks
def _run_case(tree_name, heads, lse_in_loss, seed, group):
    """Errors of ``cp.attention`` over ``group`` (roots cut, strategy "allgather") against the whole
    tree, everything gathered back to the global rows."""
    tree = TREES[tree_name]()
    g = torch.Generator().manual_seed(seed)
    hq, hk = heads
    inputs = [torch.randn(tree.total, h, 8, generator=g, dtype=torch.float64) for h in (hq, hk, hk)]
    grad_out = torch.randn(tree.total, hq, 8, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(hq, tree.total, generator=g, dtype=torch.float32) if lse_in_loss else None

    def single(q, k, v):
        return packattn.attention(q, k, v, tree, backend="reference", return_lse=True)

    out_ref, lse_ref, grads_ref = grads(single, inputs, grad_out, grad_lse)
    plan = cp.plan(tree, group)

    def parallel(q, k, v):
        return cp.attention(q, k, v, plan, backend="reference", return_lse=True)

    local_grad_lse = None if grad_lse is None else plan.shard(grad_lse.t()).t()
    out_l, lse_l, grads_l = grads(parallel, [plan.shard(t) for t in inputs], plan.shard(grad_out), local_grad_lse)
    with torch.no_grad():
        got = [plan.unshard(out_l), plan.unshard(lse_l.t().contiguous()).t(), *(plan.unshard(t) for t in grads_l)]
    want = [out_ref, lse_ref, *grads_ref]
    return {"errors": {name: max_err(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want)},
            "position_ids_ok": bool(torch.equal(plan.position_ids, tree.position_ids[plan.local_rows])),
            "gathered": cp_tree.build_layout(plan, "cpu").max_send}


SUBGROUPS = {2: [[0, 2], [1, 3]], 3: [[0, 1, 2]], 4: [[0, 1, 2, 3]]}  # ranks of the 4 processes per world


def _worker(rank, world, init_file, out_dir, case_names):
    """One process of 4: every case at world 4, in a 3-rank subgroup (rank 3 idle) and in two
    2-rank subgroups side by side; results keyed ``"{world}/{case}"``."""
    import torch.distributed as dist

    init_gloo(rank, world, init_file, SPAWN_TIMEOUT_S)
    results = {}
    try:
        for size, members in SUBGROUPS.items():
            groups = [None if len(m) == world else dist.new_group(m) for m in members]  # every rank creates each
            mine = next((g for g, m in zip(groups, members) if rank in m), "idle")
            if mine == "idle":
                continue
            for i, name in enumerate(case_names):
                results[f"{size}/{name}"] = run_case(_run_case, *CASES[name], seed=100 + i, group=mine)
    finally:
        finish(rank, out_dir, results)


_RESULTS: list[dict] = []


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not _RESULTS:
        _RESULTS.extend(spawn(_worker, 4, str(tmp_path_factory.mktemp("cp_tree")), (list(CASES),), SPAWN_TIMEOUT_S))
    return _RESULTS


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_cut_roots_match_the_whole_tree(results, name, world):
    members = [r for m in SUBGROUPS[world] for r in m]
    for rank in members:
        res = results[rank][f"{world}/{name}"]
        where = f"rank {rank} world {world} {name}"
        assert "exception" not in res, f"{where}: {res}"
        assert res["position_ids_ok"], where
        assert res["gathered"] > 0 or name == "forest", f"{where}: no root was cut"
        for key, err in res["errors"].items():
            assert err <= TOL64, f"{where}: {key} error {err}"
