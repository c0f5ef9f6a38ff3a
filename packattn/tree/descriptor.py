"""`Tree`: sequences that share prefixes, packed once as a trie (RL rollouts, GRPO groups, agents).

Nodes are runs of tokens packed in DFS pre-order, children in order of first appearance, so the
subtree of node ``a`` is the node range ``a .. node_last_desc[a]``. A sequence is the path from a
root to a node (internal nodes too: a sequence may be a prefix of another). Token ``t`` of node
``b`` sees token ``s`` of node ``a`` iff ``a`` is a proper ancestor of ``b``, or ``a == b`` and
``s <= t``; in rows: key ``s`` is visible to the queries ``s <= t < row_subtree_end()[s]``.

The node contract (``cu_node_lens``, ``node_parent``) is the one of Megatron's ``TreeMetadata``.
Everything is built on the host with tensor ops (no per-token Python loop) and then moved.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from packattn.varlen import Varlen, lengths_then_zero, mark_dynamic

_INT32_MAX = 2**31 - 1
_I64 = torch.int64


def _index_tensor(name: str, x) -> torch.Tensor:
    """``x`` (a tensor or a list of ints) as a 1-D int64 CPU tensor; TypeError / ValueError otherwise."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, Sequence) and len(x) == 0:
            x = torch.zeros(0, dtype=_I64)
        else:
            try:
                x = torch.as_tensor(x)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(f"{name} must be an integer tensor or a list of ints ({err})") from None
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    return x.to("cpu", _I64)


def _first(mask: torch.Tensor) -> int | None:
    """Index of the first True in ``mask``, or None."""
    hit = mask.nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def _node_depth(parent: torch.Tensor) -> torch.Tensor:
    """Number of proper ancestors of each node, by pointer doubling (log2(depth) rounds)."""
    jump, depth = parent.clone(), (parent >= 0).to(_I64)
    while (has := jump >= 0).any():
        j = jump.clamp_min(0)
        depth = torch.where(has, depth + depth[j], depth)
        jump = torch.where(has, jump[j], jump)
    return depth


def _last_descendant(parent: torch.Tensor) -> torch.Tensor:
    """Last node of each subtree of a pre-order forest: follow "last child" links, doubling them."""
    nodes = torch.arange(parent.numel())
    last = nodes.clone()
    child = parent >= 0
    last.scatter_reduce_(0, parent[child], nodes[child], reduce="amax")
    while not torch.equal(nxt := last[last], last):
        last = nxt
    return last


def _check_nodes(cu: torch.Tensor, parent: torch.Tensor) -> None:
    """Raise ValueError unless ``cu_node_lens`` / ``node_parent`` describe non-empty nodes in DFS pre-order."""
    if cu.numel() < 2:
        raise ValueError(f"cu_node_lens needs at least 2 entries (one node), got {cu.tolist()}")
    if cu[0] != 0:
        raise ValueError(f"cu_node_lens must start at 0, got {int(cu[0])}")
    lens = cu.diff()
    if (i := _first(lens < 0)) is not None:
        raise ValueError(f"cu_node_lens is decreasing: cu_node_lens[{i + 1}] = {int(cu[i + 1])} < "
                         f"cu_node_lens[{i}] = {int(cu[i])}")
    if (i := _first(lens == 0)) is not None:
        raise ValueError(f"node {i} is empty (cu_node_lens[{i}] == cu_node_lens[{i + 1}] == {int(cu[i])}); "
                         "every node needs at least one token")
    if int(cu[-1]) > _INT32_MAX:
        raise ValueError(f"cu_node_lens total {int(cu[-1])} overflows int32 offsets")
    n = lens.numel()
    if parent.numel() != n:
        raise ValueError(f"node_parent has {parent.numel()} entries but cu_node_lens describes {n} nodes")
    if (i := _first((parent < -1) | (parent >= n))) is not None:
        raise ValueError(f"node_parent[{i}] = {int(parent[i])} is out of range [-1, {n})")
    nodes = torch.arange(n)
    if (i := _first(parent >= nodes)) is not None:
        raise ValueError(f"node_parent[{i}] = {int(parent[i])}: a parent must come before its child")
    # Pre-order <=> every node i >= 1 is at most one level below node i - 1, and a non-root's
    # parent is the last node before it one level up (so it is an ancestor-or-self of node i - 1).
    depth = _node_depth(parent)
    keys = (depth * n + nodes).sort().values
    up = (depth - 1).clamp_min(0) * n
    last_above = keys[(torch.searchsorted(keys, up + nodes) - 1).clamp_min(0)]
    bad = (parent >= 0) & (last_above != up + parent)
    bad[1:] |= depth[1:] > depth[:-1] + 1
    if (i := _first(bad)) is not None:
        raise ValueError(f"nodes are not in DFS pre-order: the parent of node {i} (node {int(parent[i])}) is not "
                         f"an ancestor of node {i - 1} or node {i - 1} itself, so subtrees are not contiguous")


