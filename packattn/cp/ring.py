"""P2P ring context parallelism (strategy ``"p2p"``): K/V blocks travel around the ranks while
every rank attends its own queries to the block it holds, merging the partial results through
their log-sum-exp (ring attention).

Rows. Each document is cut into pieces (`packattn.cp.plan`); a rank holds some pieces of some
documents, in ascending global row order. Pieces of one document on one rank are contiguous in
its local rows (nothing else lies between them), and the keys a piece needs from another rank
are a run of that rank's pieces of the same document.

Steps. There are ``world`` steps; at step ``s`` a rank holds the K/V of source rank
``src = (rank - s) % world``:

* step 0 (own K/V): one local sequence per document, queries and keys = this rank's pieces of it
  concatenated, with the causal mask when the call is causal. The pieces keep their global order,
  so causal over the concatenation sees exactly the global keys (top-left and bottom-right agree:
  the local sequence is self-attention).
* step ``s > 0``: for a query piece ``[a, b)`` and a source piece ``[c, e)`` of the same document,
  causal means either ``e <= a`` (every key before every query: fully visible, no mask) or
  ``c >= b`` (invisible: skipped); pieces never overlap. Without a mask every pair is visible.
  A query piece sees a run of the source's pieces of its document; consecutive query pieces of one
  document that see the same run form one local sequence (their rows are contiguous), so each
  local row is in at most one sequence per step. The step is one `packattn.attention` call without
  mask on the gathered queries and the source's gathered K/V (skipped if nothing is visible).

Each step returns ``(out_s, lse_s)``; the running result is merged through the log-sum-exp in
float32 (float64 for float64 inputs): ``lse = logaddexp(lse, lse_s)``, ``out = w * out +
w_s * out_s`` with ``w = exp(lse_old - lse)``, ``w_s = exp(lse_s - lse)`` (0 for -inf). Rows that
see nothing keep ``out = 0``, ``lse = -inf``; no NaN.

Messages. Only rows of documents held by more than one rank travel (a rank holding whole
documents keeps them at home). Each rank's K (heads_kv * d) and V (heads_kv * d_v) columns go
in one buffer padded to the largest such row count of any rank; every step first posts the next
step's send (to ``rank + 1``) and receive (from ``rank - 1``) with
``torch.distributed.batch_isend_irecv``, then computes on the current buffer (double-buffered),
so communication overlaps compute.

Backward (the whole ring is one ``torch.autograd.Function``: only the local q, k, v, merged out
and lse are saved). K/V rotate again; a float32 dK/dV accumulator for the source's travelling
rows follows one step behind them (sent as soon as a step's contribution is added, waited for
only when the next step adds its own), and after the last step it arrives back at its owner,
who adds it to its own step-0 gradient. Per step, two ways to get the step's dq/dk/dv:

* any backend: recompute ``(out_s, lse_s)`` with autograd and take gradients with
  ``grad_out = w_s * dout`` and ``grad_lse = w_s * (rowsum(dout * (out_s - out)) + dlse)``,
  ``w_s = exp(lse_s - lse)`` (exactly the chain rule through the merge);
* when the step resolves to backend ``"triton"`` (`packattn.dispatch`): the Triton backward
  ``packattn::varlen_bwd`` with the GLOBAL out and lse, whose softmax and
  ``delta = rowsum(dout * out) - dlse`` are then the global ones: no recompute.

Reduction order is fixed (dq: steps in order; dK/dV of a row: its owner's step 0, then the ranks
after it around the ring; a K/V row used by several sequences of a step is scattered in a fixed
sequence of duplicate-free passes), so results are deterministic for a fixed world size whether or
not ``deterministic=True``; that flag is passed on to every step's backend.

Not supported (``NotImplementedError``, raised before any communication): windows and
``chunk_size``, whose visibility is not whole pieces; use ``strategy="allgather"`` for those.
Everything host-side (steps, index maps, descriptors) is built once per plan and mask and cached
on the plan, so a call does no host sync on CUDA.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

import packattn
from packattn import dispatch
from packattn.cp.plan import CPPlan
from packattn.cp.plan import plan as make_plan
from packattn.mask import Mask
from packattn.varlen import Varlen

KV_TAG, DKV_TAG = 1, 2  # P2P tags of the K/V and dK/dV messages (gloo matches on them; NCCL ignores them)


@dataclasses.dataclass
class Step:
    """One ring step of one rank: its local sequences against the source's K/V (on the device)."""

    src: int
    seqs: Varlen | None  # None: nothing visible at this step
    mask: Mask  # step 0: the call's (causal or full); later steps: full
    q_index: torch.Tensor  # (rows,) local row of each row of the step's query buffer
    kv_index: torch.Tensor  # (rows,) row of each key of the step: local row (step 0) or row of src's message
    kv_passes: tuple[torch.Tensor, ...]  # positions in kv_index in passes that repeat no row; () = no repeats


