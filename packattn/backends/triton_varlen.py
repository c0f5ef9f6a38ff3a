"""Triton varlen flash attention: tile tables, launchers, ``torch.library`` custom ops, the backend.

Kernels live in `packattn.ops.varlen.fwd_triton` / `varlen_bwd`; their launch configurations and the
launch with retry in `packattn.ops.runtime.launch`. Per batch (cached on the `Varlen`
through `Varlen.cached`, keyed by mask and block sizes) the launcher builds *tile tables* with
device ops only: one int32 row ``[seq, start, lo, mid_lo, mid_hi, hi]`` per (sequence, block),
with the block's visible range on the other side from `packattn.mask` (`block_key_range` for
query tiles, `block_query_range` for key tiles) and the fully visible band ``[mid_lo, mid_hi)``
that needs no element mask. The number of tiles is bounded on the host by
``cdiv(total, BLOCK) + num_seqs`` (no sync); surplus rows have ``seq = -1`` and their programs
exit. Rows are sorted longest-range-first so long documents do not start last.

The forward and backward are ``torch.library.custom_op``s (``packattn::varlen_fwd`` /
``packattn::varlen_bwd``) with fake implementations and registered autograd, so torch.compile
keeps them in one graph; eager calls run the same implementations through a plain autograd
function (`packattn.ops.runtime.fast_op`: the custom-op machinery costs host time). The backward is
deterministic by construction (no atomics; see `packattn.ops.varlen.bwd_triton`). Float32 inputs use ``tl.dot(..., input_precision="ieee")``:
exact float32 products (no TF32), slower than TF32 on tensor cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packattn import env
from packattn import mask as masks
from packattn.ops.runtime import fast_launch
from packattn.ops.runtime import fast_op
from packattn.ops.varlen import launch_sm90_bwd as triton_bwd_gluon
from packattn.ops.varlen import launch_sm90_fwd as triton_fwd_gluon
from packattn.backends.base import Problem
from packattn.lengths import SHORT_SEQLEN, short_batch  # noqa: F401 (re-exported)
from packattn.backends.triton_base import TritonBackend, device_unsupported, interpreting
from packattn.ops.runtime.launch import (  # noqa: F401 (configs re-exported: benchmarks, scripts)
    FALLBACK_CONFIGS, FP32_CONFIGS, HOPPER_CONFIGS, PREPROCESS_BLOCK_M, LaunchConfig, _last_dim_contiguous, _launch,
    _mask_constexprs, _precision, _reduced_stages, block_d, launch_config,
)
from packattn.varlen import Varlen

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_FIELDS = 6  # seq, start, lo, mid_lo, mid_hi, hi
# Some sequence with >= LONG_SEQLEN queries: the forward takes its long-sequence configs
# (`triton_launch.HOPPER_LONG_FWD_CONFIGS`, where the measurements are; `triton_fwd_gluon.config_for`).
LONG_SEQLEN = 8192
# SHORT_SEQLEN / short_batch (`packattn.lengths`, shared with dispatch): the Gluon forward and dQ take
# their short-sequence configs at d = 128 (`triton_fwd_gluon.SHORT_CONFIGS`, `triton_bwd_gluon.DQ_SHORT_CONFIGS`).


# ---------------------------------------------------------------- tile tables (per batch, device ops only)
def build_tile_table(seqs: Varlen, mask: masks.Mask, by_keys: bool, block: int, step: int) -> torch.Tensor:
    """``int32 (cdiv(total, block) + num_seqs, 6)`` rows ``[seq, start, lo, mid_lo, mid_hi, hi]``.

    Query tiles (``by_keys=False``): ``block`` queries from ``start``; keys ``[lo, hi)`` may be
    visible; key blocks ``mid_lo, mid_lo + step, ... < mid_hi`` are visible to every query.
    Key tiles (``by_keys=True``): the same with the roles of queries and keys swapped.
    """
    n = seqs.num_seqs
    total = seqs.total_kv if by_keys else seqs.total_q
    bound = -(-total // block) + n
    device = seqs.device
    if n == 0:
        return torch.full((bound, TILE_FIELDS), -1, dtype=torch.int32, device=device)
    len_q, len_kv = seqs.seqlens_q.long(), seqs.seqlens_kv.long()
    own_len = len_kv if by_keys else len_q
    blocks = (own_len + block - 1) // block
    ends = torch.cumsum(blocks, 0)
    tile = torch.arange(bound, device=device)
    seq = torch.searchsorted(ends, tile, right=True)
    real = seq < n
    seq = seq.clamp(max=n - 1)
    start = (tile - ends[seq] + blocks[seq]) * block
    lq, lk = len_q[seq], len_kv[seq]
    if by_keys:
        lo, hi, full_lo, full_hi = masks.block_query_range(mask, start, torch.minimum(start + block, lk), lq, lk)
    else:
        lo, hi, full_lo, full_hi = masks.block_key_range(mask, start, torch.minimum(start + block, lq), lq, lk)
    # Rows past the real end of a partial tile are never stored, and each stored row only depends
    # on its own (row, other side) pairs, so the band is computed from the real rows alone.
    empty = (lo >= hi) | ~real
    lo = torch.where(empty, 0, lo)
    hi = torch.where(empty, 0, hi)
    mid_lo, mid_hi = unmasked_band(lo, hi, full_lo, full_hi, step, empty)
    seq = torch.where(real, seq, -1)
    work = torch.where(real, hi - lo, -1)
    order = torch.argsort(work, descending=True, stable=True)  # longest first, surplus last
    table = torch.stack([seq, start, lo, mid_lo, mid_hi, hi], dim=1)[order]
    return table.to(torch.int32).contiguous()


def unmasked_band(lo, hi, full_lo, full_hi, step: int, empty):
    """``(mid_lo, mid_hi)``: the blocks on the grid ``lo + i * step`` lying entirely inside the fully
    visible range ``[full_lo, full_hi)``; ``mid_lo = mid_hi = hi`` where there is none (or ``empty``)."""
    mid_lo = lo + (full_lo - lo).clamp(min=0).add(step - 1).div(step, rounding_mode="floor") * step
    band_blocks = (full_hi - mid_lo).clamp(min=0).div(step, rounding_mode="floor")
    has_band = ~empty & (full_lo < full_hi) & (band_blocks > 0)
    mid_hi = torch.where(has_band, mid_lo + band_blocks * step, hi)
    mid_lo = torch.where(has_band, mid_lo, hi)
    return mid_lo, mid_hi


def tile_table(seqs: Varlen, mask: masks.Mask, by_keys: bool, block: int, step: int) -> torch.Tensor:
    key = ("triton_varlen_tiles", mask, by_keys, block, step)
    return seqs.cached(key, lambda: build_tile_table(seqs, mask, by_keys, block, step))


# ---------------------------------------------------------------- launchers
# The forward carries its per-batch tables in one list and its integer options in another: the
# autograd wrapper of a custom op re-reads the schema once per argument on every call
# (torch._library.utils.fill_defaults), a cost that grows with the square of the argument count
# (~0.2 ms of host time per call with 21 arguments).
FWD_TABLES = ("cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv", "q_tiles", "dq_tiles", "dkdv_tiles")
FWD_OPTIONS = ("window_left", "window_right", "chunk_size", "top_left", "padded_q", "padded_kv", "long_seqs", "gluon",
               "short_seqs")


def _varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[torch.Tensor],
    pad_rows_q: torch.Tensor | None, pad_rows_kv: torch.Tensor | None, scale: float, options: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``. ``tables``: the tensors named in `FWD_TABLES` (``dq_tiles``/``dkdv_tiles``, like
    ``pad_rows_kv``, only carried for the backward); ``options``: the integers named in
    `FWD_OPTIONS`. ``pad_rows_*``: the rows in no sequence (`Varlen.padding_rows`), or None.
    ``long_seqs``, ``gluon``, ``short_seqs``: the forward kernel and config that ``q_tiles`` was built for
    (the Gluon forward when ``gluon``, see `use_gluon_fwd`; ``short_seqs`` also picks the backward's dQ
    config)."""
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, q_tiles = tables[:5]
    window_left, window_right, chunk_size, top_left, padded_q, _padded_kv, long_seqs, gluon, short_seqs = options
    top_left, padded_q, long_seqs, gluon = bool(top_left), bool(padded_q), bool(long_seqs), bool(gluon)

    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    total_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    # rows in no sequence are never written by the kernels: they must start as zeros / -inf
    out = _new_output(q.shape, q.dtype, q.device, padded_q, pad_rows_q)  # contiguous, as the fake says
    lse = _new_output((heads_q, total_q), torch.float32, q.device, padded_q, pad_rows_q, float("-inf"), dim=1)
    if gluon:
        return triton_fwd_gluon.gluon_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, q_tiles,
                                          scale, window_left, window_right, chunk_size, top_left, padded_q, long_seqs,
                                          bool(short_seqs), out=out, lse=lse)
    from packattn.ops.varlen.fwd_triton import varlen_fwd_kernel

    config = launch_config("fwd", head_dim, q.dtype, q.device, long_seqs)
    args = (q, k, v, out, lse, q_tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            heads_q, heads_q // heads_kv, scale * 1.4426950408889634, window_left, window_right, chunk_size)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      INPUT_PRECISION=_precision(q.dtype),
                      **_mask_constexprs(window_left, window_right, chunk_size, top_left))
    _launch(varlen_fwd_kernel, (q_tiles.shape[0] * heads_q,), args, constexprs, config)
    return out, lse