def _layout(mat: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack distinct sequences (rows of ``mat``, padded) given in a trie order (sequences that share
    a prefix are adjacent, a prefix before its extensions): each emits the depths its predecessor
    does not share. Returns (packed row of every (sequence, depth), meaningful below ``lens``;
    depth shared with the predecessor; first row each sequence emits)."""
    k, width = mat.shape
    shared = torch.zeros(k, dtype=_I64)
    if k > 1:
        shared[1:] = (mat[1:] != mat[:-1]).to(torch.uint8).argmax(1)  # first differing depth
    emitted = lens - shared
    start = emitted.cumsum(0) - emitted
    depth = torch.arange(width)
    # (k, d) lies in the rows emitted by the last k' <= k with shared[k'] <= d (transposed: faster cummax)
    owner = torch.where(depth[:, None] >= shared[None, :], torch.arange(k)[None, :], 0).cummax(1).values
    rows = (torch.take(start - shared, owner) + depth[:, None]).t().contiguous()
    return rows, shared, start


def _pack_sequences(flat: torch.Tensor, lengths: list[int]):
    """The trie of the sequences in ``flat`` (CPU int64, concatenated): (cu_node_lens, node_parent,
    sequence_nodes, tokens, sequence_index, position_ids), all CPU int64."""
    s, width = len(lengths), max(lengths)
    lens = torch.tensor(lengths, dtype=_I64)
    depth = torch.arange(width)
    valid = depth[None, :] < lens[:, None]
    low = int(flat.min())
    if low == torch.iinfo(_I64).min:
        raise ValueError(f"token id {low} is reserved (it pads sequences)")
    padded = torch.full((s, width), low - 1, dtype=_I64)  # pad sorts a prefix before its extensions
    padded.masked_scatter_(valid, flat)
    # pass 1: distinct sequences in token order; the first appearance of every prefix (row)
    uniq, inverse = torch.unique(padded, dim=0, return_inverse=True)
    k = uniq.shape[0]
    ulens = torch.zeros(k, dtype=_I64).scatter_(0, inverse, lens)
    first = torch.full((k,), s, dtype=_I64).scatter_reduce_(0, inverse, torch.arange(s), reduce="amin")
    uvalid = depth[None, :] < ulens[:, None]
    rows, shared, start = _layout(uniq, ulens)
    total = int(ulens[-1] - shared[-1] + start[-1])
    rows = torch.where(uvalid, rows, total)  # past the end: a scratch row
    seen = torch.full((total + 1,), s, dtype=_I64)
    seen.scatter_reduce_(0, rows.flatten(), first.repeat_interleave(width), reduce="amin")
    # pass 2: sort by first appearance of each prefix (pad -1: a prefix before its extensions)
    _, rank = torch.unique(torch.where(uvalid, torch.take(seen, rows), -1), dim=0, return_inverse=True)
    order = torch.empty_like(rank).scatter_(0, rank, torch.arange(k))
    uniq, ulens, uvalid = uniq.index_select(0, order), ulens[order], uvalid.index_select(0, order)
    rows, shared, start = _layout(uniq, ulens)
    rows = torch.where(uvalid, rows, total)

    def scatter(values, fill):  # packed (total,) from per-(sequence, depth) values
        out = torch.full((total + 1,), fill, dtype=_I64)
        return out.scatter_(0, rows.flatten(), values.flatten())[:total]

    tokens = scatter(uniq, 0)
    position_ids = scatter(depth.expand(k, width), 0)
    prev_row = scatter(torch.cat([torch.full((k, 1), -1), rows[:, :-1]], 1), -1)  # one level up, same path
    # a node starts where a sequence's own rows start, and where a later sequence branches off
    node_start = torch.zeros(total, dtype=torch.bool)
    node_start[start] = True
    branch = torch.nonzero(shared[1:] < ulens[:-1]).flatten()
    node_start[rows[branch, shared[branch + 1]]] = True
    row_node = node_start.cumsum(0) - 1
    starts = node_start.nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([total])])
    up = prev_row[starts]
    parent = torch.where(up >= 0, row_node[up.clamp_min(0)], -1)
    seq_rows = rows.index_select(0, rank[inverse])  # (s, width): the rows of every input sequence
    sequence_index = seq_rows.masked_select(valid)
    sequence_nodes = row_node[seq_rows[torch.arange(s), lens - 1]]
    return cu, parent, sequence_nodes, tokens, sequence_index, position_ids


def _as_flat_sequences(sequences) -> tuple[torch.Tensor, list[int]]:
    """Concatenated token ids (CPU int64) and host lengths of ``sequences``."""
    if isinstance(sequences, (str, bytes, torch.Tensor)) or not isinstance(sequences, Sequence):
        raise TypeError(f"sequences must be a list of token lists or 1-D tensors, got {type(sequences).__name__}")
    if len(sequences) == 0:
        raise ValueError("sequences is empty; a Tree needs at least one sequence")
    parts = []
    for i, seq in enumerate(sequences):
        if isinstance(seq, torch.Tensor):
            if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
                raise TypeError(f"sequences[{i}] must hold integer token ids, got dtype {seq.dtype}")
            if seq.dim() != 1:
                raise ValueError(f"sequences[{i}] must be 1-D, got shape {tuple(seq.shape)}")
            t = seq.to("cpu", _I64)
        else:
            try:  # array('q') converts a list of ints ~10x faster than torch.tensor
                t = torch.frombuffer(array.array("q", seq), dtype=_I64) if len(seq) else torch.zeros(0, dtype=_I64)
            except (TypeError, OverflowError) as err:
                raise TypeError(f"sequences[{i}] must be a list of int token ids ({err})") from None
        if t.numel() == 0:
            raise ValueError(f"sequences[{i}] is empty; every sequence needs at least one token")
        parts.append(t)
    return torch.cat(parts), [p.numel() for p in parts]


def _normalize_device(device) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(eq=False)
class Tree:
    """A trie of sequences packed in DFS pre-order; see the module docstring."""

    tokens: torch.Tensor | None  # int64 (total,), or None when built from nodes without tokens
    position_ids: torch.Tensor  # int64 (total,): depth of each row on its paths
    cu_node_lens: torch.Tensor  # int32 (num_nodes + 1,)
    node_parent: torch.Tensor  # int32 (num_nodes,), -1 for roots, parent < child
    node_last_desc: torch.Tensor  # int32 (num_nodes,): subtree of a = nodes a .. node_last_desc[a]
    sequence_nodes: torch.Tensor  # int64 (num_sequences,): last node of each sequence
    sequence_index: torch.Tensor  # int64: packed rows of every sequence, concatenated in order
    unpacked: Varlen  # the layout of sequence_index (one entry per sequence)
    num_nodes: int
    num_sequences: int
    total: int  # packed rows
    sequence_lengths: list[int]
    max_depth: int  # longest sequence
    # when every node is a root (no sharing), the same batch as plain causal varlen: one sequence per node
    varlen_equivalent: Varlen | None = None
    _on_device: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        mark_dynamic(self.cu_node_lens, self.node_last_desc)  # the first compiled graph serves every tree

    @property
    def device(self) -> torch.device:
        return self.cu_node_lens.device

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_sequences(cls, sequences, *, device=None) -> Tree:
        """Pack ``sequences`` (lists of ints or 1-D integer tensors) as a trie: shared prefixes are
        stored once, identical sequences map to the same rows, and a sequence that ends inside a run
        of another ends a node there. Built on the host (two lexicographic sorts of the padded
        sequences, no per-token Python), then moved to ``device`` (default: CPU)."""
        flat, lengths = _as_flat_sequences(sequences)
        cu, parent, seq_nodes, tokens, seq_index, pos = _pack_sequences(flat, lengths)
        return cls._build(cu, parent, seq_nodes, tokens, device, sequence_index=seq_index, position_ids=pos)

    @classmethod
    def from_nodes(cls, cu_node_lens, node_parent, *, sequence_nodes=None, tokens=None, device=None) -> Tree:
        """Wrap Megatron-style node metadata: ``cu_node_lens`` (N + 1, from 0, every node non-empty),
        ``node_parent`` (N, -1 for roots, nodes in DFS pre-order). ``sequence_nodes`` is the last
        node of each sequence (default: every leaf, in node order); ``tokens`` (total,) is optional.
        Validated once here (one copy to the host when the inputs live on a GPU)."""
        if device is None:
            device = cu_node_lens.device if isinstance(cu_node_lens, torch.Tensor) else None
        cu = _index_tensor("cu_node_lens", cu_node_lens)
        parent = _index_tensor("node_parent", node_parent)
        _check_nodes(cu, parent)
        n, total = parent.numel(), int(cu[-1])
        if sequence_nodes is None:
            is_leaf = torch.ones(n, dtype=torch.bool)
            is_leaf[parent[parent >= 0]] = False
            sequence_nodes = is_leaf.nonzero().flatten()
        seq_nodes = _index_tensor("sequence_nodes", sequence_nodes)
        if (i := _first((seq_nodes < 0) | (seq_nodes >= n))) is not None:
            raise ValueError(f"sequence_nodes[{i}] = {int(seq_nodes[i])} is out of range [0, {n})")
        if tokens is not None:
            tokens = _index_tensor("tokens", tokens)
            if tokens.numel() != total:
                raise ValueError(f"tokens has {tokens.numel()} entries but the nodes hold {total} tokens")
        return cls._build(cu, parent, seq_nodes, tokens, device)

    @classmethod
    def _build(cls, cu, parent, seq_nodes, tokens, device, sequence_index=None, position_ids=None) -> Tree:
        """Derived fields from valid CPU int64 node arrays, then everything moved to ``device``."""
        device = _normalize_device(device)
        n, total = parent.numel(), int(cu[-1])
        nodes = torch.arange(n)
        lens = cu.diff()
        last = _last_descendant(parent)
        # depth of each node's first token: lengths of its proper ancestors (+ at a + 1, - after a's subtree)
        delta = torch.zeros(n + 1, dtype=_I64).index_add_(0, nodes + 1, lens).index_add_(0, last + 1, -lens)
        node_depth = delta.cumsum(0)[:n]
        seq_lens = node_depth[seq_nodes] + lens[seq_nodes]
        if position_ids is None:
            row_node = torch.repeat_interleave(nodes, lens, output_size=total)
            position_ids = node_depth[row_node] + torch.arange(total) - cu[row_node]
        if sequence_index is None:
            sequence_index = _paths(position_ids, cu[seq_nodes + 1] - 1, seq_lens)
        lengths = seq_lens.tolist()

        def mv(x, dtype):
            return None if x is None else x.to(device=device, dtype=dtype)

        return cls(
            tokens=mv(tokens, _I64),
            position_ids=mv(position_ids, _I64),
            cu_node_lens=mv(cu, torch.int32),
            node_parent=mv(parent, torch.int32),
            node_last_desc=mv(last, torch.int32),
            sequence_nodes=mv(seq_nodes, _I64),
            sequence_index=mv(sequence_index, _I64),
            unpacked=Varlen.from_lengths(lengths, device=device),
            num_nodes=n,
            num_sequences=len(lengths),
            total=total,
            sequence_lengths=lengths,
            max_depth=max(lengths, default=0),
            varlen_equivalent=Varlen.from_lengths(lens.tolist(), device=device) if bool((parent < 0).all()) else None,
        )

    # ---------------------------------------------------------------- derived, cached per batch
    def to(self, device) -> Tree:
        """This tree with its tensors on ``device`` (self if already there; the copy is made once
        and kept, with an empty cache of its own)."""
        device = _normalize_device(device)
        if self.device == device:
            return self
        key = str(device)
        if key not in self._on_device:
            moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor)}
            self._on_device[key] = dataclasses.replace(
                self, **moved, unpacked=self.unpacked.to(device), sequence_lengths=list(self.sequence_lengths),
                varlen_equivalent=None if self.varlen_equivalent is None else self.varlen_equivalent.to(device),
                _on_device={}, _cache={})
        return self._on_device[key]

    def cached(self, key, build):
        """Per-batch metadata (row maps, kernel tables...) built once and reused by every layer; not
        cached while torch.compile traces (`Varlen.cached` says why)."""
        if torch.compiler.is_compiling():
            return build()
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def row_node(self) -> torch.Tensor:
        """int32 (total,): the node of every packed row."""
        def build():  # over N + 1 entries (`lengths_then_zero`); the last, empty node has no row
            nodes = torch.arange(self.cu_node_lens.shape[0], dtype=torch.int32, device=self.device)
            return torch.repeat_interleave(nodes, lengths_then_zero(self.cu_node_lens), output_size=self.total)

        return self.cached("row_node", build)

    def row_subtree_end(self) -> torch.Tensor:
        """int32 (total,): for row ``s`` of node ``a``, the first row after ``a``'s subtree; key ``s``
        is visible exactly to the queries ``s <= t < row_subtree_end()[s]``."""
        def build():
            return self.cu_node_lens[self.node_last_desc[self.row_node().long()].long() + 1]

        return self.cached("row_subtree_end", build)

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``x`` (``total`` packed rows along ``dim``) laid out per sequence like ``unpacked``;
        gradients of rows shared by several sequences are summed."""
        if x.shape[dim] != self.total:
            raise ValueError(f"x has {x.shape[dim]} rows along dim {dim} but the tree packs {self.total}")
        return x.index_select(dim, self.to(x.device).sequence_index)

    def __repr__(self) -> str:
        return (f"Tree(num_sequences={self.num_sequences}, num_nodes={self.num_nodes}, total={self.total}, "
                f"unpacked={self.unpacked.total_q}, max_depth={self.max_depth}, device={self.device})")


def _paths(position_ids: torch.Tensor, end_rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Rows of the paths ending at ``end_rows``, concatenated. In pre-order, the row at depth ``d``
    on the path to row ``r`` is the last row ``<= r`` at depth ``d``."""
    total = position_ids.numel()
    keys = (position_ids * total + torch.arange(total)).sort().values
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    depth = torch.arange(seq.numel()) - (lengths.cumsum(0) - lengths)[seq]
    found = keys[torch.searchsorted(keys, depth * total + end_rows[seq], right=True) - 1]
    return found - depth * total