@dataclasses.dataclass
class RingLayout:
    """Index maps of one plan for one mask on one device (built once, reused by every layer)."""

    steps: list[Step]
    send_index: torch.Tensor  # (message_rows,) local row of each message row, num_local for padding
    own_rows: torch.Tensor  # (rows this rank sends,) local rows of the first rows of its message
    message_rows: int  # rows of every message (0: nothing to exchange, no communication at all)
    local_only: bool = False  # one step, over exactly the local rows in order: plain local attention


# ------------------------------------------------------------------ host-side layout
def _segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))``."""
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    return starts[seg] + torch.arange(seg.numel()) - offsets[seg]


def _pieces_of(plan: CPPlan, rank: int) -> torch.Tensor:
    if rank == plan.rank:
        return plan.pieces
    return plan.cached(("p2p pieces", rank), lambda: make_plan(
        plan.descriptor, world=plan.world, rank=rank, strategy=plan.strategy, balance=plan.balance).pieces)


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


def _step(src: int, mask: Mask, q_start, q_len, kv_start, kv_len, device) -> Step:
    if q_len.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Step(src, None, mask, empty, empty, ())
    kv_index = _segments(kv_start, kv_len)
    order = torch.argsort(kv_start)
    overlap = bool((kv_start[order][1:] < (kv_start + kv_len)[order][:-1]).any())
    passes = _duplicate_free_passes(kv_index) if overlap else ()  # zigzag and contiguous never overlap
    seqs = Varlen.from_lengths(q_len.tolist(), None if src < 0 else kv_len.tolist(), device=device)
    return Step(src, seqs, mask, _segments(q_start, q_len).to(device), kv_index.to(device),
                tuple(p.to(device) for p in passes))


def build_layout(plan: CPPlan, causal: bool, device) -> RingLayout:
    world, rank = plan.world, plan.rank
    pieces = [_pieces_of(plan, r) for r in range(world)]
    num_docs = len(plan.descriptor.lengths_q)
    holders = torch.zeros(num_docs, dtype=torch.int64)
    for p in pieces:
        holders[torch.unique(p[:, 0])] += 1
    shared_doc = holders > 1  # documents whose rows must travel

    # every rank's message: rows of its pieces of shared documents, in order
    message_offset, message_len = [], []
    for p in pieces:
        n = (p[:, 2] - p[:, 1]) * shared_doc[p[:, 0]]
        message_offset.append(torch.cumsum(n, 0) - n)
        message_len.append(n)
    message_rows = max(int(n.sum()) for n in message_len) if world > 1 else 0

    mine = plan.pieces
    doc, a, b, length, first = (c.contiguous() for c in mine.unbind(1))
    local_start = torch.searchsorted(plan.local_rows, first + a)
    own_rows = _segments(local_start, message_len[rank])
    pad = torch.full((message_rows - own_rows.numel(),), plan.num_local, dtype=torch.int64)
    send_index = torch.cat([own_rows, pad])

    # step 0: one sequence per document, the rank's pieces of it (contiguous local rows)
    docs, counts = torch.unique_consecutive(doc, return_counts=True)
    first_piece = torch.cumsum(counts, 0) - counts
    doc_rows = torch.zeros(docs.numel(), dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(docs.numel()), counts), b - a)
    step0_mask = Mask.make(True) if causal else Mask()
    steps = [_step(-1, step0_mask, local_start[first_piece], doc_rows, local_start[first_piece], doc_rows, device)]

    q_first, doc_end = first + a, first + length
    for s in range(1, world if message_rows else 1):
        src = (rank - s) % world
        sp = pieces[src]
        s_first, s_last = sp[:, 4] + sp[:, 1], sp[:, 4] + sp[:, 2]
        lo = torch.searchsorted(s_first, first)  # the source's first piece of each query piece's document
        if causal:  # its pieces ending at or before the query piece
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
        kv_start = message_offset[src][g_lo] if g_lo.numel() else g_lo
        kv_len = (message_offset[src] + message_len[src])[g_hi - 1] - kv_start if g_lo.numel() else g_lo
        steps.append(_step(src, Mask(), q_start, q_len, kv_start, kv_len, device))
    step0 = steps[0]
    identity = torch.arange(plan.num_local, device=device)
    local_only = (len(steps) == 1 and step0.seqs is not None and torch.equal(step0.q_index, identity)
                  and torch.equal(step0.kv_index, identity))
    return RingLayout(steps, send_index.to(device), own_rows.to(device), message_rows, local_only)


# ------------------------------------------------------------------ communication
def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _post(plan: CPPlan, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
    """Send ``send`` to the next rank of the ring, receive ``recv`` from the previous one (async)."""
    nxt = _global_rank(plan.group, (plan.rank + 1) % plan.world)
    prev = _global_rank(plan.group, (plan.rank - 1) % plan.world)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, plan.group, tag),
                                   dist.P2POp(dist.irecv, recv, prev, plan.group, tag)])


def _wait(works: list) -> None:
    for w in works:
        w.wait()


# ------------------------------------------------------------------ per step
def _kv_of_step(step: Step, kv_local, kv_message, hk: int, d: int, dv: int):
    buf = (kv_local if step.src < 0 else kv_message).index_select(0, step.kv_index)
    return buf[:, : hk * d].reshape(-1, hk, d), buf[:, hk * d:].reshape(-1, hk, dv)


def _weights(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_part - lse)``; 0 where ``lse_part`` is -inf (then lse may be -inf too)."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse_part - safe)


def _merge(acc: torch.Tensor, lse_acc: torch.Tensor, index: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """Fold one step's ``(out, lse)`` for local rows ``index`` into the running result, in place."""
    old_out, old_lse = acc.index_select(0, index), lse_acc.index_select(1, index)
    lse = lse.to(lse_acc.dtype)
    new_lse = torch.logaddexp(old_lse, lse)
    w_old, w_new = _weights(old_lse, new_lse).t()[..., None], _weights(lse, new_lse).t()[..., None]
    merged = old_out * w_old + out.to(acc.dtype) * w_new
    acc.index_copy_(0, index, merged)
    lse_acc.index_copy_(1, index, new_lse)


