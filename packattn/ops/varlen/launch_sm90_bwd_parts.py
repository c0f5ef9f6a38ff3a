"""Launchers of the sm_90 Gluon backward at head dims in column parts or with a value head dim of its own
(`packattn.ops.varlen.bwd_dkdv_sm90_parts`, `packattn.ops.varlen.bwd_dq_sm90_parts`): `launch_sm90.gluon_dkdv` /
`gluon_dq` hand over to `gluon_dkdv_parts` / `gluon_dq_parts` where `in_parts` (their arguments and contracts).
Descriptors: `launch_sm90.part_descriptors`; shared memory / registers: `dkdv_parts_shared_bytes`,
`dq_parts_shared_bytes` and the resource functions below.
"""

from __future__ import annotations

import functools

from packattn.ops.runtime import fast_launch
from packattn.ops.runtime.launch import LOG2E, NO_MASK, mask_constexprs, mask_scalars
from packattn.ops.runtime.sm90 import ws_split
from packattn.ops.varlen.configs import (
    GluonBwdConfig,
    check_dkdv_config,
    check_dq_config,
)

# The producer warp's registers in the part kernels, forward (`launch_sm90.fwd_resources`) and backward: at 24 (or
# 32) its extra TMA coordinates, or values live into the partitions, spill (scripts/check_gluon_compile.py,
# check_gluon_bwd_parts_compile.py); the consumers keep 232 (a d = 192 forward consumer with 64-key blocks needs
# ~215).
PARTS_PRODUCER_REGS = 40


def check_no_key_split(cfg: GluonBwdConfig) -> None:
    """`configs.check_dkdv_config`, and raise ValueError for a ``key_split`` config: the dK/dV kernels of 64-key
    consumer warp groups (plain and in parts) do not take one (`launch_sm90_ksplit` does)."""
    check_dkdv_config(cfg)
    if cfg.key_split:
        raise ValueError(f"{cfg}: a key_split config runs the key-split dK/dV kernel (`launch_sm90_ksplit`)")


def in_parts(head_dim: int, head_dim_v: int) -> bool:
    """Does the backward at these head dims run the part kernels (a dim that is not a power of two, or d_v != d)?"""
    return head_dim != head_dim_v or head_dim & (head_dim - 1) != 0


def dkdv_parts_shared_bytes(cfg: GluonBwdConfig, head_dim: int, head_dim_v: int, element_size: int = 2) -> int:
    """Shared memory of one dK/dV part CTA: K (d) and V (d_v) of the tile, the (Q, dO) ring, lse / delta per slot,
    the query-position tables, the mbarriers."""
    consumers = cfg.num_warps // 4
    return ((cfg.block_n + cfg.stages * cfg.block_m) * (head_dim + head_dim_v) * element_size
            + 4 * (2 * cfg.stages * cfg.block_m + consumers * cfg.block_m) + 8 * (consumers + 2 * cfg.stages))


def dq_parts_shared_bytes(cfg: GluonBwdConfig, head_dim: int, head_dim_v: int, element_size: int = 2,
                          delta_from_o: bool = False) -> int:
    """Shared memory of one dQ part CTA: Q (d), dO (d_v) and with ``delta_from_o`` O (d_v) of the tile, the (K, V)
    ring, the mbarriers."""
    consumers = cfg.block_m // 64
    tile = cfg.block_m * (head_dim + head_dim_v * (2 if delta_from_o else 1))
    return ((tile + cfg.stages * cfg.block_n * (head_dim + head_dim_v)) * element_size
            + 8 * (consumers + 2 * cfg.stages))


