"""Host-side layout of the P2P ring (`packattn.cp.ring`): which local rows meet which K/V rows in
each ring step, as `Part` s (one `packattn.attention` call each: "full", "self" or "edge"), the
messages that travel, and the index maps; built once per plan and mask (`build_layout`) and cached
on the plan. The construction (pieces, trimming to rectangles, dummy query rows, chunks, skipped
pairs) is described in `packattn.cp.ring`'s module docstring."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from packattn import mask as masks
from packattn.cp.plan import CPPlan, build_varlen_plan
from packattn.cp.plan import segments as _segment_offsets
from packattn.mask import Mask
from packattn.varlen import Varlen

FULL, EDGE = Mask(), Mask.make(False, (0, -1))  # masks of the "full" and "edge" parts (module docstring of ring)


@dataclasses.dataclass
class Rows:
    """The rows of a part's query or key buffer (on the device): ``index``, the row of the source
    tensor behind each buffer row (for queries, ``num_local`` marks a dummy zero row), and
    ``passes``, how to merge or add results back into those rows in a fixed order:
    ``(positions in the buffer, their rows)`` per pass, no row twice in a pass, dummy rows left
    out; ``()`` when ``index`` itself repeats no row and has no dummy. ``span``: ``(start, count)``
    when ``index`` is the run ``start, start + 1, ...`` (no dummy, no repeat): the buffer is then a
    view of the source (no copy) and results go back in place. ``first``: per pass, whether it is
    the first to write its rows in the forward's order (`mark_first_writes`; a plain copy then, no
    merge)."""

    index: torch.Tensor
    passes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    dummies: bool  # some buffer row is a dummy (reads the zero row that `_with_zero_row` appends)
    span: tuple[int, int] | None = None
    first: tuple[bool, ...] = ()
    host_rows: tuple[torch.Tensor, ...] = ()  # the rows of `groups` on the host (layout building: no sync)

    @classmethod
    def build(cls, index: torch.Tensor, device, dummy: int | None = None) -> Rows:
        """From a host ``index`` whose value ``dummy`` (if any) marks dummy rows."""
        real = index != dummy if dummy is not None else torch.ones_like(index, dtype=torch.bool)
        positions = real.nonzero().flatten()
        groups = _duplicate_free_passes(index[positions])
        dummies = not bool(real.all())
        if not groups and dummies:
            groups = (torch.arange(positions.numel()),)
        host_rows = tuple(index[positions[g]] for g in groups) or (index,)
        passes = tuple((positions[g].to(device), rows.to(device)) for g, rows in zip(groups, host_rows))
        span = None
        if not passes and index.numel() and torch.equal(index, torch.arange(int(index[0]), int(index[0]) + index.numel())):
            span = (int(index[0]), index.numel())
        return cls(index.to(device), passes, dummies, span, (False,) * len(host_rows), host_rows)

    def groups(self):
        """``(positions in the buffer, or None for all of it; rows)`` per pass."""
        return self.passes or ((None, self.index),)

    def gather(self, x: torch.Tensor | None, dim: int = 0) -> torch.Tensor | None:
        """The buffer: the rows of ``x`` (along ``dim``) at ``index``; with dummies, ``x`` must end
        with a zero row (`_with_zero_row`). A view of ``x`` for a span."""
        if x is None:
            return None
        if self.span is not None:
            return x.narrow(dim, *self.span).contiguous()  # a view when dim is 0
        return x.index_select(dim, self.index)

    def add_to(self, acc: torch.Tensor, values: torch.Tensor) -> None:
        """``acc[index] += values`` over the real rows, pass by pass (a fixed order)."""
        if self.span is not None:
            acc.narrow(0, *self.span).add_(values)
            return
        for positions, rows in self.groups():
            acc.index_add_(0, rows, _take(values, positions))


def _take(x: torch.Tensor, positions: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return x if positions is None else x.index_select(dim, positions)


def _with_zero_row(x: torch.Tensor | None, dim: int = 0) -> torch.Tensor | None:
    """``x`` with a zero row appended along ``dim``: what dummy query rows read."""
    if x is None:
        return None
    return torch.cat([x, x.new_zeros(*x.shape[:dim], 1, *x.shape[dim + 1:])], dim)


@dataclasses.dataclass
class Part:
    """One `packattn.attention` call of a ring step: local sequences under one mask."""

    seqs: Varlen
    mask: Mask
    q: Rows  # local row of each query of the part (dummies: num_local)
    kv: Rows  # row of each key: local row (step 0) or row of the source's message


@dataclasses.dataclass
class Step:
    """One ring step of one rank: its parts against the K/V of ``src`` (-1: its own, step 0)."""

    src: int
    parts: tuple[Part, ...]  # () when nothing is visible at this step


@dataclasses.dataclass
class RingLayout:
    """Index maps of one plan for one mask on one device (built once, reused by every layer)."""

    steps: list[Step]
    send_index: torch.Tensor  # (message_rows,) local row of each message row, num_local for padding
    own_rows: torch.Tensor  # (rows this rank sends,) local rows of the first rows of its message
    message_rows: int  # rows of every message (0: nothing to exchange, no communication at all)
    local_only: bool = False  # one step, over exactly the local rows in order: plain local attention
    dummies: bool = False  # some part has dummy queries: q, dout, out, lse get a zero row once per call


# ------------------------------------------------------------------ host-side layout
def _segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))``."""
    seg, offset = _segment_offsets(lengths)
    return starts[seg] + offset