def _use_triton(step: Step, q, k, v, backend: str, deterministic: bool) -> bool:
    """Would `packattn.attention` run this step (with gradients) on our Triton varlen kernels?"""
    seqs = step.seqs
    params = dispatch.Params(
        device_type=q.device.type, dtype=q.dtype, heads_q=q.shape[1], heads_kv=k.shape[1], head_dim=q.shape[2],
        head_dim_v=v.shape[2], kind="varlen", pad_between_seqs=False, is_self=seqs.is_self, host_lengths=True,
        max_seqlen_q=dispatch.Params.bucket(seqs.max_seqlen_q),
        max_seqlen_kv=dispatch.Params.bucket(seqs.max_seqlen_kv),
        mask=step.mask, return_lse=True, deterministic=deterministic, requires_grad=True)
    return dispatch.select(params, backend).name == "triton"


def _step_grads_triton(step: Step, q_s, k_s, v_s, dout_s, dlse_s, out_g, lse_g, scale: float):
    """dq, dk, dv of one step from ``packattn::varlen_bwd`` with the global out and lse."""
    from packattn.backends import triton_varlen

    seqs, mask = step.seqs, step.mask
    sign = 1.0
    if scale < 0:  # the kernels need scale >= 0 (as in TritonVarlenBackend.run)
        q_s, scale, sign = -q_s, -scale, -1.0
    head_dim = q_s.shape[-1]
    dq_cfg = triton_varlen.launch_config("dq", head_dim, q_s.dtype, q_s.device)
    dq_tiles = triton_varlen.tile_table(seqs, mask, False, dq_cfg.block_m, dq_cfg.block_n)
    dkdv_tiles = triton_varlen.tile_table(seqs, mask, True, *triton_varlen.dkdv_blocks(q_s, k_s, v_s))
    dq, dk, dv = triton_varlen.varlen_bwd_call(
        dout_s, dlse_s, q_s, k_s, v_s, out_g, lse_g.float().contiguous(), seqs.cu_seqlens_q, seqs.cu_seqlens_kv,
        seqs.cu_seqlens_q, seqs.cu_seqlens_kv, dq_tiles, dkdv_tiles, scale, mask.left, mask.right, 0,
        mask.align == "top_left", False, False)
    return (dq * sign if sign < 0 else dq), dk, dv


