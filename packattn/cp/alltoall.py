"""All-to-all (Ulysses) context parallelism: trade rows for heads, attend over the whole batch.

Each rank holds ``num_local`` rows of every head. One all-to-all turns that into ALL rows of the
batch for ``heads_q / world`` of the heads; every rank then runs plain `packattn.attention` on the
global descriptor for its heads (so every mask -- causal in both alignments, windows, chunks,
padding between sequences -- means exactly what it means on one device, with no CP-specific
logic), and a second all-to-all gives each rank its rows back with all heads.

Layout of the exchange. Rows travel in the padded all-gather layout of the plan: rank ``s``'s
local rows, padded to ``max_local``, form block ``s`` of ``world * max_local`` rows, so after the
exchange global row ``g`` sits at ``plan.flat_pos[g]``. Rank ``r`` sends to rank ``j`` its rows
of ``j``'s heads; q, k and v travel in one collective (concatenated along the feature axis), out
and (when asked) lse in one collective each on the way back. The backward of an all-to-all is the
inverse all-to-all (`packattn.cp.comm.all_to_all_rows`), the backward of the row reordering is a
scatter with distinct indices, so gradients need no extra logic.

Heads. Rank ``r`` takes query heads ``[r * hq_l, (r + 1) * hq_l)`` with ``hq_l = heads_q / world``
(``heads_q % world == 0`` is required) and the kv heads those use. With ``heads_kv % world == 0``
that is an even split of the kv heads. Otherwise (``heads_kv < world``, or not divisible) kv heads
are replicated: rank ``r`` gets ``hk_l = hq_l / gcd(hq_l, g)`` kv heads (``g = heads_q / heads_kv``),
local kv head ``j`` being global head ``(r * hq_l + j * gcd(hq_l, g)) // g``, so its local problem
is ordinary GQA with group ``gcd(hq_l, g)``. The gradient of a replicated head is the sum of its
copies' gradients, summed in a fixed order (`_SelectHeads`), so ``deterministic=True`` holds.

Nothing here looks inside the descriptor: it is handed to `packattn.attention` as is. `exchange_rows_for_heads`
and `exchange_heads_for_rows` are reused by the hybrid strategy (`packattn.cp.hybrid`) inside one
mesh dimension.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import packattn
from packattn.cp.comm import all_to_all_rows
from packattn.cp.executor import Call
from packattn.cp.plan import CPPlan


@dataclasses.dataclass
class Exchange:
    """Index maps of an all-to-all group on one device (built once per plan, reused by every layer).

    ``gather_index (rows,)``: for every row the group attends over (in the order the attention
    descriptor wants), its row in the padded ``world * max_rows`` layout. ``scatter_index
    (world * max_rows,)``: the inverse; ``rows`` (a zero row) for padding slots.
    """

    group: object
    world: int
    max_rows: int
    num_local: int
    gather_index: torch.Tensor
    scatter_index: torch.Tensor

    @classmethod
    def build(cls, flat_pos: torch.Tensor, max_rows: int, num_local: int, world: int, group, device) -> Exchange:
        rows = flat_pos.numel()
        scatter = torch.full((world * max_rows,), rows, dtype=torch.int64)
        scatter[flat_pos] = torch.arange(rows)
        return cls(group, world, max_rows, num_local, flat_pos.to(device), scatter.to(device))

    @property
    def rows(self) -> int:
        return int(self.gather_index.numel())


@dataclasses.dataclass
class HeadSplit:
    """Which heads each rank of an all-to-all group computes; see the module docstring."""

    heads_q: int
    heads_kv: int
    heads_q_local: int
    heads_kv_local: int
    kv_select: torch.Tensor | None  # (world * heads_kv_local,) kv head of each slot, rank-major; None = even split
    kv_copies: torch.Tensor | None  # (heads_kv, copies) slots of each kv head, padded with world * heads_kv_local

    @classmethod
    def build(cls, heads_q: int, heads_kv: int, world: int, device) -> HeadSplit:
        hq_l = heads_q // world
        g = heads_q // heads_kv
        g_l = math.gcd(hq_l, g)
        hk_l = hq_l // g_l
        slots = torch.arange(world * hk_l)
        select = (slots // hk_l * hq_l + slots % hk_l * g_l) // g
        if torch.equal(select, torch.arange(heads_kv)):
            return cls(heads_q, heads_kv, hq_l, hk_l, None, None)
        counts = torch.bincount(select, minlength=heads_kv)
        copies = torch.full((heads_kv, int(counts.max())), select.numel(), dtype=torch.int64)
        order = torch.sort(select, stable=True).indices
        rank_in_head = torch.arange(select.numel()) - (torch.cumsum(counts, 0) - counts)[select[order]]
        copies[select[order], rank_in_head] = order
        return cls(heads_q, heads_kv, hq_l, hk_l, select.to(device), copies.to(device))


class _SelectHeads(torch.autograd.Function):
    """``x.index_select(1, select)`` whose backward sums each head's copies in a fixed order (a
    gather and a sum instead of index_add, whose atomics would make the sum order vary)."""

    @staticmethod
    def forward(ctx, x, select, copies):
        ctx.save_for_backward(copies)
        return x.index_select(1, select)

    @staticmethod
    def backward(ctx, grad):
        (copies,) = ctx.saved_tensors
        grad = torch.cat([grad, grad.new_zeros(grad.shape[0], 1, *grad.shape[2:])], dim=1)
        picked = grad.index_select(1, copies.flatten())
        return picked.view(grad.shape[0], *copies.shape, *grad.shape[2:]).sum(2), None, None


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int, strategy: str) -> None:
    """Raise, before any communication, for inputs an all-to-all over ``world`` ranks can't split."""
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if hq % world:
        raise ValueError(f"strategy {strategy!r} splits the query heads over {world} ranks: heads_q ({hq}) "
                         f"must be a multiple of {world}")
    if hk != hv:
        raise ValueError(f"k has {hk} heads but v has {hv}")
    if hk == 0 or hq % hk:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hk}) for GQA/MQA")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def exchange_rows_for_heads(q, k, v, ex: Exchange, split: HeadSplit):
    """Local rows of all heads -> all ``ex.rows`` rows of this rank's heads (one all-to-all)."""
    n, w = q.shape[0], ex.world
    if split.kv_select is not None:
        k = _SelectHeads.apply(k, split.kv_select, split.kv_copies)
        v = _SelectHeads.apply(v, split.kv_select, split.kv_copies)
    parts = [t.reshape(n, w, t.shape[1] // w * t.shape[2]) for t in (q, k, v)]  # no -1: n may be 0
    sizes = [p.shape[2] for p in parts]
    send = torch.cat(parts, dim=2)
    if ex.max_rows > n:
        send = torch.cat([send, send.new_zeros(ex.max_rows - n, w, send.shape[2])])
    recv = all_to_all_rows(send.transpose(0, 1).reshape(w * ex.max_rows, send.shape[2]), w, ex.group)
    rows = recv.index_select(0, ex.gather_index)
    q_r, k_r, v_r = rows.split(sizes, dim=1)
    hq_l, hk_l = split.heads_q_local, split.heads_kv_local
    return (q_r.reshape(ex.rows, hq_l, q.shape[2]), k_r.reshape(ex.rows, hk_l, k.shape[2]),
            v_r.reshape(ex.rows, hk_l, v.shape[2]))


def _rows_back(x: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """``(ex.rows, C)`` of this rank's heads -> ``(num_local, world, C)``: every rank's block."""
    x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, ex.scatter_index)
    back = all_to_all_rows(x, ex.world, ex.group).view(ex.world, ex.max_rows, x.shape[1])
    return back[:, : ex.num_local].transpose(0, 1)


def exchange_heads_for_rows(out, lse, ex: Exchange, split: HeadSplit):
    """Inverse of `exchange_rows_for_heads` for the results: ``out (rows, hq_l, dv)`` and ``lse
    (hq_l, rows)`` (or None) -> ``out (num_local, heads_q, dv)``, ``lse (heads_q, num_local)``."""
    dv = out.shape[2]
    out = _rows_back(out.reshape(ex.rows, split.heads_q_local * dv), ex).reshape(ex.num_local, split.heads_q, dv)
    if lse is not None:
        lse = _rows_back(lse.t(), ex).reshape(ex.num_local, split.heads_q).t()
    return out, lse


def attend(q, k, v, descriptor, call: Call):
    """`packattn.attention` on the gathered rows with the call's mask and options; returns
    ``(out, lse or None)``."""
    if q.shape[0] == 0:  # an empty batch; stay attached to the graph so backward runs
        tie = q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()
        out = q.new_zeros(0, q.shape[1], v.shape[2]) + tie
        return out, (torch.zeros(q.shape[1], 0, dtype=torch.float32, device=q.device) if call.return_lse else None)
    res = packattn.attention(q, k, v, descriptor, causal=call.causal, window=call.window, chunk_size=call.chunk_size,
                             return_lse=call.return_lse, **call.options())
    return res if call.return_lse else (res, None)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, call: Call):
    """The all-to-all executor (`packattn.cp.executor`)."""
    check_heads(q, k, v, plan.world, plan.strategy)
    device = q.device
    ex = plan.cached(("a2a", str(device)), lambda: Exchange.build(
        plan.flat_pos, plan.max_local, plan.num_local, plan.world, plan.group, device))
    split = plan.cached(("a2a heads", q.shape[1], k.shape[1], str(device)),
                        lambda: HeadSplit.build(q.shape[1], k.shape[1], plan.world, device))
    q_g, k_g, v_g = exchange_rows_for_heads(q, k, v, ex, split)
    out, lse = attend(q_g, k_g, v_g, plan.descriptor, call)
    return exchange_heads_for_rows(out, lse, ex, split)
