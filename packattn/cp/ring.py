"""P2P ring context parallelism (strategy ``"p2p"``): K/V blocks travel around the ranks while
every rank attends its own queries to the block it holds, merging the partial results through
their log-sum-exp (ring attention).

Rows. Each document is cut into pieces (`packattn.cp.plan`); a rank holds some pieces of some
documents, in ascending global row order. Pieces of one document on one rank are contiguous in
its local rows (nothing else lies between them), and the keys a piece needs from another rank
are a run of that rank's pieces of the same document.

Steps. There are ``world`` steps; at step ``s`` a rank holds the K/V of source rank
``src = (rank - s) % world``. A step is a few *parts*, each one `packattn.attention` call: local
sequences (a block of local query rows against a block of the held key rows) under one mask.

Causal or no mask: visibility is whole pieces, one part per step.

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

Windows and ``chunk_size``: visibility cuts through pieces, so every step (step 0 too) pairs each
query piece with each key piece of its document that the rank holds at that step. With
``chunk_size`` the pieces are first cut at the chunk boundaries (global multiples of ``chunk_size``
from the document start) and only pieces of the same chunk are paired: inside one chunk the chunk
rule holds for every (query, key), so no local mask below has a chunk rule. A pair is trimmed to
``[qa, qb) x [ka, kb)``: the keys some of its queries see (`mask.block_key_range`) and the queries
that see some of those (`mask.block_query_range`); an empty one is skipped, no compute. What is
left is one local sequence in one of three parts (``l, r``: the window's left and right, causal
meaning ``r = 0``; bottom-right alignment puts local query ``i`` at key
``i + len_kv - len_q``):

* ``full``, no mask: every query of the rectangle sees every key;
* ``self``, the call's mask without its chunk rule: a piece (cut at chunks) of step 0 with itself;
* ``edge``, window ``(0, -1)`` (key ``j`` visible iff ``j >= i + len_kv - len_q``): keys before
  the queries (``kb <= qa``) seen through the left window, ``g >= p - l``. The local queries are
  ``[qa, kb + l)`` over the keys ``[ka, kb)``, which puts query ``p`` at key position ``p - l``:
  exactly the global rule. Rows ``[qb, kb + l)`` are dummy queries (``qb <= kb + l``: later
  queries see none of the keys). Keys after the queries (``ka >= qb``, a non-causal right
  window: ``g <= p + r``) are the same problem mirrored (positions ``x -> -1 - x``, so the rule
  reads ``g' >= p' - r``): queries and keys in descending order, local queries ``[qa', kb' + r)``
  in mirrored positions, the dummy rows being the positions ``[ka - r, qa)``.

Dummy queries are zero rows whose results are dropped; their gradients are zero (zero ``dout``
and ``dlse``), so they only cost compute: fewer rows than the sequence has keys, since an edge
pair is only partly visible. A query row can be in several sequences of one part (a piece seeing
two pieces of a source): its results merge, and its dq adds, in duplicate-free passes.

Each part returns ``(out_s, lse_s)``; the running result is merged through the log-sum-exp in
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
who adds it to its own step-0 gradient. Per part, two ways to get its dq/dk/dv:

* when the backend the part resolves to (`packattn.dispatch`) has a backward with given
  statistics (`Backend.backward_from_stats`; the triton backend does): that backward with the
  GLOBAL out and lse, whose softmax and ``delta = rowsum(dout * out) - dlse`` are then the global
  ones: no recompute;
* any other backend: recompute ``(out_s, lse_s)`` with autograd and take gradients with
  ``grad_out = w_s * dout`` and ``grad_lse = w_s * (rowsum(dout * (out_s - out)) + dlse)``,
  ``w_s = exp(lse_s - lse)`` (exactly the chain rule through the merge).

Reduction order is fixed (dq: steps, then parts, in order; dK/dV of a row: its owner's step 0,
then the ranks after it around the ring; a row used by several sequences of a part is merged or
scattered in a fixed sequence of duplicate-free passes), so results are deterministic for a fixed
world size whether or not ``deterministic=True``; that flag is passed on to every part's backend.

When no document is shared by ranks (nothing travels), every local document is one whole piece and
step 0 is one sequence per document under the call's mask, windows and chunks included.
Everything host-side (steps, pairs, index maps, descriptors) is built once per plan and mask and
cached on the plan, so a call does no host work and no host sync on CUDA.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import packattn
from packattn import dispatch
from packattn.api import resolve_scale
from packattn.backends.base import Backend, Problem
from packattn.cp.executor import Call
from packattn.cp.plan import CPPlan
from packattn.cp.ring_layout import Part, RingLayout, Rows, _take, _with_zero_row, build_layout

KV_TAG, DKV_TAG = 1, 2  # P2P tags of the K/V and dK/dV messages (gloo matches on them; NCCL ignores them)


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
def _kv_of_part(src: int, part: Part, kv_local, kv_message, hk: int, d: int, dv: int):
    """The part's K and V buffers, from the local rows (step 0, ``src`` -1) or the message held."""
    buf = part.kv.gather(kv_local if src < 0 else kv_message)
    return buf[:, : hk * d].reshape(-1, hk, d), buf[:, hk * d:].reshape(-1, hk, dv)


