"""Launcher of the key-split sm_90 Gluon dK/dV kernel (`packattn.ops.varlen.bwd_dkdv_sm90_ksplit`) at head dims 192
and 256 (d_v = d): `gluon_dkdv_ksplit`, with its config and head-dim check (`check_ksplit_config`), shared-memory
formula (`ksplit_shared_bytes`) and register split (`ksplit_resources`).

A config runs this kernel where it says ``key_split``: the dK/dV tables' configs at d = 192 and 256
(`configs.DKDV_CONFIGS`). The key tile table is the plain dK/dV one, ``tile_table(seqs, mask, True, 64, 64)`` (the
config's blocks).
"""

from __future__ import annotations

import functools

from packattn.ops.runtime import fast_launch
from packattn.ops.runtime.launch import LOG2E, NO_MASK, mask_constexprs, mask_scalars
from packattn.ops.runtime.sm90 import CTA_SHARED
from packattn.ops.varlen.configs import GluonBwdConfig, check_dkdv_config
from packattn.ops.varlen.launch_sm90_bwd_parts import parts_split

# head dims the kernel takes (d_v = d): the two consumers own halves of a power-of-two dim's columns (256) or one
# column part each (192 = 128 + 64)
KSPLIT_HEAD_DIMS = (192, 256)
TILE_KEYS = 64  # keys per program
STEP_QUERIES = 64  # queries per ring step (the S / dP wgmma M)
EXCHANGE_BUFFERS = 2  # P^T / dS^T double buffers


def check_ksplit_config(cfg: GluonBwdConfig, head_dim: int | None = None, head_dim_v: int | None = None) -> None:
    """Raise ValueError unless the key-split kernel takes ``cfg`` (a ``key_split`` config that
    `configs.check_dkdv_config` accepts: block_m 64, block_n 64, num_warps 8, stages >= 2) and, when given, the head
    dims (`KSPLIT_HEAD_DIMS`, ``head_dim_v`` None or ``head_dim``)."""
    if not cfg.key_split:
        raise ValueError(f"{cfg}: the key-split dK/dV kernel takes key_split configs only")
    check_dkdv_config(cfg)
    if head_dim is not None and (head_dim not in KSPLIT_HEAD_DIMS or head_dim_v not in (None, head_dim)):
        raise ValueError(f"the key-split dK/dV kernel takes head dims {KSPLIT_HEAD_DIMS} with d_v = d, not "
                         f"{head_dim}/{head_dim if head_dim_v is None else head_dim_v}")


def ksplit_shared_bytes(cfg: GluonBwdConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one key-split CTA: K and V of the 64-key tile, the (Q, dO) ring of 64-query slots, lse / delta
    per slot (float32), the P^T / dS^T double buffers (64 x 64 each), the bounds tables (2 consumers x 2 x 32 int32),
    the mbarriers (kv, zero, two exchanges, the ring's)."""
    tiles = (TILE_KEYS + cfg.stages * STEP_QUERIES) * 2 * head_dim * element_size
    exchange = 2 * EXCHANGE_BUFFERS * TILE_KEYS * STEP_QUERIES * element_size
    return tiles + exchange + 4 * 2 * cfg.stages * STEP_QUERIES + 4 * 4 * 32 + 8 * (4 + 2 * cfg.stages)


@functools.cache
def ksplit_resources(cfg: GluonBwdConfig, head_dim: int, head_dim_v: int | None = None) -> dict:
    """Occupancy and register split (`launch_sm90_bwd_parts.parts_split`: the parts producer at
    `launch_sm90_bwd_parts.PARTS_PRODUCER_REGS`, the two consumers the rest: 232 at one CTA per SM), after
    `check_ksplit_config`."""
    check_ksplit_config(cfg, head_dim, head_dim_v)
    shared = ksplit_shared_bytes(cfg, head_dim)
    if shared > CTA_SHARED:
        raise ValueError(f"{cfg}: the key-split dK/dV kernel at head dim {head_dim} needs {shared} B of shared memory, "
                         f"over the {CTA_SHARED} B one CTA may use (fewer stages)")
    return parts_split(cfg.num_warps, shared)


def ksplit_launch_args(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale: float, mask, cfg, section: int,
                       part_descriptors, key_end=None) -> tuple[tuple, dict]:
    """``(args, constexprs)`` of one launch of `varlen_bwd_dkdv_ksplit_kernel` (grid ``tiles.shape[0] * heads_kv``);
    arguments as `gluon_dkdv_ksplit`."""
    heads_kv = k.shape[1]
    num_work = tiles.shape[0] * heads_kv
    tree = key_end is not None
    if tree:
        mask = NO_MASK  # no window / chunk: the constexprs select the tree mask alone
    res = ksplit_resources(cfg, q.shape[-1], v.shape[-1])
    (q_desc, q_lo), (k_desc, k_lo), (v_desc, v_lo), (do_desc, do_lo) = (
        part_descriptors(q, cfg.block_m), part_descriptors(k, cfg.block_n), part_descriptors(v, cfg.block_n),
        part_descriptors(dout, cfg.block_m))
    args = (q_desc, k_desc, v_desc, do_desc, q_lo, k_lo, v_lo, do_lo, lse, delta, dk, dv, tiles, *seq_args,
            key_end if tree else tiles,  # KeyEnd: any int32 pointer without the tree mask
            *dk.stride()[:2], *dv.stride()[:2], lse.stride()[0], heads_kv, q.shape[1] // heads_kv, scale * LOG2E,
            scale, *mask_scalars(mask), section, num_work)
    constexprs = dict(HEAD_DIM=q.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                      **mask_constexprs(mask), TREE=tree, CONSUMER_REGS=res["consumer_regs"],
                      PRODUCER_REGS=res["producer_regs"], num_warps=4, maxnreg=res["maxnreg"])
    return args, constexprs


def gluon_dkdv_ksplit(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale: float, mask, cfg, section: int,
                      part_descriptors, key_end=None) -> None:
    """`launch_sm90.gluon_dkdv` with the key-split kernel (called from there, after its checks, for a ``key_split``
    config; ``section``: kv heads per section of the work order; ``part_descriptors``:
    `launch_sm90.part_descriptors`; ``key_end``: the tree mask, as there)."""
    from packattn.ops.varlen.bwd_dkdv_sm90_ksplit import varlen_bwd_dkdv_ksplit_kernel

    args, constexprs = ksplit_launch_args(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale, mask, cfg,
                                          section, part_descriptors, key_end)
    fast_launch.launch(varlen_bwd_dkdv_ksplit_kernel, (tiles.shape[0] * k.shape[1],), args, constexprs)
