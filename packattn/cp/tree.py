"""Context parallelism over a `packattn.Tree`: root subtrees per rank, large roots cut across ranks.

A `Tree` packs a forest in DFS pre-order, so the subtree of each root is one contiguous run of
nodes and rows, and rows of different roots never see each other (a GRPO group is one root: its
prompt and the responses below it).

Plan (`build_tree_plan`). Roots are to a Tree what documents are to `balance="documents"`
(`packattn.cp.plan.document_ranks`, with tree work: a row at depth ``d`` sees ``d + 1`` keys): a
root of at most half a rank's fair share of tokens goes whole to one rank, balanced on tokens and
work. With ``strategy="allgather"`` a larger root (a huge GRPO group, an agent's trajectory tree)
is cut like a long document: its rows, in DFS order, into ``2 * world`` runs as even as possible,
rank ``r`` holding runs ``r`` and ``2 * world - 1 - r`` (zigzag: tokens balanced to a row, and the
work of a chain, which grows along the rows, too). Runs of rows rather than of whole nodes, so one
node longer than a share is cut as well: a node cut inside is two nodes, parent and child (the
second part's rows see the whole first part, which is the tree rule), so every node of the split
tree (`split_nodes`) has one owner. Other strategies keep every root whole (nothing communicated;
a root larger than a share overloads its rank).

Executor (`run`, every strategy; the mask checks are `packattn.cp.attention`'s). Outside itself, a run of consecutive pre-order nodes sees
only the proper ancestors of its first node, so a rank needs at most two paths of rows from the
others. Every rank all-gathers its rows that some other rank needs (`packattn.cp.comm.gather_rows`,
one collective for K and V; none at all when no root is cut) and runs `packattn.attention` on its
local tree: its nodes of the split tree plus their ancestors, kept in pre-order. Ancestor rows of
other ranks are keys only: their queries are zeros and their outputs are dropped, so their output
gradient is zero, hence ``dP = dO V^T = 0``, ``delta = rowsum(dO * O) = 0`` and ``dS = P (dP -
delta) = 0``: they add exactly nothing to dQ, dK or dV. The dK/dV of gathered rows go back to
their owners through the all-gather's reduce-scatter backward. The local tree and the index maps
are built once per plan and device (no host work per layer). The price of the zero queries: the
tree kernels run them against the ancestors before them, which is little for a wide tree (a GRPO
group: the prompt) but for a deep chain or one long node cut across ranks is up to the causal
attention of the whole prefix before a rank's run (a kernel entry taking queries for a subset of
the rows would remove it).

`CPPlan.local_tree` is the sub-forest of a rank's whole roots (tokens and sequences kept, e.g. for
`packattn.tree.sequence_logprobs`); None when the rank holds no root or part of a cut root (its
sequences then span ranks). Not implemented: ``balance`` other than "documents" (cutting every root).
"""

from __future__ import annotations

import dataclasses

import torch

import packattn
from packattn.cp.allgather import _flat_kv, _key_rows, _split_kv
from packattn.cp.comm import gather_rows
from packattn.cp.executor import Call
from packattn.cp.plan import CPPlan, document_ranks, gathered_layout, rows_layout, zigzag_rank
from packattn.tree.descriptor import Tree, _last_descendant

CUTTING_STRATEGIES = ("allgather",)  # the strategies whose plans cut a large root across ranks


def build_tree_plan(tree, group, world: int, rank: int, strategy: str, balance: str) -> CPPlan:
    """The `CPPlan` of ``tree`` for ``rank`` of ``world`` (see the module docstring)."""
    if balance != "documents":
        raise NotImplementedError(f"balance={balance!r} cuts every root across ranks, which is not implemented "
                                  "for a Tree; balance='documents' keeps small roots whole on one rank (and with "
                                  "strategy='allgather' cuts the large ones)")
    cu = tree.cu_node_lens.cpu().long()
    parent = tree.node_parent.cpu().long()
    depth = tree.position_ids.cpu()
    node_root = torch.cumsum(parent < 0, 0) - 1  # pre-order: each root opens the next subtree
    row_root = torch.repeat_interleave(node_root, cu.diff(), output_size=tree.total)
    root_rank = _root_ranks(row_root, depth, world, cut_large=strategy in CUTTING_STRATEGIES)
    owner = _row_owner(row_root, root_rank, world)
    flat_pos, max_local, local_rows = rows_layout(owner, world, rank)
    local_tree = None
    if local_rows.numel() and bool((root_rank[row_root[local_rows]] >= 0).all()):  # whole roots only
        tokens = None if tree.tokens is None else tree.tokens.cpu()[local_rows]
        local_tree = _sub_forest(cu, parent, (root_rank[node_root] == rank).nonzero().flatten(), tree.device,
                                 tree.sequence_nodes.cpu(), tokens)
    return CPPlan(tree, group, world, rank, strategy, balance, owner, flat_pos, max_local, local_rows,
                  depth[local_rows], torch.zeros(0, 5, dtype=torch.int64), local_tree=local_tree)


