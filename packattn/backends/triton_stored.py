"""The STORED backward: short causal self-attention batches keep P and dS from the dQ pass.

The usual backward recomputes the scores in both passes: the dK/dV pass runs four products per (key
tile, query block) pair (``S^T``, ``dP^T``, ``dV``, ``dK``) and the dQ pass three (``S``, ``dP``,
``dQ``). For documents of at most `triton_varlen.SHORT_SEQLEN` tokens the pairs are few and small, so
the dQ pass, which computes ``P`` and ``dS`` anyway, writes them (input dtype, 64 x 64 tiles) to a
scratch buffer, and the dK/dV pass becomes two products per pair that read them
(`packattn.kernels.varlen_bwd_stored`): 5 products instead of 7, for the memory traffic of writing and
reading the tiles once. Order: the dQ pass (delta from O in the one-consumer Gluon kernel; otherwise
after the preprocess), then the stored dK/dV pass. Deterministic, like the other passes.

Scratch: ``2 x heads_q x pairs x 64 x 64`` elements of the input dtype, ``pairs = sum T (T + 1) / 2`` over
the sequences (``T`` = 64-row blocks of the sequence): ``(T + 1) / 2`` times the bytes of q at head dim
128 (4.5x for 512-token documents), allocated per backward call and freed after it.

When (`stored_pairs`): causal self-attention (the same sequences for queries and keys, no window, no
chunks: the only mask whose dQ and dK/dV passes visit the same triangle of pairs), every sequence at most
`SHORT_SEQLEN` rows, host lengths known; by default only where the dQ pass is the one-consumer Gluon
kernel with 64-key blocks (the short-batch plan at d = 128 on Hopper, where it was measured).
``PACKATTN_STORED_PDS=0`` turns it off, ``=1`` takes it wherever the mask allows (the Triton dQ pass
then stores the pairs: how CI runs it in the interpreter).
"""

from __future__ import annotations

import torch

from packattn import env
from packattn import mask as masks
from packattn.backends import triton_bwd_gluon
from packattn.backends.triton_base import interpreting
from packattn.backends.triton_launch import LaunchConfig, _launch, _mask_constexprs, _precision, block_d
from packattn.varlen import Varlen

PAIR = 64  # rows and columns of a stored pair tile (`varlen_bwd_stored.PAIR`)
SWITCH = "PACKATTN_STORED_PDS"
# Triton launch options of the two passes here: (block_m, block_n, num_warps, num_stages)
STORED_CONFIGS = {"dq": LaunchConfig(64, 64, 4, 2), "dkdv": LaunchConfig(64, 64, 4, 2)}
INTERPRETER_CONFIG = LaunchConfig(64, 64, 1, 1)