# The Gluon forward runs when some sequence has >= GLUON_MIN_SEQLEN queries. It was 1024 while a Gluon
# launch cost more host time than a ~0.3 ms W8 forward left (results/2026-11-22/probe_w8_gluon_h200.txt);
# with the eager fast path (`fast_op`) W8 (64 x 512 tokens) measured 0.297 ms with it vs 0.495 without
# (results/2026-11-23/bench_v13_w8_gluon_fwd.txt, H200), so it went to 512. Below 512 rows the batch is short
# (SHORT_SEQLEN) and the Gluon forward takes 64 x 64 tiles: 32768 tokens of causal documents of 128 / 256
# rows, forward kernel 209.8 -> 184.4 / 246.2 -> 208.8 us against the Triton one (H200,
# results/2026-11-24/s8_short_docs_gluon_min_h200.txt). Shorter documents are not measured: Triton there.
GLUON_MIN_SEQLEN = 128
ENV_GLUON_MIN_SEQLEN = "PACKATTN_GLUON_MIN_SEQLEN"  # overrides GLUON_MIN_SEQLEN (A/B runs)


def gluon_min_seqlen() -> int:
    return int(env.get(ENV_GLUON_MIN_SEQLEN, GLUON_MIN_SEQLEN))


def use_gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The Gluon Hopper forward (`packattn.ops.varlen.common_sm90`) runs instead of the Triton one
    where it can (sm_90, fp16/bf16, head dim 64/128): measured 1.00-1.13x faster on W1/W2/W4/W8 on
    an H200 (benchmarks/NOTES.md, v8). ``PACKATTN_TRITON_FWD=triton`` keeps the Triton forward."""
    if interpreting() or not q.is_cuda or env.get("PACKATTN_TRITON_FWD") == "triton":
        return False
    return triton_fwd_gluon.gluon_fwd_supported(q, k, v)


@dataclass(frozen=True)
class BwdPlan:
    """The two backward passes for some tensors (`bwd_plan`): the Gluon configs, None for the Triton pass,
    and each pass's ``(rows per tile, columns per step, gluon)`` -- the blocks its tile table is built with."""
    dkdv: triton_bwd_gluon.GluonBwdConfig | None
    dq: triton_bwd_gluon.GluonBwdConfig | None
    dkdv_choice: tuple[int, int, bool]  # (keys per tile, queries per step, gluon)
    dq_choice: tuple[int, int, bool]  # (queries per tile, keys per step, gluon)
    short_seqs: bool = False  # a batch of short sequences (the Gluon passes' work order, `heads_per_section`)


