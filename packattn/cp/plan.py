"""`CPPlan`: which rows of a packed batch each context-parallel rank holds.

Built once per batch from the GLOBAL self-attention `Varlen` (host data only, so every rank
builds the same plan without communicating). Each document is cut into pieces:

* ``balance="zigzag"``: ``2 * world`` pieces, sizes as even as possible; rank ``r`` holds pieces
  ``r`` and ``2 * world - 1 - r`` of every document, so under a causal mask every rank gets about
  the same work. A document shorter than ``2 * world`` leaves some pieces empty; no row is dropped.
* ``balance="contiguous"``: ``world`` pieces, rank ``r`` holds piece ``r``.
* ``balance="documents"``: documents stay whole where that balances (see `document_ranks`): each
  goes to one rank and needs no communication; only documents longer than half a rank's share of
  tokens are cut zigzag. Ranks then hold about (not exactly) the same number of tokens.

Rows of the physical layout that belong to no document (padding between sequences) are dealt to
ranks too, in contiguous runs, so `CPPlan.unshard` gives back every row; their outputs are zeros.

A rank's local rows are its global rows in ascending order (for zigzag: piece ``r`` of each
document, then piece ``2 * world - 1 - r``, document after document).

This module holds the plan's data and the layout helpers the executors share; it imports no
executor. ``packattn.cp.plan()`` (in `packattn.cp.api`) checks the arguments and picks the builder:
`build_varlen_plan` here, `packattn.cp.tree.build_tree_plan`, `packattn.cp.hybrid.build_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from packattn.cp.comm import gather_rows
from packattn.varlen import Varlen

STRATEGIES = ("allgather", "p2p", "a2a", "a2a+p2p")
ALIASES = {"ring": "p2p", "alltoall": "a2a", "ulysses": "a2a", "hybrid": "a2a+p2p"}
BALANCES = ("zigzag", "contiguous", "documents")


def segments(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows laid out as consecutive segments of ``lengths``: each row's segment and offset in it."""
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return seg, torch.arange(seg.numel()) - starts[seg]