def _attend(q, k, v, part: Part, opts: dict, return_lse: bool = True):
    """``(out, lse)`` (``out`` without ``return_lse``) of one part's sequences: `packattn.attention`
    with the part's mask."""
    mask = part.mask
    causal = "top_left" if mask.causal and mask.align == "top_left" else mask.causal
    return packattn.attention(q, k, v, part.seqs, causal=causal, window=mask.window, chunk_size=mask.chunk_size,
                              return_lse=return_lse, **opts)


def _weights(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_part - lse)``; 0 where ``lse_part`` is -inf (then lse may be -inf too)."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse_part - safe)


def _merge(acc: torch.Tensor, lse_acc: torch.Tensor, rows: Rows, out: torch.Tensor, lse: torch.Tensor):
    """Fold one part's ``(out, lse)`` into the running result of its query rows, in place (dummy
    rows dropped; a row in several sequences merged once per pass; a pass that is the first to
    write its rows copies)."""
    for (positions, index), first in zip(rows.groups(), rows.first):
        out_p, lse_p = _take(out, positions), _take(lse, positions, 1)
        if rows.span is not None:  # the rows are a run: merge into views of the result
            _merge_into(acc.narrow(0, *rows.span), lse_acc.narrow(1, *rows.span), out_p, lse_p, first)
        elif first:
            acc.index_copy_(0, index, out_p.to(acc.dtype))
            lse_acc.index_copy_(1, index, lse_p.to(lse_acc.dtype))
        else:
            old_out, old_lse = acc.index_select(0, index), lse_acc.index_select(1, index)
            _merge_into(old_out, old_lse, out_p, lse_p, False)
            acc.index_copy_(0, index, old_out)
            lse_acc.index_copy_(1, index, old_lse)


def _merge_into(acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, first: bool):
    """``(acc, lse_acc) <- merge((acc, lse_acc), (out, lse))`` in place (rows aligned); ``first``:
    nothing was written to these rows yet (acc 0, lse -inf), so the merge is a copy."""
    if first:
        acc.copy_(out)
        lse_acc.copy_(lse)
        return
    lse = lse.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse)
    w_old, w_new = _weights(lse_acc, new_lse).t()[..., None], _weights(lse, new_lse).t()[..., None]
    acc.mul_(w_old).addcmul_(out, w_new)
    lse_acc.copy_(new_lse)


def _part_backend(part: Part, q, k, v, opts: dict) -> Backend:
    """The backend `packattn.attention` runs this part on with gradients (dispatch keys it as it keys that call)."""
    params = dispatch.call_params(part.seqs, device_type=q.device.type, dtype=q.dtype, heads_q=q.shape[1],
                                  heads_kv=k.shape[1], head_dim=q.shape[2], head_dim_v=v.shape[2], mask=part.mask,
                                  return_lse=True, deterministic=opts["deterministic"], requires_grad=True)
    return dispatch.select(params, opts["backend"])