def _root_ranks(row_root: torch.Tensor, depth: torch.Tensor, world: int, cut_large: bool) -> torch.Tensor:
    """The rank of each root (``row_root``: the root of every row, ``depth``: every row's depth), or
    -1 for a root to cut (`document_ranks` on the roots' tokens and tree work; ``cut_large=False``
    keeps every root whole)."""
    sizes = torch.bincount(row_root)
    work = torch.zeros_like(sizes).index_add_(0, row_root, depth + 1)
    return document_ranks(sizes, world, work, cut_long=cut_large)


def _row_owner(row_root: torch.Tensor, root_rank: torch.Tensor, world: int) -> torch.Tensor:
    """The rank of every row: its root's rank, or for a cut root (-1) the zigzag rank of the row's
    position in the root's rows (DFS order)."""
    sizes = torch.bincount(row_root)
    pos = torch.arange(row_root.numel()) - (torch.cumsum(sizes, 0) - sizes)[row_root]
    whole = root_rank[row_root]
    return torch.where(whole >= 0, whole, zigzag_rank(pos, sizes[row_root], world))


def split_nodes(cu: torch.Tensor, parent: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-order forest (``cu_node_lens``, ``node_parent``, host int64) with every node cut where
    the ``owner`` of its rows changes: ``(cu, parent)`` of the parts. A part that starts a node has
    that node's parent (its last part); a later part has the part before it as parent, so every row
    sees the same rows as before."""
    total = owner.numel()
    starts = torch.zeros(total, dtype=torch.bool)
    starts[cu[:-1]] = True
    starts[1:] |= owner[1:] != owner[:-1]
    row_part = torch.cumsum(starts, 0) - 1
    first = starts.nonzero().flatten()  # first row of every part
    node = torch.repeat_interleave(torch.arange(parent.numel()), cu.diff(), output_size=total)[first]
    up = parent[node]
    up_last_part = torch.where(up >= 0, row_part[cu[up.clamp_min(0) + 1] - 1], -1)
    part_parent = torch.where(first == cu[node], up_last_part, torch.arange(first.numel()) - 1)
    return torch.cat([first, first.new_tensor([total])]), part_parent


def _needed_ancestors(parent: torch.Tensor, node_owner: torch.Tensor, world: int) -> torch.Tensor:
    """``(world, nodes)`` bool: node ``a`` is a proper ancestor of a node of rank ``r`` and ``r`` does
    not own it (its rows are keys that ``r`` gathers). In pre-order the proper descendants of ``a``
    are the nodes ``a + 1 .. last[a]``, so a prefix count per rank answers it."""
    last = _last_descendant(parent)
    owns = node_owner[None, :] == torch.arange(world)[:, None]
    count = torch.cumsum(owns, 1)  # count[r, a]: nodes <= a that rank r owns
    return (count[:, last] > count) & ~owns


@dataclasses.dataclass
class TreeLayout:
    """Index maps of one tree plan on one device (built once, reused by every layer)."""

    tree: object  # the local Tree: this rank's nodes of the split tree and their ancestors; None if none
    q_index: torch.Tensor  # (rows of tree,) local row, or num_local for a zero query (another rank's row)
    kv_index: torch.Tensor  # (rows of tree,) local row, or num_local + row of the gathered layout
    send_index: torch.Tensor  # local rows that some other rank needs (this rank's part of the all-gather)
    max_send: int  # rows per rank in the gathered layout (0: no root is cut, nothing communicated)
    out_index: torch.Tensor  # (num_local,) row of the tree holding each local row
    identity: bool  # the tree's rows are exactly the local rows (nothing needed from other ranks)


def build_layout(plan: CPPlan, device) -> TreeLayout:
    """The `TreeLayout` of ``plan`` on ``device`` (host work, once per plan and device)."""
    tree = plan.descriptor
    cu, parent = split_nodes(tree.cu_node_lens.cpu().long(), tree.node_parent.cpu().long(), plan.owner)
    node_owner = plan.owner[cu[:-1]]
    needed = _needed_ancestors(parent, node_owner, plan.world)
    row_node = torch.repeat_interleave(torch.arange(parent.numel()), cu.diff(), output_size=plan.total)
    local_pos = plan.flat_pos - plan.owner * plan.max_local  # every row's index on its owner
    gathered_pos, max_send, send_rows = gathered_layout(plan.owner, needed.any(0)[row_node], plan.world, plan.rank)

    keep = (node_owner == plan.rank) | needed[plan.rank]
    rows = keep[row_node].nonzero().flatten()  # the local tree's rows, in global (pre-order) order
    own = plan.owner[rows] == plan.rank
    n_local = plan.num_local
    q_index = torch.where(own, local_pos[rows], n_local)
    kv_index = torch.where(own, local_pos[rows], n_local + gathered_pos[rows])
    local = _sub_forest(cu, parent, keep.nonzero().flatten(), device) if rows.numel() else None
    return TreeLayout(local, q_index.to(device), kv_index.to(device), local_pos[send_rows].to(device),
                      max_send, own.nonzero().flatten().to(device), bool(own.all()))


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, call: Call):
    """The executor of Tree plans, every strategy (`packattn.cp.executor`; module docstring): `packattn.attention`
    of this rank's rows over its local tree. A rank that holds no row gets empty results that still take part in
    autograd (and in the collectives, when a root is cut)."""
    layout = plan.cached(("tree", str(q.device)), lambda: build_layout(plan, q.device))
    k_buf, v_buf = _local_kv(k, v, plan, layout)
    q_buf = q if layout.identity else torch.cat([q, q.new_zeros(1, *q.shape[1:])]).index_select(0, layout.q_index)
    if layout.tree is None:
        tie = q_buf.flatten()[:0].sum() + k_buf.flatten()[:0].sum() + v_buf.flatten()[:0].sum()
        out = q.new_zeros(0, q.shape[1], v.shape[-1]) + tie
        return out, (torch.zeros(q.shape[1], 0, dtype=torch.float32, device=q.device) if call.return_lse else None)
    res = packattn.attention(q_buf, k_buf, v_buf, layout.tree, causal=call.causal, return_lse=call.return_lse,
                             **call.options())
    out, lse = res if call.return_lse else (res, None)
    if layout.identity:
        return out, lse
    return out.index_select(0, layout.out_index), (None if lse is None else lse.index_select(1, layout.out_index))


def _local_kv(k: torch.Tensor, v: torch.Tensor, plan: CPPlan, layout: TreeLayout):
    """K and V of the local tree's rows: own rows read here, other ranks' rows from one all-gather
    of K and V together. Every rank takes part in it whenever a root is cut, needed rows or not, and
    the result depends on the gathered tensor, so its reduce-scatter backward runs on every rank too."""
    if layout.max_send == 0 and layout.identity:
        return k, v
    kv = _flat_kv(k, v)
    gathered = None
    if layout.max_send:
        gathered = gather_rows(kv.index_select(0, layout.send_index), layout.max_send, plan.world, plan.group)
    return _split_kv(_key_rows(kv, gathered, layout), k.shape[1], k.shape[2])


def _sub_forest(cu: torch.Tensor, parent: torch.Tensor, nodes: torch.Tensor, device, sequence_nodes=None, tokens=None):
    """The `Tree` on ``device`` of ``nodes`` (ascending, holding the parent of each) of the pre-order
    forest (``cu``, ``parent``, host int64), in their order; its sequences are the forest's
    ``sequence_nodes`` among ``nodes`` (default: the leaves), ``tokens`` those of its rows."""
    new_index = torch.full((parent.numel(),), -1, dtype=torch.int64)
    new_index[nodes] = torch.arange(nodes.numel())
    up = parent[nodes]
    local_parent = torch.where(up >= 0, new_index[up.clamp_min(0)], -1)
    lens = cu.diff()[nodes]
    local_cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    if sequence_nodes is not None:
        sequence_nodes = new_index[sequence_nodes][new_index[sequence_nodes] >= 0]
    return Tree.from_nodes(local_cu, local_parent, sequence_nodes=sequence_nodes, tokens=tokens, device=device)