def _step_grads_recompute(step: Step, q_s, k_s, v_s, dout_s, dlse_s, out_g, lse_g, opts: dict):
    """dq, dk, dv of one step: recompute its (out, lse) with autograd and apply the chain rule
    through the merge (``out_g``, ``lse_g``: the merged result's rows of this step)."""
    with torch.enable_grad():
        q_s, k_s, v_s = (t.detach().requires_grad_() for t in (q_s, k_s, v_s))
        o, lo = packattn.attention(q_s, k_s, v_s, step.seqs, causal=step.mask.causal, return_lse=True, **opts)
        acc = lse_g.dtype
        w = _weights(lo.detach().to(acc), lse_g)  # (hq, rows)
        dout_acc = dout_s.to(acc)
        grad_out = (dout_acc * w.t()[..., None]).to(o.dtype)
        grad_lse = (dout_acc * (o.detach().to(acc) - out_g.to(acc))).sum(-1).t()
        if dlse_s is not None:
            grad_lse = grad_lse + dlse_s.to(acc)
        grad_lse = (w * grad_lse).to(lo.dtype)
        return torch.autograd.grad((o, lo), (q_s, k_s, v_s), (grad_out, grad_lse))


# ------------------------------------------------------------------ the ring
class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CPPlan, layout: RingLayout, opts: dict):
        n, hq, hk, d, dv = q.shape[0], q.shape[1], k.shape[1], k.shape[2], v.shape[2]
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        acc = torch.zeros(n, hq, dv, dtype=acc_dtype, device=q.device)
        lse = torch.full((hq, n), float("-inf"), dtype=acc_dtype, device=q.device)
        kv_local = torch.cat([k.reshape(n, hk * d), v.reshape(n, hk * dv)], dim=1)
        cur = nxt = None
        if layout.message_rows:
            cur = torch.cat([kv_local, kv_local.new_zeros(1, kv_local.shape[1])]).index_select(0, layout.send_index)
            nxt = torch.empty_like(cur)
        for s, step in enumerate(layout.steps):
            works = _post(plan, cur, nxt, KV_TAG) if s + 1 < len(layout.steps) else []
            if step.seqs is not None:
                k_s, v_s = _kv_of_step(step, kv_local, cur, hk, d, dv)
                out_s, lse_s = packattn.attention(q.index_select(0, step.q_index), k_s, v_s, step.seqs,
                                                  causal=step.mask.causal, return_lse=True, **opts)
                _merge(acc, lse, step.q_index, out_s, lse_s)
            _wait(works)
            if works:
                cur, nxt = nxt, cur
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.layout, ctx.opts = plan, layout, opts
        ctx.set_materialize_grads(False)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, layout, opts = ctx.plan, ctx.layout, ctx.opts
        n, hq, hk, d, dv = q.shape[0], q.shape[1], k.shape[1], k.shape[2], v.shape[2]
        if dout is None:
            dout = torch.zeros_like(out)
        acc_dtype = lse.dtype
        scale = opts["scale"] if opts["scale"] is not None else 1.0 / math.sqrt(d)
        dq = torch.zeros(n, hq, d, dtype=acc_dtype, device=q.device)
        dkv = torch.zeros(n, hk * (d + dv), dtype=acc_dtype, device=q.device)  # this rank's rows, step 0 + returned
        kv_local = torch.cat([k.reshape(n, hk * d), v.reshape(n, hk * dv)], dim=1)
        cur = nxt = None
        if layout.message_rows:
            cur = torch.cat([kv_local, kv_local.new_zeros(1, kv_local.shape[1])]).index_select(0, layout.send_index)
            nxt = torch.empty_like(cur)
        # dK/dV accumulator of the current source's message rows: two buffers, one travelling in, one out
        acc_in = acc_out = None
        acc_works: list = []
        last = len(layout.steps) - 1
        for s, step in enumerate(layout.steps):
            works = _post(plan, cur, nxt, KV_TAG) if s < last else []
            grads = None
            if step.seqs is not None:
                k_s, v_s = _kv_of_step(step, kv_local, cur, hk, d, dv)
                idx = step.q_index
                args = (step, q.index_select(0, idx), k_s, v_s, dout.index_select(0, idx),
                        None if dlse is None else dlse.index_select(1, idx), out.index_select(0, idx),
                        lse.index_select(1, idx))
                if _use_triton(step, q, k, v, opts["backend"], opts["deterministic"]):
                    grads = _step_grads_triton(*args, scale)
                else:
                    grads = _step_grads_recompute(*args, opts)
                dq.index_add_(0, idx, grads[0].to(acc_dtype))
            if s == 0:
                if grads is not None:
                    dkv.index_add_(0, step.kv_index, _flat_kv_grads(grads, acc_dtype))
            else:
                if s == 1:  # the first receiver of a message starts its accumulator
                    acc_in = torch.zeros(layout.message_rows, dkv.shape[1], dtype=acc_dtype, device=q.device)
                    acc_out = torch.empty_like(acc_in)
                else:  # the accumulator sent by the previous rank at its previous step
                    _wait(acc_works)
                    acc_in, acc_out = acc_out, acc_in
                if grads is not None:
                    _scatter_add(acc_in, step, _flat_kv_grads(grads, acc_dtype))
                acc_works = _post(plan, acc_in, acc_out, DKV_TAG)
            _wait(works)
            if works:
                cur, nxt = nxt, cur
        if acc_works:  # this rank's own accumulator, back after a full turn
            _wait(acc_works)
            dkv.index_add_(0, layout.own_rows, acc_out[: layout.own_rows.numel()])
        dk = dkv[:, : hk * d].reshape(n, hk, d).to(k.dtype)
        dv_ = dkv[:, hk * d:].reshape(n, hk, dv).to(v.dtype)
        return dq.to(q.dtype), dk, dv_, None, None, None


