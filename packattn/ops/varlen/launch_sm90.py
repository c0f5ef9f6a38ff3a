"""Launchers of the sm_90 Gluon varlen kernels: the warp-specialised forward (`gluon_fwd`,
`packattn.ops.varlen.fwd_sm90`), dK/dV (`gluon_dkdv`, `packattn.ops.varlen.bwd_dkdv_sm90`) and dQ
(`gluon_dq`, `packattn.ops.varlen.bwd_dq_sm90`).

They take what the Triton launchers take (`packattn.ops.varlen.launch_triton`) with TMA descriptors
(`packattn.ops.runtime.sm90`) in place of raw pointers for q, k, v, dout (and O), plus the config the
plan chose (`packattn.ops.varlen.configs`); the tile tables must be built with that config's blocks.
``seq_args = (cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)``; outputs are preallocated
and written on the rows of sequences only. ``scale >= 0`` (`launch.nonnegative_scale`).
"""

from __future__ import annotations

import functools

import torch

from packattn.mask import Mask
from packattn.ops.runtime import fast_launch
from packattn.ops.runtime.launch import LOG2E, NO_MASK, mask_constexprs, mask_scalars
from packattn.ops.runtime.sm90 import (CTA_SHARED, _as_tma_tensor, _descriptor, _smem_layout, _tma_compatible,
                                       _unchecked_descriptor, _unchecked_descriptor_class, ws_grid, ws_split)
from packattn.ops.varlen.configs import GluonBwdConfig, GluonConfig, check_dq_config, heads_per_section
from packattn.ops.varlen.launch_sm90_bwd_parts import (check_no_key_split, dkdv_parts_shared_bytes,
                                                      dq_parts_shared_bytes, gluon_dkdv_parts, gluon_dq_parts,
                                                      in_parts, parts_split)
from packattn.ops.varlen.launch_sm90_ksplit import gluon_dkdv_ksplit


# ---------------------------------------------------------------- shared memory and register split
# `GluonConfig.vec_store`'s conversion scratch (bytes), an upper bound: 512 a consumer warp, 8 warps at most
# (Triton 3.6: 4144 B with two consumer warp groups at every head dim, scripts/check_gluon_compile.py), and room for
# its alignment
VEC_STORE_SCRATCH = 8 * 512 + 64


def shared_bytes(cfg: GluonConfig, head_dim: int, element_size: int = 2, head_dim_v: int | None = None) -> int:
    """Shared memory of one forward CTA: Q, the K/V ring (V of ``head_dim_v`` columns, None: ``head_dim``), the
    mbarriers and, with ``vec_store``, the output's layout-conversion scratch (`VEC_STORE_SCRATCH`)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    ring_bars = 2 * cfg.stages * (2 if cfg.split_kv else 1)  # ready + empty a slot (`_ring_barriers`)
    store = VEC_STORE_SCRATCH if cfg.vec_store else 0
    return ((cfg.block_m * head_dim + cfg.stages * cfg.block_n * (head_dim + dv)) * element_size
            + 8 * (2 + ring_bars) + store)


@functools.lru_cache(maxsize=None)
def fwd_resources(cfg: GluonConfig, head_dim: int, head_dim_v: int | None = None) -> dict:
    """Occupancy and register split of the forward (`sm90.ws_split` with its shared memory; ``head_dim_v``: the
    value head dim, None: ``head_dim``); in column parts or with a value head dim of its own (`in_parts`) the
    producer gets `launch_sm90_bwd_parts.PARTS_PRODUCER_REGS` and the consumers what is left (`parts_split`).
    ValueError for Q in registers where `fwd_sm90_ring.q_regs_ok` refuses it and for a config whose `shared_bytes`
    exceed a CTA's."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if cfg.q_in_regs:
        from packattn.ops.varlen.fwd_sm90_ring import q_regs_ok

        if not q_regs_ok(head_dim, dv):
            raise ValueError(f"{cfg}: q_in_regs needs head dims below 256 (q/k {head_dim}, v {dv}): "
                             "`fwd_sm90_ring.q_regs_ok`")
    shared = shared_bytes(cfg, head_dim, head_dim_v=dv)
    if shared > CTA_SHARED:
        raise ValueError(f"{cfg}: {shared} bytes of shared memory at head dims {head_dim} / {dv}, over the "
                         f"{CTA_SHARED} a CTA may use")
    return parts_split(cfg.num_warps, shared) if in_parts(head_dim, dv) else ws_split(cfg.num_warps, shared)