def stored_pairs(seqs: Varlen, mask: masks.Mask, plan, short_seqs: bool) -> int:
    """Pair tiles per head that the STORED backward needs for this batch, or 0 where it does not run
    (module docstring: when). ``plan``: the `triton_varlen.BwdPlan` of the call."""
    switch = env.get(SWITCH, "")
    if switch == "0" or not short_seqs or seqs.num_seqs == 0 or seqs.lengths_q is None or not seqs.is_self:
        return 0
    if not mask.causal or mask.window is not None or mask.chunk_size is not None:
        return 0
    measured = triton_bwd_gluon.one_consumer_dq(plan.dq) and plan.dq.block_n == PAIR
    if not (measured or switch == "1"):
        return 0
    blocks = [-(-n // PAIR) for n in seqs.lengths_q]
    return sum(t * (t + 1) // 2 for t in blocks)


def pair_base(seqs: Varlen) -> torch.Tensor:
    """int32 ``(num_seqs,)``: each sequence's first pair tile (exclusive prefix sum of ``T (T + 1) / 2``),
    built on the device once per batch (no host round trip)."""

    def build():
        blocks = (seqs.seqlens_q.long() + PAIR - 1) // PAIR
        pairs = blocks * (blocks + 1) // 2
        return (torch.cumsum(pairs, 0) - pairs).to(torch.int32)

    return seqs.cached("stored_pair_base", build)


def stored_bwd(plan, dout, dlse, q, k, v, out, lse, seq_args, dq_tiles, dkdv_tiles, bases, num_pairs: int,
               scale: float, top_left: bool, new_dq, new_dkdv):
    """``(dq, dk, dv)`` of the STORED backward. ``dq_tiles`` / ``dkdv_tiles``: ``tile_table(seqs, mask, False /
    True, 64, 64)``; ``bases``: `pair_base`; ``num_pairs``: `stored_pairs`; ``new_dq`` / ``new_dkdv``: the
    caller's output allocators (padding rows zeroed)."""
    from packattn.backends.triton_varlen import bwd_delta

    heads_q = q.shape[1]
    scratch = torch.empty((2, heads_q, num_pairs, PAIR, PAIR), dtype=q.dtype, device=q.device)
    p_tiles, ds_tiles = scratch[0], scratch[1]
    mask_args = (-1, 0, 0)  # causal, no window, no chunks (`stored_pairs`)
    gluon_dq = triton_bwd_gluon.one_consumer_dq(plan.dq) and plan.dq.block_n == PAIR
    if gluon_dq:
        fused = dlse is None  # delta from O inside the dQ pass (`triton_varlen.fuses_delta`)
        delta = torch.zeros_like(lse) if fused else bwd_delta(out, dout, lse, dlse)
        dq = new_dq()
        triton_bwd_gluon.gluon_launch_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask_args, top_left,
                                         config=plan.dq, delta_from_o=fused, out=out, short_seqs=plan.short_seqs,
                                         pds=(p_tiles, ds_tiles, bases, num_pairs))
    else:
        delta = bwd_delta(out, dout, lse, dlse)
        dq = new_dq()
        _launch_triton_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, top_left, p_tiles, ds_tiles,
                          bases, num_pairs)
    dk, dv = new_dkdv()
    _launch_stored_dkdv(q, dout, p_tiles, ds_tiles, dk, dv, dkdv_tiles, seq_args, bases, num_pairs, k.shape[1], scale)
    return dq, dk, dv


def _config(kernel: str) -> LaunchConfig:
    """`STORED_CONFIGS`, or ``$PACKATTN_STORED_DKDV_CONFIG`` / ``$PACKATTN_STORED_DQ_CONFIG`` = ``"warps,stages"``
    (A/B runs), or the interpreter's single-warp config."""
    if interpreting():
        return INTERPRETER_CONFIG
    config = STORED_CONFIGS[kernel]
    override = env.get(f"PACKATTN_STORED_{kernel.upper()}_CONFIG")
    if override:
        warps, stages = (int(x) for x in override.split(","))
        config = LaunchConfig(config.block_m, config.block_n, warps, stages)
    return config


def _launch_triton_dq(q, k, v, dout, lse, delta, dq, tiles, seq_args, scale, top_left, p_tiles, ds_tiles, bases,
                      num_pairs):
    from packattn.kernels.varlen_bwd import bwd_dq_kernel

    heads_q = q.shape[1]
    config = _config("dq")
    args = (q, k, v, dout, lse, delta, dq, tiles, *seq_args, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
            heads_q, heads_q // k.shape[1], scale * 1.4426950408889634, scale, -1, 0, 0, p_tiles, ds_tiles, bases,
            num_pairs)
    constexprs = dict(HEAD_DIM=q.shape[-1], BLOCK_D=block_d(q.shape[-1]), BLOCK_M=PAIR, BLOCK_N=PAIR,
                      INPUT_PRECISION=_precision(q.dtype), **_mask_constexprs(-1, 0, 0, top_left))
    _launch(bwd_dq_kernel, (tiles.shape[0] * heads_q,), args, dict(constexprs, STORE_PDS=True), config)


def _launch_stored_dkdv(q, dout, p_tiles, ds_tiles, dk, dv, tiles, seq_args, bases, num_pairs, heads_kv, scale):
    from packattn.kernels.varlen_bwd_stored import bwd_dkdv_stored_kernel

    num_tiles = tiles.shape[0]
    args = (q, dout, p_tiles, ds_tiles, dk, dv, tiles, *seq_args, bases, q.stride(0), q.stride(1), dout.stride(0),
            dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), num_pairs, num_tiles,
            q.shape[1] // heads_kv, scale)
    constexprs = dict(HEAD_DIM=q.shape[-1], BLOCK_D=block_d(q.shape[-1]), INPUT_PRECISION=_precision(q.dtype))
    _launch(bwd_dkdv_stored_kernel, (num_tiles * heads_kv,), args, constexprs, _config("dkdv"))