def _scatter_add(acc: torch.Tensor, step: Step, flat: torch.Tensor) -> None:
    """``acc[kv_index] += flat`` in a fixed order: one pass per repeat of a key row."""
    if not step.kv_passes:  # no row repeats
        acc.index_add_(0, step.kv_index, flat)
        return
    for positions in step.kv_passes:
        acc.index_add_(0, step.kv_index.index_select(0, positions), flat.index_select(0, positions))


def _flat_kv_grads(grads, dtype) -> torch.Tensor:
    dk, dv = grads[1], grads[2]
    return torch.cat([dk.reshape(dk.shape[0], -1), dv.reshape(dv.shape[0], -1)], dim=1).to(dtype)


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
    """The P2P ring executor of `packattn.cp.attention` (arguments checked there).

    Causal (either alignment: the same in global self-attention) or no mask. Deterministic for a
    fixed world size in any case (fixed reduction order); ``deterministic=True`` is passed on to
    every step's backend.
    """
    mask = Mask.make(causal, window, chunk_size)
    if mask.window is not None or mask.chunk_size is not None:
        raise NotImplementedError(f"the P2P ring (strategy 'p2p') runs causal or full masks only, got "
                                  f"{mask.describe()}; use strategy='allgather' for windows and chunks")
    layout = plan.cached(("p2p", mask.causal, str(q.device)), lambda: build_layout(plan, mask.causal, q.device))
    opts = dict(scale=scale, backend=backend, deterministic=deterministic)
    if layout.local_only:  # nothing travels and nothing to merge (e.g. whole documents): one local call
        res = packattn.attention(q, k, v, layout.steps[0].seqs, causal=layout.steps[0].mask.causal,
                                 return_lse=return_lse, **opts)
        return (res[0], res[1].float()) if return_lse else res  # lse float32 on every rank, as the ring's
    out, lse = _Ring.apply(q, k, v, plan, layout, opts)
    return (out, lse) if return_lse else out