def piece_bounds(lengths: torch.Tensor, num_pieces: int, piece) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[start, end)`` of piece ``piece`` (int or tensor) when each length is cut into
    ``num_pieces`` pieces as even as possible (the first ``length % num_pieces`` get one more row)."""
    base, extra = lengths // num_pieces, lengths % num_pieces
    piece = torch.as_tensor(piece, dtype=lengths.dtype, device=lengths.device)
    start = piece * base + torch.minimum(piece, extra)
    end = (piece + 1) * base + torch.minimum(piece + 1, extra)
    return start, end


def _piece_of_position(pos: torch.Tensor, lengths: torch.Tensor, num_pieces: int) -> torch.Tensor:
    """Inverse of `piece_bounds`: the piece holding position ``pos`` of a document of ``lengths``."""
    base, extra = lengths // num_pieces, lengths % num_pieces
    boundary = extra * (base + 1)  # rows held by the longer pieces
    in_long = pos // (base + 1)
    in_short = extra + (pos - boundary) // base.clamp_min(1)
    return torch.where(pos < boundary, in_long, in_short)


def zigzag_rank(pos: torch.Tensor, lengths: torch.Tensor, world: int) -> torch.Tensor:
    """The rank holding position ``pos`` of a document of ``lengths`` cut zigzag: ``2 * world``
    pieces as even as possible (`piece_bounds`), rank ``r`` holding pieces ``r`` and ``2 * world - 1 - r``."""
    piece = _piece_of_position(pos, lengths, 2 * world)
    return torch.where(piece < world, piece, 2 * world - 1 - piece)


@dataclass(eq=False)
class CPPlan:
    """Row ownership for one batch on one rank; see the module docstring.

    ``local_rows``: int64 global rows this rank holds, ascending. ``position_ids``: each local
    row's position in its document (0 for padding rows). ``pieces``: this rank's non-empty
    pieces as an int64 ``(P, 5)`` tensor of ``(document, start, end, doc_length, doc_first_row)``.
    """

    descriptor: Varlen
    group: object
    world: int
    rank: int
    strategy: str
    balance: str
    owner: torch.Tensor  # (total,) rank holding each global row
    flat_pos: torch.Tensor  # (total,) row in the all-gathered (world * max_local) layout
    max_local: int
    local_rows: torch.Tensor
    position_ids: torch.Tensor
    pieces: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False)
    # strategy "a2a+p2p" only (see packattn.cp.hybrid): the 2-D DeviceMesh, the plan of the outer
    # mesh dimension (the rows this rank's inner group holds, run by the outer executor), and the
    # inner dimension's group, size and this rank's index in it (all-to-all over heads)
    mesh: object = field(default=None, repr=False)
    outer: CPPlan | None = field(default=None, repr=False)
    inner_group: object = field(default=None, repr=False)
    inner_world: int = 1
    inner_rank: int = 0
    # a Tree descriptor only (see packattn.cp.tree): the sub-forest of this rank's whole root subtrees
    # (None when the rank holds no root, or holds part of a root cut across ranks)
    local_tree: object = field(default=None, repr=False)

    @property
    def is_tree(self) -> bool:
        return type(self.descriptor).__name__ == "Tree"

    @property
    def num_local(self) -> int:
        return int(self.local_rows.numel())

    @property
    def total(self) -> int:
        return int(self.owner.numel())

    def cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global ``(total, ...)`` tensor (autograd flows through)."""
        if x.shape[0] != self.total:
            raise ValueError(f"shard expects {self.total} global rows, got shape {tuple(x.shape)}")
        return x.index_select(0, self.local_rows.to(x.device))

    def unshard(self, x_local: torch.Tensor) -> torch.Tensor:
        """All ranks' local rows back in the global ``(total, ...)`` layout, on every rank.

        Autograd-aware: the backward sums the global gradients of all ranks and hands each rank
        its rows (reduce-scatter), as ``torch.distributed.nn.all_gather`` does.
        """
        if x_local.shape[0] != self.num_local:
            raise ValueError(f"unshard expects {self.num_local} local rows, got shape {tuple(x_local.shape)}")
        flat = gather_rows(x_local, self.max_local, self.world, self.group)
        return flat.index_select(0, self.flat_pos.to(flat.device))

    def __repr__(self) -> str:
        return (f"CPPlan(strategy={self.strategy}, balance={self.balance}, rank={self.rank}/{self.world}, "
                f"local_rows={self.num_local}, pieces={self.pieces.shape[0]}, total={self.total})")


def build_varlen_plan(descriptor: Varlen, group, world: int, rank: int, strategy: str, balance: str) -> CPPlan:
    """The `CPPlan` of a self-attention `Varlen` with host lengths for ``rank`` of ``world`` (``packattn.cp.plan``
    checked the arguments; strategy "a2a+p2p" builds its outer plan with this too)."""
    lengths = torch.tensor(descriptor.lengths_q, dtype=torch.int64)
    starts = torch.tensor(descriptor.host_starts_q, dtype=torch.int64)
    seq, pos = (t.cpu() for t in descriptor.row_map_q())
    owner = _row_owner(seq, pos, lengths, world, balance)
    flat_pos, max_local, local_rows = rows_layout(owner, world, rank)
    position_ids = pos[local_rows]
    pieces = _pieces(seq[local_rows], pos[local_rows], local_rows, lengths, starts)
    return CPPlan(descriptor, group, world, rank, strategy, balance, owner, flat_pos, max_local,
                  local_rows, position_ids, pieces)


def world_and_rank(group, world, rank):
    """``(world, rank, group)``: the 1-D group's (a 1-D DeviceMesh gives its group) unless overridden."""
    if type(group).__name__ == "DeviceMesh" and group.ndim == 1:
        group = group.get_group()
    if world is None:
        world = dist.get_world_size(group)
    if rank is None:
        rank = dist.get_rank(group)
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"bad world/rank: {world}/{rank}")
    return world, rank, group