def bwd_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, short_seqs: bool = False) -> BwdPlan:
    """The backward passes `varlen_bwd` runs on these tensors, decided once per call: the Gluon dK/dV
    (`use_gluon_dkdv`) and dQ (`dq_choice`) passes where they can run, else the Triton ones. Depends only
    on dtypes, shapes, device, ``short_seqs`` and the environment, so the forward (which builds the tile
    tables) and the backward agree unless a switch changed in between (`check_plan`)."""
    possible = _gluon_bwd_possible(q, k, v)
    dkdv = _gluon_dkdv_config(q, k, possible)
    dq = _gluon_dq_config(q, possible, short_seqs)
    triton_dkdv = dkdv or launch_config("dkdv", q.shape[-1], q.dtype, q.device)
    triton_dq = dq or launch_config("dq", q.shape[-1], q.dtype, q.device)
    return BwdPlan(dkdv, dq, (triton_dkdv.block_n, triton_dkdv.block_m, dkdv is not None),
                   (triton_dq.block_m, triton_dq.block_n, dq is not None), short_seqs)


def dq_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, short_seqs: bool = False) -> tuple[int, int, bool]:
    """``(queries per tile, keys per step, gluon)`` of the dQ pass `varlen_bwd` runs on these tensors:
    the Gluon Hopper dQ (`triton_bwd_gluon.dq_config`; measured 1.01-1.19x the Triton dQ pass on
    W1/W2/W4/W8, H200) where it can, else the Triton one (``PACKATTN_TRITON_BWD=triton`` keeps Triton).
    The forward builds the dQ tile table with these blocks, ``tile_table(seqs, mask, False, bm, bn)``."""
    return bwd_plan(q, k, v, short_seqs).dq_choice


