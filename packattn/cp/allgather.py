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
"""

from __future__ import annotations

import dataclasses

import torch

import packattn
from packattn import mask as masks
from packattn.cp.comm import gather_rows
from packattn.cp.plan import CPPlan
from packattn.mask import Mask
from packattn.varlen import Varlen


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


def _segments(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows laid out as consecutive segments of ``lengths``: each row's segment and offset in it."""
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return seg, torch.arange(seg.numel()) - starts[seg]


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
    counts = torch.bincount(owner[shared], minlength=plan.world)
    max_shared = int(counts.max()) if shared.any() else 0
    order = torch.sort(owner * shared.numel() + torch.arange(shared.numel()))  # by owner, then row
    rank_in_owner = torch.empty_like(owner)
    rank_in_owner[order.indices] = torch.cumsum(shared[order.indices].long(), 0) - 1
    offsets = torch.cumsum(counts, 0) - counts
    rank_in_owner = rank_in_owner - offsets[owner]
    gathered = torch.where(shared, owner * max_shared + rank_in_owner, torch.full_like(owner, -1))
    return gathered, max_shared


def build_layout(plan: CPPlan, mask: Mask, device) -> LocalLayout:
    _, a, b, length, first = plan.pieces.unbind(1)
    kl, kh, e = local_key_ranges(mask, a, b, length)
    n_local = plan.num_local
    local_pos = plan.flat_pos - plan.owner * plan.max_local  # every row's index on its owner
    local_start = local_pos[first + a] if a.numel() else a

    seg, off = _segments(e - a)
    q_index = torch.where(off < (b - a)[seg], local_start[seg] + off, torch.full_like(off, n_local))
    seg_k, off_k = _segments(kh - kl)
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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CPPlan,
    *,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
):
    """The all-gather executor of `packattn.cp.attention` (arguments checked there)."""
    mask = Mask.make(causal, window, chunk_size)
    layout = plan.cached(("allgather", mask, str(q.device)), lambda: build_layout(plan, mask, q.device))

    n, hk, d, dv = k.shape[0], k.shape[1], k.shape[2], v.shape[2]
    if layout.kv_identity:  # every key this rank needs is its own, in order (e.g. whole documents)
        k_buf, v_buf = k, v
    else:
        kv = torch.cat([k.reshape(n, hk * d), v.reshape(n, hk * dv)], dim=1)  # one collective for both
        if layout.max_shared:
            shared = gather_rows(kv.index_select(0, layout.send_index), layout.max_shared, plan.world, plan.group)
            kv = torch.cat([kv, shared])
        kv_buf = kv.index_select(0, layout.kv_index)
        k_buf = kv_buf[:, : hk * d].reshape(-1, hk, d)
        v_buf = kv_buf[:, hk * d:].reshape(-1, hk, dv)
    q_buf = q if layout.q_identity else torch.cat([q, q.new_zeros(1, *q.shape[1:])]).index_select(0, layout.q_index)

    hq = q.shape[1]
    if layout.seqs.num_seqs == 0:  # nothing local; stay attached to the graph so backward runs
        tie = q_buf.flatten()[:0].sum() + k_buf.flatten()[:0].sum() + v_buf.flatten()[:0].sum()
        out_buf = q.new_zeros(0, hq, dv) + tie
        lse_buf = torch.zeros(hq, 0, dtype=torch.float32, device=q.device)
    else:
        res = packattn.attention(q_buf, k_buf, v_buf, layout.seqs, causal=mask.causal, window=mask.window,
                                 chunk_size=mask.chunk_size, scale=scale, backend=backend,
                                 return_lse=return_lse, deterministic=deterministic)
        out_buf, lse_buf = res if return_lse else (res, None)
    if layout.q_identity:
        return (out_buf, lse_buf) if return_lse else out_buf
    out = torch.cat([out_buf, out_buf.new_zeros(1, hq, dv)]).index_select(0, layout.out_index)
    if not return_lse:
        return out
    neg_inf = lse_buf.new_full((hq, 1), float("-inf"))
    return out, torch.cat([lse_buf, neg_inf], dim=1).index_select(1, layout.out_index)
