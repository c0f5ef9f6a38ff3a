"""Context parallelism over a Tree (packattn.cp.tree): whole root subtrees per rank.

Nothing is communicated in attention, so every rank's plan is built in one process
(``plan(..., world=W, rank=r)``) and the ranks' local results, put back at their global rows, must
equal attention over the whole tree: outputs, lse and gradients of q, k, v.
"""

import pytest
import torch

import packattn
from packattn import cp
from packattn.tree import Tree


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
@pytest.mark.parametrize("strategy", ["allgather", "p2p", "a2a"])
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
        plan = cp.plan(tree, world=3, rank=rank)
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
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4]])  # one root
    q, k, v = _inputs(tree.total)
    plans = [cp.plan(tree, world=2, rank=r) for r in range(2)]
    empty = next(p for p in plans if p.num_local == 0)
    local = [t.detach()[empty.local_rows].requires_grad_() for t in (q, k, v)]
    out, lse = cp.attention(*local, empty, backend="reference", return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.numel() == 0 for t in local)


def test_a_root_larger_than_a_share_stays_whole():
    tree = Tree.from_sequences([[1] * 40, [1] * 30 + [2] * 5, [2, 3], [4, 5]])
    plans = [cp.plan(tree, world=2, rank=r) for r in range(2)]
    assert sorted(p.num_local for p in plans) == [4, 45]  # the 45-row root on one rank, the rest on the other


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
