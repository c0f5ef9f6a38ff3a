"""All-gather K/V context parallelism (the Llama-3 recipe): every rank gathers the whole batch's
K and V, then runs its own queries against the keys they can see.

Local problem. Each non-empty piece ``[a, b)`` of a document of length ``L`` that this rank holds
becomes one local sequence: queries ``[a, e)`` over keys ``[kl, kh)`` of the document, with
``e = kh``. Bottom-right alignment then puts local query ``i`` at local key ``i + (kh - kl) -
(e - a) = (a + i) - kl``: exactly the global position shifted by ``kl``, so causal, windows and
(because ``kl`` is a multiple of ``chunk_size``) chunks see the same keys as in the global batch
(a global self-attention batch has offset 0, so its top-left and bottom-right masks agree).

* ``[kl, kh)`` is the union of the keys the piece's queries see (`mask.block_key_range`), widened
  to ``kh >= b`` and ``kl`` rounded down to a chunk start.
* Masks that look right of the diagonal (non-causal windows, non-causal chunks) need ``kh > b``;
  the extra queries ``[b, e)`` are dummy zero rows whose outputs are dropped (wasted work, no
  effect on values or gradients). A full mask (no rule at all) ignores alignment: queries
  ``[a, b)`` over the whole document, no dummy rows.

Only documents held by more than one rank are communicated: each rank all-gathers its rows of those
documents (one collective for K and V; none at all when every document is whole on one rank, e.g.
with ``balance="documents"``); keys of its own rows are read locally. The key rows of all local
sequences are then copied (with duplicates where ranges overlap) into one contiguous buffer.
Backward: the buffer's gradient flows back through that index to the local rows and to the
gathered tensor, whose gradient is reduce-scattered to the ranks owning the rows.

Overlap (``overlap_groups=G``, `resolve_overlap_groups`). When something is communicated, the
kv heads are split into ``G`` contiguous groups (``min(G, heads_kv)``, as even as possible; a
group's query heads are the GQA query heads of its kv heads) and each group is gathered by its own
collective, so that attention of one group runs while another group's rows travel. One autograd
Function (`_OverlappedGroups`) does it all:

* forward: the all-gathers of every group are issued at once (``async_op=True``); then for each
  group in order: wait for its gather, build its key buffer, run its local attention (when
  gradients are needed, on detached leaves under ``torch.enable_grad()``, keeping that small graph
  for backward). Outputs and lse are concatenated in head order.
* backward: groups in reverse: the group's attention backward (``torch.autograd.grad`` on its
  graph), then its gathered rows' dK/dV reduce-scatter is issued (``async_op=True``) and the next
  group's backward runs while it travels; all are waited for at the end, and each adds its rows
  to the local dK/dV.

What runs concurrently. On GPUs (NCCL) a collective issued with ``async_op=True`` runs on NCCL's
internal stream, after the work already queued on the current stream; ``wait()`` only makes the
current (compute) stream wait for it, without blocking the host. So in forward the gathers of
groups ``g + 1, ...`` run on the NCCL stream while the attention kernels of group ``g`` run on
the compute stream, and only the first group's gather is exposed; in backward the reduce-scatter
of group ``g`` runs while the backward kernels of group ``g - 1`` do, and only the last
reduce-scatter (group 0's) is exposed. On CPU with gloo, the work object's collective runs on the
process group's worker thread while the calling thread computes the next group (overlap needs a
spare core). Each group's collective moves ``1/G`` of the bytes; the price is ``G`` collectives
and ``G`` attention calls with ``heads / G`` heads each. ``G = 1`` is the single collective above.

Results. For a fixed ``G`` every reduction has a fixed order, so two runs are bitwise equal (as
with ``G = 1``). Different ``G`` agree up to float rounding, not bitwise: the key buffers and the
local dK/dV sums are the same operations per column, but a backend's kernels for a subset of the
heads may round differently (the reference backend on CPU does, in the last bit: its einsums and
chunking depend on the head count), and a collective may sum the ranks' contributions in another
order for another buffer size. Every rank must use the same ``G`` (the collectives must match).
Memory: as with ``G = 1``, except that the per-group outputs and lse are kept for backward (the
Triton backends save them anyway; the reference backend recomputes them, so there they are extra).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.autograd.function import once_differentiable

import packattn
from packattn import env
from packattn import mask as masks
from packattn.cp.comm import (
    Pending,
    gather_rows,
    start_gather_rows,
    start_reduce_scatter_rows,
)
from packattn.cp.executor import Call
from packattn.cp.plan import CPPlan, gathered_layout, segments
from packattn.mask import Mask
from packattn.varlen import Varlen

# kv-head groups when neither the call nor the environment says: one collective, no overlap
# (`packattn bench --cp --overlap-groups 1 2 4` compares)
DEFAULT_OVERLAP_GROUPS = 1
ENV_OVERLAP_GROUPS = "PACKATTN_CP_OVERLAP_GROUPS"  # overrides DEFAULT_OVERLAP_GROUPS


@dataclasses.dataclass
class LocalLayout:
    """Index maps of one plan for one mask on one device (built once, reused by every layer)."""

    seqs: Varlen  # the local sequences: queries [a, e) over keys [kl, kh) per piece
    q_index: torch.Tensor  # (rows of the local q buffer,) local row, or num_local for a dummy zero row
    kv_index: torch.Tensor  # (rows of the local kv buffer,) local row, or num_local + row of the gathered layout
    send_index: torch.Tensor  # local rows of documents shared with other ranks (what this rank contributes)
    max_shared: int  # rows per rank in the gathered layout (0: nothing to communicate)
    q_identity: bool  # the q buffer is the local q itself (no dummy rows, no padding rows): no copies
    kv_identity: bool  # the kv buffer is the local k/v itself (nothing gathered, no duplicates): no copies
    out_index: torch.Tensor  # (num_local,) row of the q buffer, or its length for a zero row (padding)


def local_key_ranges(mask: Mask, a, b, length):
    """Per piece ``[a, b)`` of documents of ``length``: keys ``[kl, kh)`` and query end ``e``."""
    if mask.is_full:
        return torch.zeros_like(a), length, b
    mask = dataclasses.replace(mask, align="bottom_right")  # same thing in self-attention
    lo, hi, _, _ = masks.block_key_range(mask, a, b, length, length)
    if mask.chunk_size is not None:
        lo = torch.div(lo, mask.chunk_size, rounding_mode="floor") * mask.chunk_size
    kl = torch.minimum(lo.clamp_min(0), a)
    kh = torch.maximum(hi, b)
    return kl, kh, kh


def _shared_rows(plan: CPPlan) -> tuple[torch.Tensor, int]:
    """``(gathered_pos, max_shared)``: for every global row of a document held by more than one rank,
    its row in the gathered layout (``owner * max_shared + index among the owner's such rows``);
    -1 for the other rows."""
    seq = plan.descriptor.row_map_q()[0].cpu()
    owner = plan.owner
    is_doc = seq >= 0
    num_docs = len(plan.descriptor.lengths_q)
    lo = torch.full((num_docs,), plan.world, dtype=torch.int64)
    hi = torch.full((num_docs,), -1, dtype=torch.int64)
    doc = seq[is_doc]
    lo = lo.scatter_reduce(0, doc, owner[is_doc], "amin")
    hi = hi.scatter_reduce(0, doc, owner[is_doc], "amax")
    shared = is_doc & (hi > lo)[seq.clamp_min(0)] if num_docs else is_doc
    gathered, max_shared, _ = gathered_layout(owner, shared, plan.world, plan.rank)
    return gathered, max_shared


def build_layout(plan: CPPlan, mask: Mask, device) -> LocalLayout:
    _, a, b, length, first = plan.pieces.unbind(1)
    kl, kh, e = local_key_ranges(mask, a, b, length)
    n_local = plan.num_local
    local_pos = plan.flat_pos - plan.owner * plan.max_local  # every row's index on its owner
    local_start = local_pos[first + a] if a.numel() else a

    seg, off = segments(e - a)
    q_index = torch.where(off < (b - a)[seg], local_start[seg] + off, torch.full_like(off, n_local))
    seg_k, off_k = segments(kh - kl)
    key_rows = first[seg_k] + kl[seg_k] + off_k
    gathered, max_shared = _shared_rows(plan)
    mine = plan.owner[key_rows] == plan.rank
    kv_index = torch.where(mine, local_pos[key_rows], n_local + gathered[key_rows])
    send_index = local_pos[plan.local_rows[gathered[plan.local_rows] >= 0]]
    real = q_index < n_local
    out_index = torch.full((n_local,), q_index.numel(), dtype=torch.int64)
    out_index[q_index[real]] = torch.arange(q_index.numel())[real]

    seqs = Varlen.from_lengths((e - a).tolist(), (kh - kl).tolist(), device=device)
    identity = torch.arange(n_local)
    q_identity = torch.equal(q_index, identity)
    kv_identity = max_shared == 0 and torch.equal(kv_index, identity)
    return LocalLayout(seqs, q_index.to(device), kv_index.to(device), send_index.to(device), max_shared,
                       q_identity, kv_identity, out_index.to(device))


# ------------------------------------------------------------------ overlap groups
def resolve_overlap_groups(requested: int | None, heads_kv: int) -> int:
    """The number ``G`` of kv-head groups of one call: ``requested`` (the ``overlap_groups`` argument
    of `packattn.cp.attention`), else the environment variable ``PACKATTN_CP_OVERLAP_GROUPS``, else
    `DEFAULT_OVERLAP_GROUPS`; clamped to ``heads_kv``. ``G = 1``: one collective, no overlap."""
    if requested is None:
        raw = (env.get(ENV_OVERLAP_GROUPS, "") or "").strip()
        requested = int(raw) if raw.isdigit() else (raw or DEFAULT_OVERLAP_GROUPS)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"overlap_groups (or ${ENV_OVERLAP_GROUPS}) must be a positive int, got {requested!r}")
    return min(requested, heads_kv)


def head_groups(heads_kv: int, groups: int) -> list[slice]:
    """The kv heads of each of ``groups`` contiguous groups (``groups <= heads_kv``), sizes as even
    as possible."""
    bounds = [g * heads_kv // groups for g in range(groups + 1)]
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]


# ------------------------------------------------------------------ buffers of the local problem
def _flat_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V of each row side by side, ``(rows, heads_kv * (d + d_v))``: one collective moves both."""
    return torch.cat([k.flatten(1), v.flatten(1)], dim=1)


def _split_kv(kv: torch.Tensor, heads_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_flat_kv`: views of K ``(rows, heads_kv, d)`` and V ``(rows, heads_kv, d_v)``."""
    rows, d_v = kv.shape[0], kv.shape[1] // heads_kv - d
    return kv[:, : heads_kv * d].reshape(rows, heads_kv, d), kv[:, heads_kv * d:].reshape(rows, heads_kv, d_v)


def _key_rows(kv_local: torch.Tensor, shared: torch.Tensor | None, layout) -> torch.Tensor:
    """The flat K/V of every key of the local problem (``layout.kv_index``, of a `LocalLayout` or a
    `packattn.cp.tree.TreeLayout`): rows of ``kv_local``, then the gathered rows (``shared``; None
    when nothing was gathered)."""
    kv = kv_local if shared is None else torch.cat([kv_local, shared])
    return kv.index_select(0, layout.kv_index)


def _key_rows_grad(grad: torch.Tensor, layout: LocalLayout, num_local: int, num_gathered: int):
    """Backward of `_key_rows` by hand (the operations autograd runs for it, in the same order):
    ``(gradient of the local rows, gradient of the gathered rows)``."""
    total = grad.new_zeros(num_local + num_gathered, grad.shape[1]).index_add_(0, layout.kv_index, grad)
    return total[:num_local], total[num_local:]


def _query_buffer(q: torch.Tensor, layout: LocalLayout) -> torch.Tensor:
    """The queries of the local sequences: local rows, and zero rows for the dummy queries."""
    if layout.q_identity:
        return q
    return torch.cat([q, q.new_zeros(1, *q.shape[1:])]).index_select(0, layout.q_index)


def _local_attention(q_buf, k_buf, v_buf, layout: LocalLayout, mask: Mask, opts: dict):
    """``(out, lse)`` of the local sequences (lse None unless ``opts["return_lse"]``); ``opts``: the
    keyword arguments of `packattn.attention` other than the mask."""
    if layout.seqs.num_seqs == 0:  # nothing local; stay attached to the graph so backward runs
        tie = q_buf.flatten()[:0].sum() + k_buf.flatten()[:0].sum() + v_buf.flatten()[:0].sum()
        out = q_buf.new_zeros(0, q_buf.shape[1], v_buf.shape[2]) + tie
        return out, torch.zeros(q_buf.shape[1], 0, dtype=torch.float32, device=q_buf.device) + tie.float()
    res = packattn.attention(q_buf, k_buf, v_buf, layout.seqs, causal=mask.causal, window=mask.window,
                             chunk_size=mask.chunk_size, **opts)
    return res if opts["return_lse"] else (res, None)


def _local_rows(out_buf: torch.Tensor, lse_buf: torch.Tensor | None, layout: LocalLayout):
    """``(out, lse)`` of the local rows from those of the query buffer: dummy queries dropped,
    padding rows zero (lse -inf)."""
    if layout.q_identity:
        return out_buf, lse_buf
    out = torch.cat([out_buf, out_buf.new_zeros(1, *out_buf.shape[1:])]).index_select(0, layout.out_index)
    if lse_buf is None:
        return out, None
    neg_inf = lse_buf.new_full((lse_buf.shape[0], 1), float("-inf"))
    return out, torch.cat([lse_buf, neg_inf], dim=1).index_select(1, layout.out_index)


# ------------------------------------------------------------------ overlapped executor
@dataclasses.dataclass
class _Group:
    """One kv-head group of `_OverlappedGroups`: its heads, the all-gather of its shared rows, and
    the leaves and results of its local attention graph (kept from forward to backward)."""

    kv_heads: slice
    q_heads: slice
    kv_local: torch.Tensor | None  # the group's flat K/V of the local rows, until its key rows are built
    gathered: Pending | None  # the all-gather of its rows of shared documents, until waited for
    q: torch.Tensor | None = None  # leaf: the group's query heads of the query buffer
    kv: torch.Tensor | None = None  # leaf: the group's flat key rows (`_key_rows`)
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None


def _start_group(k, v, kv_heads: slice, ratio: int, plan: CPPlan, layout: LocalLayout) -> _Group:
    """Issue the all-gather of one group's K/V rows of shared documents (without waiting)."""
    kv_local = _flat_kv(k[:, kv_heads], v[:, kv_heads])
    gathered = start_gather_rows(kv_local.index_select(0, layout.send_index), layout.max_shared, plan.world,
                                 plan.group)
    q_heads = slice(kv_heads.start * ratio, kv_heads.stop * ratio)  # GQA: query head i uses kv head i // ratio
    return _Group(kv_heads, q_heads, kv_local, gathered)


def _attend(grp: _Group, q_buf, d: int, layout: LocalLayout, mask: Mask, opts: dict, track: bool) -> None:
    """Wait for the group's gather, then run its local attention; with ``track``, as a graph on
    detached leaves (for backward)."""
    kv = _key_rows(grp.kv_local, grp.gathered.wait(), layout)
    grp.kv_local = grp.gathered = None
    with torch.set_grad_enabled(track):
        grp.q = q_buf[:, grp.q_heads].detach().requires_grad_(track)
        grp.kv = kv.requires_grad_(track)
        k_buf, v_buf = _split_kv(grp.kv, grp.kv_heads.stop - grp.kv_heads.start, d)
        grp.out, grp.lse = _local_attention(grp.q, k_buf, v_buf, layout, mask, opts)


def _group_grads(grp: _Group, dout, dlse):
    """``(dq, d flat key rows)`` of one group from its graph (``dout``/``dlse`` of all heads, or None)."""
    outputs, grads = [], []
    for result, grad, heads in ((grp.out, dout, (slice(None), grp.q_heads)), (grp.lse, dlse, (grp.q_heads,))):
        if grad is not None:
            outputs.append(result)
            grads.append(grad[heads].contiguous())
    return torch.autograd.grad(outputs, (grp.q, grp.kv), grads, materialize_grads=True)


class _OverlappedGroups(torch.autograd.Function):
    """``(q_buf, k, v) -> out_buf (, lse_buf)``: the local attention with the K/V of shared documents
    all-gathered per kv-head group, each group's communication overlapping another group's compute
    (module docstring, "Overlap"). ``q_buf``: the query buffer; ``k, v``: the local rows; ``track``:
    keep each group's graph for backward (something needs gradients)."""

    @staticmethod
    def forward(ctx, q_buf, k, v, plan: CPPlan, layout: LocalLayout, mask: Mask, opts: dict, kv_groups: list,
                track: bool):
        ratio = q_buf.shape[1] // k.shape[1]
        groups = [_start_group(k, v, heads, ratio, plan, layout) for heads in kv_groups]  # all in flight
        for grp in groups:
            _attend(grp, q_buf, k.shape[2], layout, mask, opts, track)
        ctx.groups, ctx.plan, ctx.layout = (groups if track else None), plan, layout
        ctx.num_local, ctx.d = k.shape[0], k.shape[2]
        ctx.set_materialize_grads(False)
        out = torch.cat([grp.out.detach() for grp in groups], dim=1)
        if not opts["return_lse"]:
            return out
        return out, torch.cat([grp.lse.detach() for grp in groups], dim=0)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse=None):
        groups, plan, layout = ctx.groups, ctx.plan, ctx.layout
        if groups is None:
            raise RuntimeError("the overlapped all-gather runs backward once (no retain_graph); "
                               "use overlap_groups=1 to backward through it twice")
        ctx.groups = None
        heads = [grp.kv_heads.stop - grp.kv_heads.start for grp in groups]
        dq, dkv, reduced = [None] * len(groups), [None] * len(groups), [None] * len(groups)
        for g in reversed(range(len(groups))):  # each reduce-scatter travels during the next group's backward
            dq[g], dkv_rows = _group_grads(groups[g], dout, dlse)
            groups[g] = None  # its graph is consumed
            dkv[g], d_gathered = _key_rows_grad(dkv_rows, layout, ctx.num_local, plan.world * layout.max_shared)
            reduced[g] = start_reduce_scatter_rows(d_gathered, layout.send_index.numel(), layout.max_shared,
                                                   plan.world, plan.group)
        for g in reversed(range(len(groups))):  # in the order issued
            dkv[g].index_add_(0, layout.send_index, reduced[g].wait())
        dk, dv = zip(*(_split_kv(dkv[g], heads[g], ctx.d) for g in range(len(groups))))
        return torch.cat(dq, dim=1), torch.cat(dk, dim=1), torch.cat(dv, dim=1), None, None, None, None, None, None


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, call: Call):
    """The all-gather executor (`packattn.cp.executor`). ``call.overlap_groups``: kv-head groups whose
    communication overlaps compute (`resolve_overlap_groups`; module docstring)."""
    mask = call.mask
    groups = resolve_overlap_groups(call.overlap_groups, k.shape[1])
    layout = plan.cached(("allgather", mask, str(q.device)), lambda: build_layout(plan, mask, q.device))
    opts = {**call.options(), "return_lse": call.return_lse}

    q_buf = _query_buffer(q, layout)
    if layout.kv_identity:  # every key this rank needs is its own, in order (e.g. whole documents)
        out_buf, lse_buf = _local_attention(q_buf, k, v, layout, mask, opts)
    elif layout.max_shared == 0 or groups == 1:  # one collective (or none), autograd through gather_rows
        kv = _flat_kv(k, v)
        shared = None
        if layout.max_shared:
            shared = gather_rows(kv.index_select(0, layout.send_index), layout.max_shared, plan.world, plan.group)
        k_buf, v_buf = _split_kv(_key_rows(kv, shared, layout), k.shape[1], k.shape[2])
        out_buf, lse_buf = _local_attention(q_buf, k_buf, v_buf, layout, mask, opts)
    else:
        track = torch.is_grad_enabled() and any(t.requires_grad for t in (q_buf, k, v))  # keep graphs for backward
        res = _OverlappedGroups.apply(q_buf, k, v, plan, layout, mask, opts, head_groups(k.shape[1], groups), track)
        out_buf, lse_buf = res if call.return_lse else (res, None)
    return _local_rows(out_buf, lse_buf, layout)
