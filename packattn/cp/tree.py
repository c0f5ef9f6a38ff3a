"""Context parallelism over a `packattn.Tree`: whole root subtrees per rank.

A `Tree` packs a forest in DFS pre-order, so the subtree of each root is one contiguous run of
nodes and rows, and rows of different roots never see each other (a GRPO group is one root: its
prompt and the responses below it). Such a subtree is what a document is to `balance="documents"`
(`packattn.cp.plan.document_ranks`): each goes whole to one rank, balanced on tokens and on tree
attention work (a row at depth ``d`` sees ``d + 1`` keys), and the local problem is the sub-forest
of this rank's roots (`CPPlan.local_tree`): no K/V leaves the rank whatever the strategy, forward
or backward. `CPPlan.unshard` still gathers results when asked.

Not implemented: cutting a root subtree across ranks (all-gather of the ancestors' K/V with a tree
mask on a subset of query rows). A root larger than a rank's share of the tokens stays whole, so
that rank holds more than its share; balances that cut every sequence raise `NotImplementedError`.
"""

from __future__ import annotations

import torch

from packattn.cp.plan import CPPlan, document_ranks, rows_layout


def build_tree_plan(tree, group, world: int, rank: int, strategy: str, balance: str) -> CPPlan:
    """The `CPPlan` of ``tree`` for ``rank`` of ``world`` (see the module docstring)."""
    if balance != "documents":
        raise NotImplementedError(f"balance={balance!r} cuts every sequence across ranks, which is not implemented "
                                  "for a Tree; balance='documents' keeps each root's subtree whole on one rank")
    cu = tree.cu_node_lens.cpu().long()
    parent = tree.node_parent.cpu().long()
    depth = tree.position_ids.cpu()
    roots = (parent < 0).nonzero().flatten()
    root_node_end = torch.cat([roots[1:], roots.new_tensor([tree.num_nodes])])
    root_rows = torch.stack([cu[roots], cu[root_node_end]], dim=1)  # (R, 2): rows [start, end) of each root
    sizes = root_rows[:, 1] - root_rows[:, 0]
    row_root = torch.repeat_interleave(torch.arange(roots.numel()), sizes, output_size=tree.total)
    work = torch.zeros(roots.numel(), dtype=torch.int64).index_add_(0, row_root, depth + 1)
    root_rank = document_ranks(sizes, world, work, cut_long=False)
    owner = root_rank[row_root]
    flat_pos, max_local, local_rows = rows_layout(owner, world, rank)
    return CPPlan(tree, group, world, rank, strategy, balance, owner, flat_pos, max_local, local_rows,
                  depth[local_rows], torch.zeros(0, 5, dtype=torch.int64),
                  local_tree=_sub_forest(tree, (root_rank == rank).nonzero().flatten(), roots, root_node_end,
                                         local_rows))


def attention(q, k, v, plan: CPPlan, **options):
    """`packattn.attention` of this rank's rows over its sub-forest (nothing communicated); a rank
    that holds no root gets empty results that still take part in autograd."""
    import packattn

    if plan.local_tree is not None:
        return packattn.attention(q, k, v, plan.local_tree, **options)
    out = v.new_zeros((0, q.shape[1], v.shape[-1])) + 0 * (q.sum() + k.sum() + v.sum())
    if options.get("return_lse"):
        return out, torch.zeros((q.shape[1], 0), dtype=torch.float32, device=q.device)
    return out


def _sub_forest(tree, mine: torch.Tensor, roots: torch.Tensor, root_node_end: torch.Tensor, local_rows: torch.Tensor):
    """The `Tree` of the roots ``mine`` (indices into ``roots``), nodes and sequences in their
    original order, on the tree's device; None when ``mine`` is empty."""
    from packattn.tree import Tree

    if mine.numel() == 0:
        return None
    nodes = torch.cat([torch.arange(int(roots[r]), int(root_node_end[r])) for r in mine.tolist()])
    new_index = torch.full((tree.num_nodes,), -1, dtype=torch.int64)
    new_index[nodes] = torch.arange(nodes.numel())
    parent = tree.node_parent.cpu().long()[nodes]
    local_parent = torch.where(parent >= 0, new_index[parent.clamp_min(0)], -1)
    lens = tree.cu_node_lens.cpu().long().diff()[nodes]
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    seq_nodes = tree.sequence_nodes.cpu()
    seq_nodes = new_index[seq_nodes][new_index[seq_nodes] >= 0]
    tokens = None if tree.tokens is None else tree.tokens.cpu()[local_rows]
    return Tree.from_nodes(cu, local_parent, sequence_nodes=seq_nodes, tokens=tokens, device=tree.device)