def use_gluon_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The warp-specialised Gluon dK/dV pass (`packattn.ops.varlen.bwd_dkdv_sm90`) runs instead of
    the Triton one where it can (sm_90, fp16/bf16, head dim 128): W1's dK/dV pass 2.114 -> 1.442 ms on
    an H200 (benchmarks/NOTES.md, v11). Depends only on dtypes, shapes, device and the environment, so
    the forward (which builds the tile table, `dkdv_blocks`) and the backward agree.
    ``PACKATTN_TRITON_BWD=triton`` keeps the Triton pass."""
    return _gluon_dkdv_config(q, k, _gluon_bwd_possible(q, k, v)) is not None


def dkdv_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """``(keys per tile, queries per step)`` of the dK/dV pass `varlen_bwd` runs on these tensors: the
    arguments of its key tile table, ``tile_table(seqs, mask, True, *dkdv_blocks(q, k, v))``."""
    return dkdv_choice(q, k, v)[:2]


def dkdv_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, bool]:
    """`dkdv_blocks` and whether the Gluon pass runs (`use_gluon_dkdv`)."""
    return bwd_plan(q, k, v).dkdv_choice


def check_dkdv_choice(forward_choice: tuple[int, int, bool], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
    """Raise when the backward would run another dK/dV pass than the one whose key tiles the forward
    built (``forward_choice``: `dkdv_choice` then): the environment switches changed in between."""
    _check_choice("dK/dV", "keys x", "queries", "PACKATTN_GLUON_DKDV_CONFIG", forward_choice, dkdv_choice(q, k, v))


def check_plan(forward_plan: BwdPlan, now: BwdPlan) -> None:
    """`check_dkdv_choice` for both passes of a `bwd_plan` (the forward's, and the backward's ``now``)."""
    _check_choice("dK/dV", "keys x", "queries", "PACKATTN_GLUON_DKDV_CONFIG", forward_plan.dkdv_choice,
                  now.dkdv_choice)
    _check_choice("dQ", "queries x", "keys", "PACKATTN_GLUON_DQ_CONFIG", forward_plan.dq_choice, now.dq_choice)


def _check_choice(name: str, rows: str, cols: str, env: str, forward_choice: tuple, now: tuple) -> None:
    if now != forward_choice:
        def say(choice):
            return f"{'Gluon' if choice[2] else 'Triton'} {name} with {choice[0]} {rows} {choice[1]} {cols}"

        raise RuntimeError(
            f"the {name} pass changed between forward and backward ({say(forward_choice)} -> {say(now)}): "
            f"PACKATTN_TRITON_BWD or {env} was changed after the forward; set them before the forward")


# The two backward decisions share their first test; `_varlen_bwd` makes it once per call and hands the
# configs to the Gluon launchers (each environment variable read once: these run on every call).
def _gluon_bwd_possible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Not the interpreter, CUDA, no ``PACKATTN_TRITON_BWD=triton``, `gluon_bwd_eligible`."""
    return (not interpreting() and q.is_cuda and env.get("PACKATTN_TRITON_BWD") != "triton"
            and triton_bwd_gluon.gluon_bwd_eligible(q, k, v))