def _step_grads(part: Part, backend: Backend, q_s, k_s, v_s, dout_s, dlse_s, out_g, lse_g, scale: float, opts: dict):
    """dq, dk, dv of one part: the backend's backward with the merged (global) out and lse when it has one
    (`Backend.backward_from_stats`: its softmax and delta are then the global ones, no recompute), else
    `_step_grads_recompute`."""
    problem = Problem(q_s, k_s, v_s, part.seqs, part.mask, scale, True, opts["deterministic"])
    grads = backend.backward_from_stats(problem, out_g, lse_g.float().contiguous(), dout_s, dlse_s)
    if grads is None:
        grads = _step_grads_recompute(part, q_s, k_s, v_s, dout_s, dlse_s, out_g, lse_g, opts)
    return grads


def _step_grads_recompute(part: Part, q_s, k_s, v_s, dout_s, dlse_s, out_g, lse_g, opts: dict):
    """dq, dk, dv of one part: recompute its (out, lse) with autograd and apply the chain rule
    through the merge (``out_g``, ``lse_g``: the merged result's rows of this part; zeros for
    dummy rows, whose zero ``dout_s`` and ``dlse_s`` make their gradients zero)."""
    with torch.enable_grad():
        q_s, k_s, v_s = (t.detach().requires_grad_() for t in (q_s, k_s, v_s))
        o, lo = _attend(q_s, k_s, v_s, part, opts)
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
        queries = _with_zero_row(q) if layout.dummies else q
        for s, step in enumerate(layout.steps):
            works = _post(plan, cur, nxt, KV_TAG) if s + 1 < len(layout.steps) else []
            for part in step.parts:
                k_s, v_s = _kv_of_part(step.src, part, kv_local, cur, hk, d, dv)
                out_s, lse_s = _attend(part.q.gather(queries), k_s, v_s, part, opts)
                _merge(acc, lse, part.q, out_s, lse_s)
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
        scale = resolve_scale(opts["scale"], d)
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
        per_row = [(q, 0), (dout, 0), (dlse, 1), (out, 0), (lse, 1)]  # what parts read per query row; row dim
        if layout.dummies:
            per_row = [(_with_zero_row(t, dim), dim) for t, dim in per_row]
        for s, step in enumerate(layout.steps):
            works = _post(plan, cur, nxt, KV_TAG) if s < last else []
            if s == 1:  # the first receiver of a message starts its accumulator
                acc_in = torch.zeros(layout.message_rows, dkv.shape[1], dtype=acc_dtype, device=q.device)
                acc_out = torch.empty_like(acc_in)
            elif s > 1:  # the accumulator sent by the previous rank at its previous step
                _wait(acc_works)
                acc_in, acc_out = acc_out, acc_in
            for part in step.parts:
                k_s, v_s = _kv_of_part(step.src, part, kv_local, cur, hk, d, dv)
                q_s, dout_s, dlse_s, out_s, lse_s = (part.q.gather(t, dim) for t, dim in per_row)
                backend = _part_backend(part, q, k, v, opts)
                grads = _step_grads(part, backend, q_s, k_s, v_s, dout_s, dlse_s, out_s, lse_s, scale, opts)
                part.q.add_to(dq, grads[0].to(acc_dtype))
                part.kv.add_to(dkv if s == 0 else acc_in, _flat_kv_grads(grads, acc_dtype))
            if s > 0:
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


def _flat_kv_grads(grads, dtype) -> torch.Tensor:
    dk, dv = grads[1], grads[2]
    return torch.cat([dk.reshape(dk.shape[0], -1), dv.reshape(dv.shape[0], -1)], dim=1).to(dtype)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, call: Call):
    """The P2P ring executor (`packattn.cp.executor`).

    Every mask: causal (either alignment: the same in global self-attention), windows, chunks, or
    none. Deterministic for a fixed world size in any case (fixed reduction order);
    ``deterministic=True`` is passed on to every part's backend.
    """
    mask = dataclasses.replace(call.mask, align="bottom_right")  # self-attention
    layout = plan.cached(("p2p", mask, str(q.device)), lambda: build_layout(plan, mask, q.device))
    opts = call.options()
    if layout.local_only:  # nothing travels and nothing to merge (e.g. whole documents): one local call
        res = _attend(q, k, v, layout.steps[0].parts[0], opts, call.return_lse)
        return (res[0], res[1].float()) if call.return_lse else (res, None)  # lse float32 on every rank
    out, lse = _Ring.apply(q, k, v, plan, layout, opts)
    return out, (lse if call.return_lse else None)
