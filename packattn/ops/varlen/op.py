"""The varlen attention op: its plans, ``torch.library`` custom ops, fake implementations and autograd.

The forward and backward are custom ops (``packattn::varlen_fwd`` / ``packattn::varlen_bwd``) with fake
implementations and registered autograd, so torch.compile keeps them in one graph; eager calls run the
same implementations through a plain autograd function (`packattn.ops.runtime.fast_op`: the custom-op
machinery costs host time). The backward is deterministic by construction (no atomics, see
`packattn.ops.varlen.bwd_triton`).

Which kernels run is decided once per call from dtypes, shapes, device, the batch's length class and the mask:
`forward_plan` (the forward's kernel and config, its tile tables and the backward's) and `bwd_plan` (the
backward passes). The forward builds the backward's tile tables, so the backward checks that its plan is
still the forward's (`check_plan`: a `configs.override` left in between would break that).

Across the op boundary the mask travels as integers (`launch.mask_options`, rebuilt once per call with
`launch.mask_from_options`). The tables and the integer options travel in one list each: the autograd
wrapper of a custom op re-reads the schema once per argument on every call, a cost that grows with the
square of the argument count (benchmarks/NOTES.md, v10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packattn.lengths import short_batch
from packattn.mask import Mask
from packattn.ops.runtime import fast_op
from packattn.ops.runtime.launch import MASK_FIELDS, MASK_OPTIONS, _last_dim_contiguous, mask_from_options, mask_options
from packattn.ops.runtime.sm90 import dims_key, sm90_runs
from packattn.ops.varlen import configs, launch_sm90, launch_triton
from packattn.ops.varlen.launch_triton import new_output
from packattn.ops.varlen.tiles import tile_table
from packattn.varlen import Varlen

FWD_TABLES = ("cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv", "q_tiles", "dq_tiles", "dkdv_tiles")
FWD_OPTIONS = (*MASK_FIELDS, "padded_q", "padded_kv", "long_seqs", "gluon", "short_seqs")
BWD_TABLES = ("cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv", "dq_tiles", "dkdv_tiles")
BWD_OPTIONS = (*MASK_FIELDS, "padded_q", "padded_kv", "short_seqs")
# the fields read one at a time (both lists start with the mask's fields and the padding flags)
_PADDED_Q, _PADDED_KV = FWD_OPTIONS.index("padded_q"), FWD_OPTIONS.index("padded_kv")
_FWD_SHORT_SEQS, _BWD_SHORT_SEQS = FWD_OPTIONS.index("short_seqs"), BWD_OPTIONS.index("short_seqs")


def batch_options(seqs: Varlen, mask: Mask, *fields) -> list:
    """The options of a call on this batch: the mask's integers (`launch.mask_options`), ``padded_q``,
    ``padded_kv``, then ``fields`` (the rest of `FWD_OPTIONS` or of `BWD_OPTIONS`)."""
    return [*mask_options(mask), seqs.cu_seqlens_q_padded is not None, seqs.cu_seqlens_kv_padded is not None,
            *fields]


def bwd_options(options: list[int], short_seqs: bool) -> list[int]:
    """`BWD_OPTIONS` from ``options`` that start with the mask's fields and the padding flags (`FWD_OPTIONS`,
    the traced op's `packattn.ops.varlen.traced.VARLEN_OPTIONS`) and ``short_seqs``."""
    return [*options[:_PADDED_KV + 1], short_seqs]


def read_options(options: list[int]) -> tuple[Mask, list[int]]:
    """``(mask, the fields after the mask's)`` of an options list (`FWD_OPTIONS`, `BWD_OPTIONS`,
    `packattn.ops.varlen.traced.VARLEN_OPTIONS`: each starts with `launch.MASK_FIELDS`)."""
    return mask_from_options(*options[:MASK_OPTIONS]), options[MASK_OPTIONS:]


# ---------------------------------------------------------------- plans
@dataclass(frozen=True)
class BwdPlan:
    """The two backward passes for some tensors (`bwd_plan`): the Gluon configs, None for the Triton pass,
    and each pass's ``(rows per tile, columns per step, gluon)`` -- the blocks its tile table is built with."""
    dkdv: configs.GluonBwdConfig | None
    dq: configs.GluonBwdConfig | None
    dkdv_choice: tuple[int, int, bool]  # (keys per tile, queries per step, gluon)
    dq_choice: tuple[int, int, bool]  # (queries per tile, keys per step, gluon)
    short_seqs: bool = False  # a batch of short sequences (the Gluon passes' configs and work order)