def _gluon_dkdv_config(q: torch.Tensor, k: torch.Tensor, possible: bool):
    """Gluon's `dkdv_config` when the Gluon dK/dV pass runs (`use_gluon_dkdv`), else None."""
    if possible:
        cfg = triton_bwd_gluon.dkdv_config(q.shape[-1], q.shape[1] // k.shape[1])
        if cfg.warp_specialize:
            return cfg
    return None


def _gluon_dq_config(q: torch.Tensor, possible: bool, short_seqs: bool = False):
    """Gluon's `dq_config` when the Gluon dQ pass runs (`dq_choice`), else None."""
    return triton_bwd_gluon.dq_config(q.shape[-1], short_seqs) if possible else None


def _new_output(shape, dtype, device, padded: bool, pad_rows: torch.Tensor | None, fill: float = 0.0,
                dim: int = 0) -> torch.Tensor:
    """An output the kernels write except on rows in no sequence: those hold ``fill``. With the
    padding rows known only they are filled, otherwise the whole tensor."""
    if not padded:
        return torch.empty(shape, dtype=dtype, device=device)
    if pad_rows is None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    if fill == 0 and dim == 0:
        _zero_rows(out, pad_rows)
    else:
        out.index_fill_(dim, pad_rows, fill)
    return out


def _zero_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out.index_fill_(0, rows, 0)`` on a contiguous ``out``, with each row seen as the widest integers
    its bytes divide into (zero bits are zero in every dtype): the fill kernel then handles 4x fewer
    elements for 16-bit rows (H100: a W3 output's ~1000 padding rows of 16 x 128 bf16 cost 21.8 us as
    bf16 elements)."""
    row_bytes = out[0].numel() * out.element_size() if out.shape[0] else 0
    wide = next((t for t in (torch.int64, torch.int32, torch.int16) if row_bytes % t.itemsize == 0), None)
    if wide is None or not out.is_contiguous() or out.numel() == 0:
        out.index_fill_(0, rows, 0)
        return
    out.view(out.shape[0], row_bytes // out.element_size()).view(wide).index_fill_(0, rows, 0)


varlen_fwd = torch.library.custom_op("packattn::varlen_fwd", _varlen_fwd, mutates_args=())


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, *rest):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, row_offsets_q: torch.Tensor, row_offsets_kv: torch.Tensor,
    dq_tiles: torch.Tensor, dkdv_tiles: torch.Tensor,
    scale: float, window_left: int, window_right: int, chunk_size: int, top_left: bool,
    padded_q: bool, padded_kv: bool, pad_rows_q: torch.Tensor | None = None, pad_rows_kv: torch.Tensor | None = None,
    short_seqs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: dK/dV pass + separate dQ pass, deterministic (fixed reduction order, no
    atomics). A variant with dQ fused into the dK/dV pass through float32 atomics measured slower
    on the H200 (benchmarks/NOTES.md), so there is one backward. The passes are `bwd_plan`'s."""
    return _varlen_bwd_planned(bwd_plan(q, k, v, short_seqs), dout, dlse, q, k, v, out, lse, cu_seqlens_q,
                               cu_seqlens_kv, row_offsets_q, row_offsets_kv, dq_tiles, dkdv_tiles, scale, window_left,
                               window_right, chunk_size, top_left, padded_q, padded_kv, pad_rows_q, pad_rows_kv)


def _varlen_bwd_planned(
    plan: BwdPlan, dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, row_offsets_q: torch.Tensor, row_offsets_kv: torch.Tensor,
    dq_tiles: torch.Tensor, dkdv_tiles: torch.Tensor,
    scale: float, window_left: int, window_right: int, chunk_size: int, top_left: bool,
    padded_q: bool, padded_kv: bool, pad_rows_q: torch.Tensor | None = None, pad_rows_kv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_varlen_bwd` running the passes of ``plan`` (`bwd_plan` of these tensors): the preprocess (`bwd_delta`),
    the dK/dV pass, the dQ pass; or, where `fuses_delta` says so, the dQ pass computing delta, then the dK/dV
    pass."""
    dout, q, k, v, out = (_last_dim_contiguous(dout), _last_dim_contiguous(q), _last_dim_contiguous(k),
                          _last_dim_contiguous(v), _last_dim_contiguous(out))
    lse = lse.contiguous()
    heads_q, head_dim = q.shape[1], q.shape[2]
    group = heads_q // k.shape[1]
    # Outputs are allocated right before the pass that writes them: the first pass starts on the GPU sooner
    # (~11 us of host per allocation on the H100 hosts; a short batch's backward is host-bound there).
    def new_dq():
        return _new_output(q.shape, q.dtype, q.device, padded_q, pad_rows_q)  # contiguous, as the fake says

    def new_dkdv():
        return (_new_output(k.shape, k.dtype, k.device, padded_kv, pad_rows_kv),
                _new_output(v.shape, v.dtype, v.device, padded_kv, pad_rows_kv))

    mask_args = (window_left, window_right, chunk_size)
    seq_args = (cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    dkdv_config, dq_config = plan.dkdv, plan.dq
    if fuses_delta(plan, dlse):  # no preprocess: the dQ pass writes delta, then the dK/dV pass reads it
        delta = torch.zeros_like(lse)  # (rows of tiles without key blocks: never written, read with P = 0)
        dq = new_dq()
        triton_bwd_gluon.gluon_launch_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask_args, top_left,
                                         config=dq_config, delta_from_o=True, out=out, short_seqs=plan.short_seqs)
        dk, dv = new_dkdv()
        triton_bwd_gluon.gluon_launch_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, mask_args,
                                           top_left, config=dkdv_config, short_seqs=plan.short_seqs)
        return dq, dk, dv
    delta = bwd_delta(out, dout, lse, dlse)
    dk, dv = new_dkdv()
    if dkdv_config is not None:
        triton_bwd_gluon.gluon_launch_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, mask_args,
                                           top_left, config=dkdv_config, short_seqs=plan.short_seqs)
    else:
        common = _bwd_constexprs(head_dim, q.dtype, mask_args, top_left)
        launch_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, dkdv_tiles, scale, mask_args, common)

    dq = new_dq()
    if dq_config is not None:
        triton_bwd_gluon.gluon_launch_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask_args, top_left,
                                         config=dq_config, short_seqs=plan.short_seqs)
        return dq, dk, dv
    from packattn.ops.varlen.bwd_triton import bwd_dq_kernel

    config = launch_config("dq", head_dim, q.dtype, q.device)
    common = _bwd_constexprs(head_dim, q.dtype, mask_args, top_left)
    args = (q, k, v, dout, lse, delta, dq, dq_tiles, *seq_args, *_qkv_do_strides(q, k, v, dout),
            dq.stride(0), dq.stride(1), lse.stride(0), heads_q, group, scale * 1.4426950408889634, scale, *mask_args)
    _launch(bwd_dq_kernel, (dq_tiles.shape[0] * heads_q,), args,
            dict(common, BLOCK_M=config.block_m, BLOCK_N=config.block_n), config)
    return dq, dk, dv


def fuses_delta(plan: BwdPlan, dlse: torch.Tensor | None) -> bool:
    """Does `_varlen_bwd_planned` skip the preprocess (`bwd_delta`) and let the dQ pass compute delta
    (``triton_bwd_gluon.gluon_launch_dq(..., delta_from_o=True)``: rowsum(dO * O) from an O tile loaded with
    Q / dO, `varlen_bwd_gluon_dq_delta`)? When `triton_bwd_gluon.fused_delta_dq` says so of the
    plan's dQ config (a warp-specialised Gluon kernel without a persistent grid: at d = 128 the short-sequence
    config `DQ_SHORT_CONFIGS` and the long one; ``$PACKATTN_GLUON_FUSED_DELTA=0`` keeps two consumers out), the
    dK/dV pass is the Gluon one (it reads delta only on rows of sequences,
    `varlen_bwd_gluon_ws_load._stats_copy`, and takes P = 0 where lse = -inf), and there is no
    ``dlse`` (its term stays in the preprocess). The dQ pass then runs first, on ``delta = zeros_like(lse)``:
    it writes the rows of its tiles that have key blocks; the rows of tiles without any (queries that see no
    key: lse = -inf, P = 0 in the dK/dV pass) keep 0, which P = 0 cancels (uninitialised memory could hold
    NaN, and 0 * NaN is NaN). Otherwise the preprocess, the dK/dV pass, the dQ pass, in that order. The
    float32 row sums run in another order than the preprocess's: results are close to, not bitwise, the
    unfused backward's (GPU: tests/gpu/test_triton_varlen_gpu.py, `test_short_batch_fused_delta`,
    `test_long_batch_fused_delta_two_consumers`)."""
    return dlse is None and plan.dkdv is not None and triton_bwd_gluon.fused_delta_dq(plan.dq)


def _bwd_constexprs(head_dim: int, dtype: torch.dtype, mask_args: tuple, top_left: bool) -> dict:
    """The constexprs both Triton backward passes take (`launch_dkdv`'s ``common``)."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), INPUT_PRECISION=_precision(dtype),
                **_mask_constexprs(*mask_args, top_left))


def _qkv_do_strides(q, k, v, dout) -> tuple:
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1))


def bwd_delta(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``rowsum(dO * O) - dlse`` (float32, lse's shape): the backward preprocess."""
    from packattn.ops.varlen.bwd_triton import bwd_preprocess_kernel

    total_q, heads_q, head_dim = out.shape
    delta = torch.empty_like(lse)
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else delta  # placeholder pointer when there is no dlse
    grid = (-(-total_q // PREPROCESS_BLOCK_M), heads_q)
    if grid[0] > 0:
        fast_launch.launch(bwd_preprocess_kernel, grid, (out, dout, lse, dlse, delta, total_q, *out.stride()[:2],
                                                         *dout.stride()[:2], delta.stride()[0]),
                           dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=PREPROCESS_BLOCK_M,
                                HAS_DLSE=has_dlse))
    return delta


def launch_dkdv(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, key_end, scale, mask_args, common,
                tree: bool = False) -> None:
    """dK/dV pass over key tiles (`varlen_bwd.bwd_dkdv_kernel`); ``tree``: the tree mask, ``key_end``
    = `Tree.row_subtree_end` (any int32 tensor otherwise: unused)."""
    from packattn.ops.varlen.bwd_triton import bwd_dkdv_kernel

    heads_kv = k.shape[1]
    config = launch_config("dkdv", q.shape[-1], q.dtype, q.device)
    args = (q, k, v, dout, lse, delta, dk, dv, tiles, *seq_args, key_end, *_qkv_do_strides(q, k, v, dout),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
            heads_kv, q.shape[1] // heads_kv, scale * 1.4426950408889634, scale, *mask_args)
    _launch(bwd_dkdv_kernel, (tiles.shape[0] * heads_kv,), args,
            dict(common, BLOCK_M=config.block_m, BLOCK_N=config.block_n, TREE=tree), config)


varlen_bwd = torch.library.custom_op("packattn::varlen_bwd", _varlen_bwd, mutates_args=())


def varlen_bwd_call(*args):
    """``packattn::varlen_bwd(*args)``, through `fast_op.call` (the implementation itself in eager mode)."""
    return fast_op.call(varlen_bwd, _varlen_bwd, *args)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, tables, pad_rows_q, pad_rows_kv, scale, options = inputs
    cu_q, cu_kv, rows_q, rows_kv, _q_tiles, dq_tiles, dkdv_tiles = tables
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, rows_q, rows_kv, dq_tiles, dkdv_tiles, pad_rows_q, pad_rows_kv)
    window_left, window_right, chunk_size, top_left, padded_q, padded_kv = options[:6]  # the rest: forward-only
    ctx.options = (scale, window_left, window_right, chunk_size, bool(top_left), bool(padded_q), bool(padded_kv))
    ctx.short_seqs = bool(options[FWD_OPTIONS.index("short_seqs")])
    ctx.plan = bwd_plan(q, k, v, ctx.short_seqs)  # what dq_tiles / dkdv_tiles were built for (checked in the backward)
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: no dlse term in the backward


def _backward_through(bwd):
    """The backward of ``packattn::varlen_fwd`` computing its gradients with ``bwd(plan, *args)``: the
    ``packattn::varlen_bwd`` op (which derives the plan again), or on the eager path its implementation
    with the plan decided here (once per call: the backward runs on autograd's device thread, where host
    time costs most)."""

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_kv, rows_q, rows_kv, dq_tiles, dkdv_tiles, pad_rows_q, pad_rows_kv = \
            ctx.saved_tensors
        plan = bwd_plan(q, k, v, ctx.short_seqs)
        check_plan(ctx.plan, plan)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(plan, dout, dlse, q, k, v, out, lse, cu_q, cu_kv, rows_q, rows_kv,
                         dq_tiles, dkdv_tiles, *ctx.options, pad_rows_q, pad_rows_kv, ctx.short_seqs)
        # the same structure as the inputs: q, k, v, tables, pad_rows_q, pad_rows_kv, scale, options
        return dq, dk, dv, [None] * len(FWD_TABLES), None, None, None, None

    return backward


varlen_fwd.register_autograd(_backward_through(lambda plan, *args: varlen_bwd(*args)), setup_context=_setup_context)
_VarlenFwdEager = fast_op.eager_function(_varlen_fwd, _setup_context,
                                         _backward_through(lambda plan, *args: _varlen_bwd_planned(plan, *args[:-1])))


def kernel_limits(params) -> str | None:
    """Dtype and head-dim limits of the varlen-family kernels (varlen and tree)."""
    if params.dtype not in DTYPES:
        return f"dtype {params.dtype} not supported (float16, bfloat16, float32)"
    if params.head_dim != params.head_dim_v:
        return f"head dims {params.head_dim}/{params.head_dim_v}: q and v head dims must be equal"
    if params.head_dim not in HEAD_DIMS:
        return f"head_dim {params.head_dim} not in {HEAD_DIMS}"
    return None


# ---------------------------------------------------------------- backend
class TritonVarlenBackend(TritonBackend):
    """Our Triton kernels: varlen/dense, causal (both alignments), windows, chunks, GQA/MQA,
    padding between sequences, lse, deterministic backward."""

    name = "triton"

    def unsupported(self, params) -> str | None:
        if (why := device_unsupported(params.device_type)) is not None:
            return why
        if params.kind == "tree":
            return "tree descriptors are handled by the tree kernels"
        return kernel_limits(params)  # the backward is deterministic by construction: deterministic=True is fine


    def run(self, problem: Problem):
        q, k, v, seqs, mask = problem.q, problem.k, problem.v, problem.seqs, problem.mask
        scale = problem.scale
        if scale < 0:  # the kernels need scale >= 0: (q, -s) gives the same scores as (-q, s)
            q, scale = -q, -scale
        if torch.compiler.is_compiling():  # one graph for every packing: tables built when the op runs
            from packattn.ops.traced import traced_varlen_attention

            return traced_varlen_attention(q, k, v, seqs, mask, scale, problem.return_lse)
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        tables, options = forward_plan(q, k, v, seqs, mask, need_grad)
        padded_q, padded_kv = options[4], options[5]
        out, lse = fast_op.call(
            varlen_fwd, _VarlenFwdEager.apply, q, k, v, tables,
            seqs.padding_rows("q") if padded_q else None, seqs.padding_rows("kv") if padded_kv else None, scale,
            options)
        return out, (lse if problem.return_lse else None)


def forward_plan(q, k, v, seqs: Varlen, mask: masks.Mask, need_grad: bool) -> tuple[list, list]:
    """``(tables, options)`` of `_varlen_fwd` for this batch (`FWD_TABLES`, `FWD_OPTIONS`): the forward kernel
    and config its lengths take, its tile tables, and with ``need_grad`` the backward's (`bwd_plan`)."""
    head_dim = q.shape[-1]
    long_seqs = seqs.max_seqlen_q >= LONG_SEQLEN
    short_seqs = short_batch(seqs.max_seqlen_q, seqs.max_seqlen_kv)
    gluon = seqs.max_seqlen_q >= gluon_min_seqlen() and use_gluon_fwd(q, k, v)
    if gluon:
        fwd = triton_fwd_gluon.config_for(head_dim, long_seqs, short_seqs, q.device)
    else:
        fwd = launch_config("fwd", head_dim, q.dtype, q.device, long_seqs)
    q_tiles = tile_table(seqs, mask, False, fwd.block_m, fwd.block_n)
    if need_grad:
        plan = bwd_plan(q, k, v, short_seqs)
        dq_tiles = tile_table(seqs, mask, False, *plan.dq_choice[:2])
        dkdv_tiles = tile_table(seqs, mask, True, *plan.dkdv_choice[:2])
    else:
        dq_tiles = dkdv_tiles = q_tiles[:0]
    padded_q, padded_kv = seqs.cu_seqlens_q_padded is not None, seqs.cu_seqlens_kv_padded is not None
    tables = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv, q_tiles, dq_tiles, dkdv_tiles]
    options = [mask.left, mask.right, mask.chunk_size or 0, mask.align == "top_left", padded_q, padded_kv, long_seqs,
               gluon, short_seqs]
    return tables, options