def dkdv_shared_bytes(cfg: GluonBwdConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one dK/dV CTA: K and V of the tile, the (Q, dO) ring, lse / delta per ring slot, the
    consumers' query-position tables, the mbarriers (``kv_bar``, with two consumers ``zero_bar``, the ring's):
    `dkdv_parts_shared_bytes` with q/k and v of one head dim."""
    return dkdv_parts_shared_bytes(cfg, head_dim, head_dim, element_size)


@functools.lru_cache(maxsize=None)
def dkdv_resources(cfg: GluonBwdConfig, head_dim: int) -> dict:
    """Register split of the dK/dV kernel (`sm90.ws_split`): at d = 128 with two consumer warp groups one CTA
    per SM, maxnreg 168, consumers 240; with one (<= ~113 KB of shared memory) two CTAs per SM, maxnreg 128,
    consumer 232 (`launch_sm90_bwd_parts.check_no_key_split`)."""
    check_no_key_split(cfg)
    return ws_split(cfg.num_warps, dkdv_shared_bytes(cfg, head_dim))


def dq_shared_bytes(cfg: GluonBwdConfig, head_dim: int, element_size: int = 2, delta_from_o: bool = False) -> int:
    """Shared memory of one warp-specialised dQ CTA: Q and dO of the tile (``delta_from_o``: and O), the
    (K, V) ring, the mbarriers (``q_bar``, with two consumers ``zero_bar``, the ring's): `dq_parts_shared_bytes`
    with q/k and v of one head dim."""
    return dq_parts_shared_bytes(cfg, head_dim, head_dim, element_size, delta_from_o=delta_from_o)


@functools.lru_cache(maxsize=None)
def dq_resources(cfg: GluonBwdConfig, head_dim: int, delta_from_o: bool = False) -> dict:
    """Register split of the warp-specialised dQ kernel, as `dkdv_resources`."""
    check_dq_config(cfg)
    return ws_split(cfg.num_warps, dq_shared_bytes(cfg, head_dim, delta_from_o=delta_from_o))


def part_descriptors(x: torch.Tensor, block_rows: int) -> tuple:
    """The forward's TMA descriptors of ``x`` (rows, heads, d): ``(desc, None)`` with blocks ``[block_rows, d]``
    (`sm90._descriptor`) for a power-of-two ``d``; else one descriptor per column part (`fwd_sm90_parts`) over
    the same ``(rows, heads * d)`` view (of one copy where TMA cannot read ``x``): blocks ``[block_rows, hi]``
    and ``[block_rows, d - hi]``, ``hi`` the widest power of two below ``d``; the kernel reads head ``h``'s
    parts at columns ``h * d`` and ``h * d + hi``."""
    d = x.shape[-1]
    hi = 1 << (d.bit_length() - 1)
    if hi == d:
        return _descriptor(x, block_rows), None
    if d - hi < 16 or (d - hi) & (d - hi - 1):
        raise ValueError(f"the Gluon forward takes head dim {d} in no column parts: {hi} + {d - hi}, the second "
                         "part must be a power of two >= 16")
    if not _tma_compatible(x):
        x = _as_tma_tensor(x)
    rows, heads = x.shape[0], x.shape[1]
    shape, strides = [rows, heads * d], [x.stride()[0], 1]
    descs = []
    for width in (hi, d - hi):
        layout = _smem_layout((block_rows, width), x.dtype)
        cls = _unchecked_descriptor_class(block_rows, width, x.dtype) if rows > 0 and heads > 0 else None
        if cls is not None:
            descs.append(_unchecked_descriptor(cls, x, shape, strides, [block_rows, width], layout))
        else:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            descs.append(TensorDescriptor(x, shape, strides, [block_rows, width], layout))
    return tuple(descs)


# ---------------------------------------------------------------- launchers
def gluon_fwd(q, k, v, out, lse, seq_args, q_tiles, scale: float, mask: Mask, cfg: GluonConfig,
              short_seqs: bool = False, max_programs: int | None = None) -> None:
    """The forward into ``out`` / ``lse`` (rows in no sequence keep what they hold): a persistent grid of
    programs over the (query tile, query head) items, longest first; ``q_tiles`` built with ``cfg``'s
    blocks. ``max_programs`` caps the grid (tests: many items per program). q/k and v may differ in head dim
    (MLA: ``out`` has v's); a head dim that is not a power of two runs in two column parts (`part_descriptors`).
    """
    from packattn.ops.varlen.fwd_sm90 import varlen_fwd_gluon_ws_kernel

    total_q, heads_q, head_dim = q.shape  # (`_descriptor` copies what TMA cannot read)
    heads_kv, head_dim_v = k.shape[1], v.shape[2]
    num_work = q_tiles.shape[0] * heads_q
    if num_work == 0 or total_q == 0:
        return
    if k.shape[0] == 0:  # no keys anywhere: every row sees nothing (and a TMA tensor needs rows)
        out.zero_()
        lse.fill_(float("-inf"))
        return
    res = fwd_resources(cfg, head_dim, head_dim_v)
    section = heads_per_section(heads_q, heads_q // heads_kv, short_seqs)
    (q_desc, q_lo), (k_desc, k_lo), (v_desc, v_lo) = (
        part_descriptors(q, cfg.block_m), part_descriptors(k, cfg.block_n), part_descriptors(v, cfg.block_n))
    args = (q_desc, k_desc, v_desc, q_lo, k_lo, v_lo, out, lse, q_tiles,
            *seq_args, out.stride(0), out.stride(1), lse.stride(0),
            heads_q, heads_q // heads_kv, scale * LOG2E, *mask_scalars(mask), num_work, section)
    fast_launch.launch(varlen_fwd_gluon_ws_kernel, (ws_grid(q.device, num_work, res, max_programs),), args, dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        **mask_constexprs(mask), CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"],
        TRIM=cfg.trim, **fwd_variant_constexprs(cfg), num_warps=4, maxnreg=res["maxnreg"]))


def fwd_variant_constexprs(cfg: GluonConfig) -> dict:
    """The forward kernel's constexprs of ``cfg``'s variants: ``RESCALE_THRESHOLD`` (lazy rescaling), None (off) or
    a float; ``SPLIT_KV`` (separate K and V ring barriers); ``Q_REGS`` (Q in registers); ``VEC_STORE`` (16-byte
    output stores)."""
    t = cfg.rescale_threshold
    return {"RESCALE_THRESHOLD": None if t is None else float(t), "SPLIT_KV": cfg.split_kv, "Q_REGS": cfg.q_in_regs,
            "VEC_STORE": cfg.vec_store}


def gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale: float, mask: Mask, cfg: GluonBwdConfig,
               short_seqs: bool = False, key_end: torch.Tensor | None = None) -> None:
    """dK/dV pass, one program per (key tile, kv head): ``tiles`` built with ``cfg.block_n`` keys per tile and
    ``cfg.block_m`` queries per step; ``lse`` / ``delta`` float32 ``(heads_q, rows)``. ``key_end`` (int32
    `Tree.row_subtree_end`): the tree mask instead of ``mask`` (``tiles`` from
    `packattn.ops.tree.tables.build_key_tiles`, ``seq_args`` one sequence of all rows)."""
    from packattn.ops.varlen.bwd_dkdv_sm90 import varlen_bwd_dkdv_gluon_ws_kernel

    heads_kv = k.shape[1]
    num_work = tiles.shape[0] * heads_kv
    if num_work == 0 or k.shape[0] == 0:
        return
    if q.shape[0] == 0:  # no queries anywhere: no key gets a gradient (and a TMA tensor needs rows)
        dk.zero_()
        dv.zero_()
        return
    if num_work >= 2**30:  # the kernel packs the item index into 30 bits
        raise ValueError(f"too many dK/dV work items ({num_work})")
    lse, delta = lse.contiguous(), delta.contiguous()
    tree = key_end is not None
    if tree:
        mask = NO_MASK  # no window / chunk: the constexprs select the tree mask alone
    section = heads_per_section(q.shape[1], q.shape[1] // heads_kv, short_seqs) * heads_kv // q.shape[1]  # kv heads
    if cfg.key_split:  # the keys split over two consumer warp groups (the tables' config at d = 192 / 256)
        return gluon_dkdv_ksplit(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale, mask, cfg, section,
                                 part_descriptors, key_end)
    if in_parts(q.shape[-1], v.shape[-1]):  # column parts / a value head dim of its own
        return gluon_dkdv_parts(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale, mask, cfg, section,
                                part_descriptors, key_end)
    res = dkdv_resources(cfg, q.shape[-1])
    args = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
            _descriptor(dout, cfg.block_m), lse, delta, dk, dv, tiles, *seq_args,
            key_end if tree else tiles,  # KeyEnd: any int32 pointer without the tree mask
            *dk.stride()[:2], *dv.stride()[:2], lse.stride()[0], heads_kv, q.shape[1] // heads_kv, scale * LOG2E,
            scale, *mask_scalars(mask), section, num_work)
    fast_launch.launch(varlen_bwd_dkdv_gluon_ws_kernel, (num_work,), args, dict(
        HEAD_DIM=q.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, **mask_constexprs(mask),
        TREE=tree, CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4,
        maxnreg=res["maxnreg"]))


def gluon_dq(q, k, v, dout, lse, delta, dq, tiles, seq_args, scale: float, mask: Mask, cfg: GluonBwdConfig,
             short_seqs: bool = False, out: torch.Tensor | None = None) -> None:
    """dQ pass (the warp-specialised kernel), one program per (query tile, query head): ``tiles`` built with
    ``cfg.block_m`` queries per tile and ``cfg.block_n`` keys per step. With ``out`` (the forward's O) the kernel
    computes delta = rowsum(dO * O) itself and WRITES it into ``delta`` (float32, lse's shape, contiguous) on the
    rows of tiles with key blocks; other rows keep what ``delta`` held (the caller passes
    zeros). No dlse term then."""
    delta_from_o = out is not None
    if delta_from_o:
        if out.shape != dout.shape or out.dtype != dout.dtype:
            raise ValueError("computing delta needs out (O) shaped and typed like dout")
        if not delta.is_contiguous() or delta.shape != lse.shape:
            raise ValueError("the dQ pass writes delta in place: it must be contiguous and shaped like lse")
    heads_q = q.shape[1]
    num_work = tiles.shape[0] * heads_q
    if num_work == 0 or q.shape[0] == 0:
        return
    if k.shape[0] == 0:  # no keys anywhere: every query sees nothing
        dq.zero_()
        return
    if num_work >= 2**30:  # the kernels pack the item index into 30 bits
        raise ValueError(f"too many dQ work items ({num_work})")
    lse, delta = lse.contiguous(), delta.contiguous()
    if in_parts(q.shape[-1], v.shape[-1]):  # column parts / a value head dim of its own
        return gluon_dq_parts(q, k, v, dout, lse, delta, dq, tiles, seq_args, scale, mask, cfg,
                              heads_per_section(heads_q, heads_q // k.shape[1], short_seqs), part_descriptors, out)
    descs = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
             _descriptor(dout, cfg.block_m))
    rest = (lse, delta, dq, tiles, *seq_args, *dq.stride()[:2], lse.stride()[0],
            heads_q, heads_q // k.shape[1], scale * LOG2E, scale, *mask_scalars(mask))
    blocks = dict(HEAD_DIM=q.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                  **mask_constexprs(mask))
    from packattn.ops.varlen.bwd_dq_sm90 import varlen_bwd_dq_gluon_ws_kernel

    res = dq_resources(cfg, q.shape[-1], delta_from_o)
    section = heads_per_section(heads_q, heads_q // k.shape[1], short_seqs)
    # o_desc: None without delta_from_o (a constant for Triton: no kernel parameter)
    o_desc = _descriptor(out, cfg.block_m) if delta_from_o else None
    fast_launch.launch(varlen_bwd_dq_gluon_ws_kernel, (num_work,), (*descs, o_desc, *rest, section, num_work),
                       dict(blocks, DELTA_FROM_O=delta_from_o, CONSUMER_REGS=res["consumer_regs"],
                            PRODUCER_REGS=res["producer_regs"], num_warps=4, maxnreg=res["maxnreg"]))