def bwd_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, short_seqs: bool = False) -> BwdPlan:
    """The backward passes on these tensors: the Gluon dK/dV (`configs.dkdv_config`) and dQ (`configs.dq_config`)
    where the sm_90 kernels may run (`sm90.sm90_runs`, strides aside: the launchers copy), else the Triton ones."""
    gluon = sm90_runs(q, k, v, False, configs.GLUON_HEAD_DIMS, configs.GLUON_DTYPES)
    key = dims_key(q.shape[-1], v.shape[-1])  # MLA: the tables name (d, d_v)
    dkdv = configs.dkdv_config(key, q.shape[1] // k.shape[1]) if gluon else None
    dq = configs.dq_config(key, short_seqs) if gluon else None
    triton_dkdv = dkdv or configs.triton_config("dkdv", q, v)
    triton_dq = dq or configs.triton_config("dq", q, v)
    return BwdPlan(dkdv, dq, (triton_dkdv.block_n, triton_dkdv.block_m, dkdv is not None),
                   (triton_dq.block_m, triton_dq.block_n, dq is not None), short_seqs)


def check_plan(forward_plan: BwdPlan, now: BwdPlan) -> None:
    """Raise when the backward would run other passes than those whose tile tables the forward built."""
    _check_choice("dK/dV", "keys x", "queries", forward_plan.dkdv_choice, now.dkdv_choice)
    _check_choice("dQ", "queries x", "keys", forward_plan.dq_choice, now.dq_choice)


def _check_choice(name: str, rows: str, cols: str, forward_choice: tuple, now: tuple) -> None:
    if now != forward_choice:
        def say(choice):
            return f"{'Gluon' if choice[2] else 'Triton'} {name} with {choice[0]} {rows} {choice[1]} {cols}"

        raise RuntimeError(
            f"the {name} pass changed between forward and backward ({say(forward_choice)} -> {say(now)}): "
            "PACKATTN_PORTABLE or a configs.override changed after the forward; keep them until the backward")


def bwd_tables(seqs: Varlen, mask: Mask, plan: BwdPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq_tiles, dkdv_tiles)``: the tile tables of ``plan``'s dQ and dK/dV passes on this batch."""
    return tile_table(seqs, mask, False, *plan.dq_choice[:2]), tile_table(seqs, mask, True, *plan.dkdv_choice[:2])


def gluon_fwd_config(q, v, mask: Mask, long_seqs: bool, short_seqs: bool):
    """The Gluon forward's config for this call: head dims, the batch's length class and the mask (one place for
    the plan, whose tile table takes its blocks, and the launch)."""
    return configs.config_for(dims_key(q.shape[-1], v.shape[-1]), bool(long_seqs), bool(short_seqs), q.device,
                              not mask.is_full)


def forward_plan(q, k, v, seqs: Varlen, mask: Mask, need_grad: bool) -> tuple[list, list]:
    """``(tables, options)`` of `_varlen_fwd` for this batch (`FWD_TABLES`, `FWD_OPTIONS`): the forward kernel
    and config its lengths and mask take (`gluon_fwd_config`), its tile tables, and with ``need_grad`` the
    backward's (`bwd_plan`)."""
    long_seqs = seqs.max_seqlen_q >= configs.LONG_SEQLEN
    short_seqs = short_batch(seqs.max_seqlen_q, seqs.max_seqlen_kv)
    gluon = (seqs.max_seqlen_q >= configs.GLUON_MIN_SEQLEN
             and sm90_runs(q, k, v, True, configs.GLUON_FWD_HEAD_DIMS, configs.GLUON_DTYPES))
    if gluon:
        fwd = gluon_fwd_config(q, v, mask, long_seqs, short_seqs)
    else:
        fwd = configs.triton_config("fwd", q, v, long_seqs)
    q_tiles = tile_table(seqs, mask, False, fwd.block_m, fwd.block_n)
    if need_grad:
        dq_tiles, dkdv_tiles = bwd_tables(seqs, mask, bwd_plan(q, k, v, short_seqs))
    else:
        dq_tiles = dkdv_tiles = q_tiles[:0]
    tables = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv, q_tiles, dq_tiles, dkdv_tiles]
    return tables, batch_options(seqs, mask, long_seqs, gluon, short_seqs)