def _pieces_of(plan: CPPlan, rank: int) -> torch.Tensor:
    if rank == plan.rank:
        return plan.pieces
    return plan.cached(("p2p pieces", rank), lambda: build_varlen_plan(
        plan.descriptor, None, plan.world, rank, plan.strategy, plan.balance).pieces)


def _duplicate_free_passes(index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Positions of ``index`` split into passes (in a fixed order) none of which repeats a value."""
    if index.numel() == 0:
        return ()
    order = torch.sort(index, stable=True).indices
    values = index[order]
    new_run = torch.ones_like(values, dtype=torch.bool)
    new_run[1:] = values[1:] != values[:-1]
    run_start = torch.cummax(torch.where(new_run, torch.arange(values.numel()), 0), 0).values
    occurrence = torch.empty_like(index)
    occurrence[order] = torch.arange(values.numel()) - run_start
    repeats = int(occurrence.max()) + 1
    if repeats == 1:
        return ()  # no repeated value: one pass over everything
    return tuple((occurrence == r).nonzero().flatten() for r in range(repeats))


def _part(mask: Mask, q_index, q_len, kv_index, kv_len, num_local: int, device) -> Part:
    """A `Part` from host index maps (``num_local`` in ``q_index``: a dummy query) and its
    sequences' lengths (``kv_len`` None: self-attention)."""
    seqs = Varlen.from_lengths(q_len.tolist(), None if kv_len is None else kv_len.tolist(), device=device)
    return Part(seqs, mask, Rows.build(q_index, device, dummy=num_local), Rows.build(kv_index, device))


@dataclasses.dataclass
class _Messages:
    """What travels: every rank's message holds its rows of documents held by several ranks."""

    offset: list[torch.Tensor]  # per rank, per piece: the piece's first row in that rank's message
    length: list[torch.Tensor]  # per rank, per piece: its rows in the message (0: document not shared)
    rows: int  # rows of every message (the largest rank's; 0: nothing travels, no communication)


def _messages(plan: CPPlan, pieces: list[torch.Tensor]) -> _Messages:
    holders = torch.zeros(len(plan.descriptor.lengths_q), dtype=torch.int64)
    for p in pieces:
        holders[torch.unique(p[:, 0])] += 1
    shared_doc = holders > 1  # documents whose rows must travel
    offset, length = [], []
    for p in pieces:
        n = (p[:, 2] - p[:, 1]) * shared_doc[p[:, 0]]
        offset.append(torch.cumsum(n, 0) - n)
        length.append(n)
    rows = max(int(n.sum()) for n in length) if plan.world > 1 else 0
    return _Messages(offset, length, rows)


def mark_first_writes(steps: list[Step], num_local: int) -> None:
    """Set every query `Rows`' ``first``: whether a pass is the first, in the forward's order
    (steps, parts, passes), to write any of its rows; such a pass writes instead of merging."""
    written = torch.zeros(num_local, dtype=torch.bool)
    for step in steps:
        for part in step.parts:
            first = []
            for rows in part.q.host_rows:
                first.append(not bool(written[rows].any()))
                written[rows] = True
            part.q.first = tuple(first)


def build_layout(plan: CPPlan, mask: Mask, device) -> RingLayout:
    """The `RingLayout` of ``plan`` for ``mask`` (bottom-right: in global self-attention both
    alignments agree)."""
    pieces = [_pieces_of(plan, r) for r in range(plan.world)]
    messages = _messages(plan, pieces)
    local_start = torch.searchsorted(plan.local_rows, plan.pieces[:, 4] + plan.pieces[:, 1])
    own_rows = _segments(local_start, messages.length[plan.rank])
    pad = torch.full((messages.rows - own_rows.numel(),), plan.num_local, dtype=torch.int64)
    send_index = torch.cat([own_rows, pad])
    if (mask.window is None and mask.chunk_size is None) or not messages.rows:
        steps = _run_steps(plan, mask, pieces, local_start, messages, device)
    else:
        steps = _pair_steps(plan, mask, pieces, local_start, messages, device)
    mark_first_writes(steps, plan.num_local)
    parts = steps[0].parts
    everything = (0, plan.num_local)  # the span of all local rows in order (a span has no dummy, no repeat)
    local_only = len(steps) == 1 and len(parts) == 1 and parts[0].q.span == everything == parts[0].kv.span
    dummies = any(part.q.dummies for step in steps for part in step.parts)
    return RingLayout(steps, send_index.to(device), own_rows.to(device), messages.rows, local_only, dummies)


def _run_steps(plan: CPPlan, mask: Mask, pieces, local_start, messages: _Messages, device) -> list[Step]:
    """Steps of a causal or full mask, whole pieces and runs of them (module docstring); also of
    any mask when nothing travels (then step 0 is all, one whole piece per document)."""
    rank, world, n = plan.rank, plan.world, plan.num_local
    doc, a, b, length, first = (c.contiguous() for c in plan.pieces.unbind(1))
    # step 0: one sequence per document, the rank's pieces of it (contiguous local rows)
    docs, counts = torch.unique_consecutive(doc, return_counts=True)
    first_piece = torch.cumsum(counts, 0) - counts
    doc_rows = torch.zeros(docs.numel(), dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(docs.numel()), counts), b - a)
    own = _segments(local_start[first_piece], doc_rows)
    steps = [Step(-1, (_part(mask, own, doc_rows, own, None, n, device),) if docs.numel() else ())]

    q_first, doc_end = first + a, first + length
    for s in range(1, world if messages.rows else 1):
        src = (rank - s) % world
        sp = pieces[src]
        s_first, s_last = sp[:, 4] + sp[:, 1], sp[:, 4] + sp[:, 2]
        lo = torch.searchsorted(s_first, first)  # the source's first piece of each query piece's document
        if mask.causal:  # its pieces ending at or before the query piece
            hi = torch.searchsorted(s_last, q_first, right=True)
        else:  # all its pieces of the document
            hi = torch.searchsorted(s_first, doc_end)
        hi = torch.maximum(hi, lo)
        seen = hi > lo
        # query pieces (same document, consecutive) that see the same run of source pieces: one sequence
        key = (lo * (sp.shape[0] + 1) + hi)[seen]
        _, group_size = torch.unique_consecutive(key, return_counts=True)
        group_first = torch.cumsum(group_size, 0) - group_size
        group = torch.repeat_interleave(torch.arange(group_size.numel()), group_size)
        q_len = torch.zeros(group_size.numel(), dtype=torch.int64).index_add_(0, group, (b - a)[seen])
        q_start = local_start[seen][group_first]
        g_lo, g_hi = lo[seen][group_first], hi[seen][group_first]
        kv_start = messages.offset[src][g_lo] if g_lo.numel() else g_lo
        kv_len = (messages.offset[src] + messages.length[src])[g_hi - 1] - kv_start if g_lo.numel() else g_lo
        parts = ()
        if q_len.numel():
            parts = (_part(FULL, _segments(q_start, q_len), q_len, _segments(kv_start, kv_len), kv_len, n, device),)
        steps.append(Step(src, parts))
    return steps