def parts_split(num_warps: int, shared: int) -> dict:
    """`sm90.ws_split` with the producer at `PARTS_PRODUCER_REGS` and the consumers given what is left."""
    res = ws_split(num_warps, shared)
    consumers = num_warps // 4
    idle = res["warps"] // 4 - consumers
    spare = res["maxnreg"] * res["warps"] - PARTS_PRODUCER_REGS * 4 * idle
    return dict(res, producer_regs=PARTS_PRODUCER_REGS, consumer_regs=min(256, spare // (4 * consumers)) // 8 * 8)


@functools.lru_cache(maxsize=None)
def dkdv_parts_resources(cfg: GluonBwdConfig, head_dim: int, head_dim_v: int) -> dict:
    """Occupancy and register split of the dK/dV part kernel (`check_no_key_split`)."""
    check_no_key_split(cfg)
    return parts_split(cfg.num_warps, dkdv_parts_shared_bytes(cfg, head_dim, head_dim_v))


@functools.lru_cache(maxsize=None)
def dq_parts_resources(cfg: GluonBwdConfig, head_dim: int, head_dim_v: int, delta_from_o: bool = False) -> dict:
    """Occupancy and register split of the dQ part kernel."""
    check_dq_config(cfg)
    return parts_split(cfg.num_warps, dq_parts_shared_bytes(cfg, head_dim, head_dim_v, delta_from_o=delta_from_o))


def gluon_dkdv_parts(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale: float, mask, cfg: GluonBwdConfig,
                     section: int, part_descriptors, key_end=None) -> None:
    """`launch_sm90.gluon_dkdv` at head dims in parts (called from there, after its checks; ``section``: kv heads
    per section of the work order; ``part_descriptors``: `launch_sm90.part_descriptors`, passed in because that
    module imports this one)."""
    from packattn.ops.varlen.bwd_dkdv_sm90_parts import varlen_bwd_dkdv_parts_kernel

    heads_kv = k.shape[1]
    num_work = tiles.shape[0] * heads_kv
    tree = key_end is not None
    if tree:
        mask = NO_MASK
    res = dkdv_parts_resources(cfg, q.shape[-1], v.shape[-1])
    (q_desc, q_lo), (k_desc, k_lo), (v_desc, v_lo), (do_desc, do_lo) = (
        part_descriptors(q, cfg.block_m), part_descriptors(k, cfg.block_n), part_descriptors(v, cfg.block_n),
        part_descriptors(dout, cfg.block_m))
    args = (q_desc, k_desc, v_desc, do_desc, q_lo, k_lo, v_lo, do_lo, lse, delta, dk, dv, tiles, *seq_args,
            key_end if tree else tiles, *dk.stride()[:2], *dv.stride()[:2], lse.stride()[0], heads_kv,
            q.shape[1] // heads_kv, scale * LOG2E, scale, *mask_scalars(mask), section, num_work)
    fast_launch.launch(varlen_bwd_dkdv_parts_kernel, (num_work,), args, dict(
        HEAD_DIM=q.shape[-1], HEAD_DIM_V=v.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        **mask_constexprs(mask), TREE=tree, CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"],
        num_warps=4, maxnreg=res["maxnreg"]))


def gluon_dq_parts(q, k, v, dout, lse, delta, dq, tiles, seq_args, scale: float, mask, cfg: GluonBwdConfig,
                   section: int, part_descriptors, out=None) -> None:
    """`launch_sm90.gluon_dq` at head dims in parts (called from there, after its checks; ``section``: query heads
    per section of the work order; ``part_descriptors`` as in `gluon_dkdv_parts`); ``out``: compute delta
    (DELTA_FROM_O) as there."""
    from packattn.ops.varlen.bwd_dq_sm90_parts import varlen_bwd_dq_parts_kernel

    heads_q = q.shape[1]
    num_work = tiles.shape[0] * heads_q
    delta_from_o = out is not None
    res = dq_parts_resources(cfg, q.shape[-1], v.shape[-1], delta_from_o)
    (q_desc, q_lo), (k_desc, k_lo), (v_desc, v_lo), (do_desc, do_lo) = (
        part_descriptors(q, cfg.block_m), part_descriptors(k, cfg.block_n), part_descriptors(v, cfg.block_n),
        part_descriptors(dout, cfg.block_m))
    o_desc, o_lo = part_descriptors(out, cfg.block_m) if delta_from_o else (None, None)
    args = (q_desc, k_desc, v_desc, do_desc, o_desc, q_lo, k_lo, v_lo, do_lo, o_lo, lse, delta, dq, tiles,
            *seq_args, *dq.stride()[:2], lse.stride()[0], heads_q, heads_q // k.shape[1], scale * LOG2E, scale,
            *mask_scalars(mask), section, num_work)
    fast_launch.launch(varlen_bwd_dq_parts_kernel, (num_work,), args, dict(
        HEAD_DIM=q.shape[-1], HEAD_DIM_V=v.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        **mask_constexprs(mask), DELTA_FROM_O=delta_from_o, CONSUMER_REGS=res["consumer_regs"],
        PRODUCER_REGS=res["producer_regs"], num_warps=4, maxnreg=res["maxnreg"]))