# ---------------------------------------------------------------- forward
def _varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[torch.Tensor],
    pad_rows_q: torch.Tensor | None, pad_rows_kv: torch.Tensor | None, scale: float, options: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``. ``tables``: `FWD_TABLES` (``dq_tiles`` / ``dkdv_tiles``, like ``pad_rows_kv``, only
    carried for the backward); ``options``: `FWD_OPTIONS` (``long_seqs``, ``gluon``, ``short_seqs``: the kernel
    and config ``q_tiles`` was built for). ``pad_rows_*``: the rows in no sequence (`Varlen.padding_rows`), or
    None. ``scale >= 0``."""
    mask, (padded_q, _padded_kv, long_seqs, gluon, short_seqs) = read_options(options)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    total_q, heads_q, head_dim = q.shape
    # rows in no sequence are never written by the kernels: they must start as zeros / -inf
    out = new_output((total_q, heads_q, v.shape[-1]), q.dtype, q.device, padded_q, pad_rows_q)  # as the fake says
    lse = new_output((heads_q, total_q), torch.float32, q.device, padded_q, pad_rows_q, float("-inf"), dim=1)
    seq_args, q_tiles = tables[:4], tables[4]
    if gluon:
        cfg = gluon_fwd_config(q, v, mask, long_seqs, short_seqs)
        launch_sm90.gluon_fwd(q, k, v, out, lse, seq_args, q_tiles, scale, mask, cfg, bool(short_seqs))
    else:
        launch_triton.triton_fwd(q, k, v, out, lse, seq_args, q_tiles, scale, mask, bool(long_seqs))
    return out, lse


varlen_fwd = torch.library.custom_op("packattn::varlen_fwd", _varlen_fwd, mutates_args=())


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, *rest):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


# ---------------------------------------------------------------- backward
def _varlen_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, tables: list[torch.Tensor], pad_rows_q: torch.Tensor | None,
    pad_rows_kv: torch.Tensor | None, scale: float, options: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: dK/dV pass + separate dQ pass, deterministic (fixed reduction order, no atomics; a dQ
    fused into the dK/dV pass through atomics measured slower, benchmarks/NOTES.md v2). ``tables``:
    `BWD_TABLES`; ``options``: `BWD_OPTIONS`; ``lse`` / ``out`` may be those of a larger attention this one is
    a part of (`backward_with_stats`). The passes are `bwd_plan`'s."""
    return _varlen_bwd_planned(bwd_plan(q, k, v, bool(options[_BWD_SHORT_SEQS])), dout, dlse, q, k, v, out, lse,
                               tables, pad_rows_q, pad_rows_kv, scale, options)