class _Spans(NamedTuple):
    """Pieces cut at chunk boundaries: positions ``[start, end)`` of a document of ``length``;
    ``base``: the row of position ``p`` is ``base + p`` (a local row, or a row of a message);
    ``group``: the global row of the chunk's first position (of the document's, without chunks).
    Only spans of one group see each other."""

    start: torch.Tensor
    end: torch.Tensor
    length: torch.Tensor
    base: torch.Tensor
    group: torch.Tensor


def _spans(pieces: torch.Tensor, first_row: torch.Tensor, chunk_size: int | None) -> _Spans:
    """The spans of ``pieces`` (rows of `CPPlan.pieces`) whose first positions are at rows ``first_row``."""
    _, a, b, length, doc_first = (c.contiguous() for c in pieces.unbind(1))
    base = first_row - a
    if chunk_size is None:
        return _Spans(a, b, length, base, doc_first)
    first_chunk = a // chunk_size
    seg, offset = _segment_offsets((b - 1) // chunk_size - first_chunk + 1)
    chunk_start = (first_chunk[seg] + offset) * chunk_size
    return _Spans(torch.maximum(a[seg], chunk_start), torch.minimum(b[seg], chunk_start + chunk_size),
                  length[seg], base[seg], doc_first[seg] + chunk_start)


def _group_pairs(q_group: torch.Tensor, k_group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``(i, j)`` with ``q_group[i] == k_group[j]`` (``k_group`` ascending), ``i``-major."""
    lo = torch.searchsorted(k_group, q_group)
    seg, offset = _segment_offsets(torch.searchsorted(k_group, q_group, right=True) - lo)
    return seg, lo[seg] + offset


def _pair_steps(plan: CPPlan, mask: Mask, pieces, local_start, messages: _Messages, device) -> list[Step]:
    """Steps of a window or chunk mask: pairs of spans (module docstring, "Windows and chunk_size")."""
    n = plan.num_local
    queries = _spans(plan.pieces, local_start, mask.chunk_size)
    steps = [Step(-1, _pair_parts(mask, queries, queries, True, n, device))]
    for s in range(1, plan.world):
        src = (plan.rank - s) % plan.world
        keys = _spans(pieces[src], messages.offset[src], mask.chunk_size)
        steps.append(Step(src, _pair_parts(mask, queries, keys, False, n, device)))
    return steps


def _trim(mask: Mask, a, b, c, e, length):
    """Pairs of query positions ``[a, b)`` and key positions ``[c, e)`` of documents of ``length``
    trimmed to ``[qa, qb) x [ka, kb)``: the keys some query sees and the queries that see some of
    them. Returns ``(qa, qb, ka, kb, seen, full)``: ``seen``, some query sees some key; ``full``,
    every query of the rectangle sees every key of it."""
    lo, hi, _, _ = masks.block_key_range(mask, a, b, length, length)
    ka, kb = torch.maximum(c, lo), torch.minimum(e, hi)
    q_lo, q_hi, _, _ = masks.block_query_range(mask, ka, kb, length, length)
    qa, qb = torch.maximum(a, q_lo), torch.minimum(b, q_hi)
    _, _, full_lo, full_hi = masks.block_key_range(mask, qa, qb, length, length)
    return qa, qb, ka, kb, (ka < kb) & (qa < qb), (full_lo <= ka) & (kb <= full_hi)


def _pair_parts(mask: Mask, queries: _Spans, keys: _Spans, own: bool, num_local: int, device) -> tuple[Part, ...]:
    """The parts of one step: every (query span, key span) pair of one group, trimmed to
    ``[qa, qb) x [ka, kb)`` and put in the "full", "self" or "edge" part, or skipped when nothing
    is visible. ``own``: the keys are the queries' own rows (step 0), where a span with itself is
    self-attention."""
    qi, kj = _group_pairs(queries.group, keys.group)
    q_base, k_base = queries.base[qi], keys.base[kj]
    qa, qb, ka, kb, seen, full = _trim(mask, queries.start[qi], queries.end[qi], keys.start[kj], keys.end[kj],
                                       queries.length[qi])
    partial = seen & ~full
    full = seen & full
    itself = partial & (qi == kj) if own else torch.zeros_like(partial)
    before = partial & ~itself & (kb <= qa)  # keys before the queries (spans never overlap)
    after = partial & ~itself & (ka >= qb)
    if (before.any() and mask.left < 0) or (after.any() and mask.right < 0):  # pragma: no cover
        raise AssertionError("a pair on the side of an unbounded window is fully visible, not an edge")

    columns = (qa, qb, q_base, ka, kb, k_base)
    mirrored = (-qb, -qa, q_base - 1, -kb, -ka, k_base - 1)  # x' = -1 - x: row base + x = (base - 1) - x'

    def select(chosen, cols, sign, reach=None):  # (qa, qb, query end, q_base, ka, kb, k_base, sign)
        qa_, qb_, q_base_, ka_, kb_, k_base_ = (t[chosen] for t in cols)
        q_end = qb_ if reach is None else kb_ + reach  # edge: dummy queries up to kb + window
        return qa_, qb_, q_end, q_base_, ka_, kb_, k_base_, torch.full_like(qa_, sign)

    edge = [torch.cat(t) for t in zip(select(before, columns, 1, mask.left), select(after, mirrored, -1, mask.right))]
    parts = (_sequences(FULL, *select(full, columns, 1), num_local, device),
             _sequences(Mask.make(mask.causal, mask.window), *select(itself, columns, 1), num_local, device),
             _sequences(EDGE, *edge, num_local, device))
    return tuple(p for p in parts if p is not None)


def _sequences(mask: Mask, qa, qb, q_end, q_base, ka, kb, k_base, sign, num_local: int, device) -> Part | None:
    """A part of one local sequence per pair: query positions ``[qa, q_end)`` (``[qb, q_end)``
    dummies) over key positions ``[ka, kb)``, the row of position ``x`` being ``base + sign * x``."""
    if qa.numel() == 0:
        return None
    seg, offset = _segment_offsets(q_end - qa)
    pos = qa[seg] + offset
    q_index = torch.where(pos < qb[seg], q_base[seg] + sign[seg] * pos, torch.full_like(pos, num_local))
    seg, offset = _segment_offsets(kb - ka)
    kv_index = k_base[seg] + sign[seg] * (ka[seg] + offset)
    return _part(mask, q_index, q_end - qa, kv_index, kb - ka, num_local, device)


# ------------------------------------------------------------------ communication