def rows_layout(owner: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """From the owner of every global row: each row's position in the padded all-gather layout
    (``world * max_local`` rows, rank-major), ``max_local``, and this rank's global rows (ascending)."""
    total = owner.numel()
    order = torch.sort(owner, stable=True).indices
    counts = torch.bincount(owner, minlength=world)
    offsets = torch.cumsum(counts, 0) - counts
    local_pos = torch.empty_like(owner)
    local_pos[order] = torch.arange(total) - offsets[owner[order]]
    max_local = int(counts.max()) if total else 0
    return owner * max_local + local_pos, max_local, order[offsets[rank]: offsets[rank] + counts[rank]]


def gathered_layout(owner: torch.Tensor, shared: torch.Tensor, world: int, rank: int):
    """The all-gather of a subset of the rows (``shared``: bool per global row), each owner
    contributing its shared rows in row order (`rows_layout` of those rows): every global row's
    position in the gathered layout (-1 for rows not shared), the rows per rank, and this rank's
    shared global rows (ascending)."""
    shared_rows = shared.nonzero().flatten()
    positions, per_rank, mine = rows_layout(owner[shared_rows], world, rank)
    gathered_pos = torch.full((owner.numel(),), -1, dtype=torch.int64)
    gathered_pos[shared_rows] = positions
    return gathered_pos, per_rank, shared_rows[mine]


def document_ranks(lengths: torch.Tensor, world: int, work: torch.Tensor | None = None,
                   cut_long: bool = True) -> torch.Tensor:
    """``balance="documents"``: the rank holding each whole document, or -1 for a document cut
    zigzag over all ranks.

    A document longer than half of a rank's fair share of tokens is cut (zigzag balances its causal
    work exactly; ``cut_long=False`` keeps it whole too). The others stay whole: longest first, each goes to the rank whose larger relative
    load -- tokens over the fair share of tokens, work (default: the causal ``L (L + 1) / 2``) over
    the fair share of work -- ends up smallest (ties: the lowest rank). Whole documents need no
    communication."""
    lens = [int(x) for x in lengths.tolist()]
    work = [x * (x + 1) // 2 for x in lens] if work is None else [int(x) for x in work.tolist()]
    fair_tokens = max(sum(lens) / world, 1.0)
    fair_work = max(sum(work) / world, 1.0)
    ranks = [-1] * len(lens)
    cut = [i for i, x in enumerate(lens) if x > fair_tokens / 2] if cut_long else []
    tokens = [sum(lens[i] for i in cut) / world] * world
    loads = [sum(work[i] for i in cut) / world] * world
    for i in sorted(set(range(len(lens))) - set(cut), key=lambda i: (-lens[i], i)):
        best = min(range(world), key=lambda r: (max((tokens[r] + lens[i]) / fair_tokens,
                                                    (loads[r] + work[i]) / fair_work), r))
        ranks[i] = best
        tokens[best] += lens[i]
        loads[best] += work[i]
    return torch.tensor(ranks, dtype=torch.int64)


def _row_owner(seq: torch.Tensor, pos: torch.Tensor, lengths: torch.Tensor, world: int, balance: str) -> torch.Tensor:
    """Rank of every global row (``seq``/``pos``: each row's document and position, seq -1 for padding).

    Document rows follow ``balance``; padding rows between sequences are dealt out in contiguous runs."""
    is_doc = seq >= 0
    doc = seq.clamp_min(0)
    doc_len = lengths[doc] if lengths.numel() else torch.zeros_like(seq)
    owner = _piece_of_position(pos, doc_len, world) if balance == "contiguous" else zigzag_rank(pos, doc_len, world)
    if balance == "documents" and lengths.numel():
        whole = document_ranks(lengths, world)[doc]
        owner = torch.where(whole >= 0, whole, owner)
    pad_rows = (~is_doc).nonzero().flatten()
    owner = torch.where(is_doc, owner, torch.zeros_like(owner))
    owner[pad_rows] = torch.arange(pad_rows.numel()) * world // max(pad_rows.numel(), 1)
    return owner


def _pieces(seq: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
            starts: torch.Tensor) -> torch.Tensor:
    """``(P, 5)`` pieces ``(document, start, end, doc_length, doc_first_row)``: the maximal runs of
    consecutive positions of one document among a rank's ``rows`` (ascending; padding rows skipped)."""
    keep = seq >= 0
    seq, pos, rows = seq[keep], pos[keep], rows[keep]
    if seq.numel() == 0:
        return torch.zeros(0, 5, dtype=torch.int64)
    new = torch.ones_like(seq, dtype=torch.bool)
    new[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + 1)
    first = new.nonzero().flatten()
    last = torch.cat([first[1:], first.new_tensor([seq.numel()])]) - 1
    doc = seq[first]
    return torch.stack([doc, pos[first], pos[last] + 1, lengths[doc], starts[doc]], dim=1)