def _varlen_bwd_planned(plan: BwdPlan, dout, dlse, q, k, v, out, lse, tables, pad_rows_q, pad_rows_kv,
                        scale: float, options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_varlen_bwd` running the passes of ``plan``: the preprocess (`launch_triton.bwd_delta`), the dK/dV pass,
    the dQ pass; or, where `fuses_delta` says so, the dQ pass computing delta, then the dK/dV pass."""
    mask, (padded_q, padded_kv, _short_seqs) = read_options(options)
    dout, q, k, v, out = (_last_dim_contiguous(dout), _last_dim_contiguous(q), _last_dim_contiguous(k),
                          _last_dim_contiguous(v), _last_dim_contiguous(out))
    lse = lse.contiguous()
    seq_args, dq_tiles, dkdv_tiles = tables[:4], tables[4], tables[5]
    # Outputs are allocated right before the pass that writes them: the first pass starts on the GPU sooner
    # (a short batch's backward is host-bound).
    def new_dkdv():
        return (new_output(k.shape, k.dtype, k.device, padded_kv, pad_rows_kv),
                new_output(v.shape, v.dtype, v.device, padded_kv, pad_rows_kv))

    if fuses_delta(plan, dlse):  # no preprocess: the dQ pass writes delta, then the dK/dV pass reads it
        delta = torch.zeros_like(lse)  # (rows of tiles without key blocks: never written, read with P = 0)
        dq = new_output(q.shape, q.dtype, q.device, padded_q, pad_rows_q)
        launch_sm90.gluon_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask, plan.dq,
                             plan.short_seqs, out=out)
        dk, dv = new_dkdv()
        launch_sm90.gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, mask, plan.dkdv,
                               plan.short_seqs)
        return dq, dk, dv
    delta = launch_triton.bwd_delta(out, dout, lse, dlse)
    dk, dv = new_dkdv()
    if plan.dkdv is not None:
        launch_sm90.gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, mask, plan.dkdv,
                               plan.short_seqs)
    else:
        launch_triton.triton_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, mask)
    dq = new_output(q.shape, q.dtype, q.device, padded_q, pad_rows_q)  # contiguous, as the fake says
    if plan.dq is not None:
        launch_sm90.gluon_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask, plan.dq,
                             plan.short_seqs)
    else:
        launch_triton.triton_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask)
    return dq, dk, dv


def fuses_delta(plan: BwdPlan, dlse: torch.Tensor | None) -> bool:
    """Does the backward skip the preprocess and let the dQ pass compute delta (`launch_sm90.gluon_dq` with O)?
    Yes when both passes are the Gluon ones (the dK/dV pass reads delta only on rows of sequences and takes
    P = 0 where lse = -inf), the dQ config fuses it (`configs.GluonBwdConfig.fused_delta`) and there is no
    ``dlse`` (its term stays in the preprocess). The dQ pass then runs
    first, on ``delta = zeros_like(lse)``: the rows of tiles without any key block keep 0, which P = 0 cancels
    (uninitialised memory could hold NaN, and 0 * NaN is NaN). The float32 row sums run in another order than
    the preprocess's: results are close to, not bitwise, the unfused backward's."""
    return dlse is None and plan.dkdv is not None and plan.dq is not None and plan.dq.fused_delta


varlen_bwd = torch.library.custom_op("packattn::varlen_bwd", _varlen_bwd, mutates_args=())


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, tables, pad_rows_q, pad_rows_kv, scale, options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tables[:4], tables[5], tables[6], pad_rows_q, pad_rows_kv)
    short_seqs = bool(options[_FWD_SHORT_SEQS])
    ctx.scale, ctx.options = scale, bwd_options(options, short_seqs)
    ctx.plan = bwd_plan(q, k, v, short_seqs)  # what dq_tiles / dkdv_tiles were built for (checked in the backward)
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: no dlse term in the backward


def _backward_through(bwd):
    """The backward of ``packattn::varlen_fwd`` computing its gradients with ``bwd(plan, *args)``: the
    ``packattn::varlen_bwd`` op (which derives the plan again), or on the eager path its implementation
    with the plan decided here (once per call: the backward runs on autograd's device thread, where host
    time costs most)."""

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tables, pad_rows_q, pad_rows_kv = ctx.saved_tensors
        plan = bwd_plan(q, k, v, ctx.plan.short_seqs)
        check_plan(ctx.plan, plan)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(plan, dout, dlse, q, k, v, out, lse, tables, pad_rows_q, pad_rows_kv, ctx.scale, ctx.options)
        # the same structure as the inputs: q, k, v, tables, pad_rows_q, pad_rows_kv, scale, options
        return dq, dk, dv, [None] * len(FWD_TABLES), None, None, None, None

    return backward


varlen_fwd.register_autograd(_backward_through(lambda plan, *args: varlen_bwd(*args)), setup_context=_setup_context)
_VarlenFwdEager = fast_op.eager_function(_varlen_fwd, _setup_context, _backward_through(_varlen_bwd_planned))


# ---------------------------------------------------------------- entry points
def attention(q, k, v, seqs: Varlen, mask: Mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of varlen attention, differentiable (eagerly through `fast_op`); ``scale >= 0``."""
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    tables, options = forward_plan(q, k, v, seqs, mask, need_grad)
    padded_q, padded_kv = options[_PADDED_Q], options[_PADDED_KV]
    return fast_op.call(varlen_fwd, _VarlenFwdEager.apply, q, k, v, tables,
                        seqs.padding_rows("q") if padded_q else None, seqs.padding_rows("kv") if padded_kv else None,
                        scale, options)


def backward_with_stats(q, k, v, seqs: Varlen, mask: Mask, out, lse, dout, dlse, scale: float):
    """``(dq, dk, dv)`` of varlen attention taken with the softmax statistics ``out`` / ``lse`` of a larger
    attention this one is a part of (`Backend.backward_from_stats`: ``lse`` float32 ``(heads_q, total_q)``, as
    the kernels read it; the backward makes it contiguous); ``scale >= 0``. The passes and tile tables are those
    the backward of this batch takes (`bwd_plan`)."""
    short_seqs = short_batch(seqs.max_seqlen_q, seqs.max_seqlen_kv)
    plan = bwd_plan(q, k, v, short_seqs)
    tables = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv, *bwd_tables(seqs, mask, plan)]
    options = batch_options(seqs, mask, short_seqs)
    padded_q, padded_kv = options[_PADDED_Q], options[_PADDED_KV]
    return fast_op.call(varlen_bwd, _varlen_bwd, dout, dlse, q, k, v, out, lse, tables,
                        seqs.padding_rows("q") if padded_q else None, seqs.padding_rows("kv") if padded_kv else None,
                        scale, options)
