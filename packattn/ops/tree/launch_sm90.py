"""Launchers of the warp-specialised sm_90 Gluon tree kernels: the forward (`gluon_tree_fwd`,
`packattn.ops.tree.fwd_sm90`) and dQ (`gluon_tree_dq`, `packattn.ops.tree.dq_sm90`), with the configs of
`packattn.ops.tree.configs`. The tree's dK/dV is the varlen one with the tree mask
(`packattn.ops.varlen.launch_sm90.gluon_dkdv(..., key_end=...)`). The query tables must be built with the
config's blocks (`packattn.ops.tree.tables.build_query_tiles`); ``scale >= 0``.
"""

from __future__ import annotations

import functools

import torch

from packattn.ops.runtime import fast_launch
from packattn.ops.runtime.launch import LOG2E
from packattn.ops.runtime.sm90 import _as_tma_tensor, _descriptor, ws_grid, ws_split
from packattn.ops.varlen.configs import GluonBwdConfig, GluonConfig, heads_per_section
from packattn.ops.varlen.launch_sm90 import dq_resources, dq_shared_bytes, shared_bytes


def tree_fwd_shared_bytes(cfg: GluonConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one forward CTA: the varlen forward's (Q, K/V ring, barriers) plus key_end per ring slot."""
    return shared_bytes(cfg, head_dim, element_size) + 4 * cfg.stages * cfg.block_n


@functools.lru_cache(maxsize=None)
def tree_fwd_resources(cfg: GluonConfig, head_dim: int) -> dict:
    """Occupancy and register split (`sm90.ws_split`) of the tree forward (cached: configs are frozen)."""
    return ws_split(cfg.num_warps, tree_fwd_shared_bytes(cfg, head_dim))


def tree_dq_shared_bytes(cfg: GluonBwdConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one dQ CTA: the varlen warp-specialised dQ's plus the ring of the blocks' ``key_end``."""
    return dq_shared_bytes(cfg, head_dim, element_size) + 4 * cfg.stages * cfg.block_n


@functools.lru_cache(maxsize=None)
def tree_dq_resources(cfg: GluonBwdConfig, head_dim: int) -> dict:
    """Register split of the tree dQ (cached, as `tree_fwd_resources`): at d = 128 (128 x 64, 4 stages) one
    CTA per SM, maxnreg 168, consumers 240, producer 24."""
    dq_resources(cfg, head_dim)  # validates the config
    return ws_split(cfg.num_warps, tree_dq_shared_bytes(cfg, head_dim))


def gluon_tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_end: torch.Tensor, tiles: torch.Tensor,
                   intervals: torch.Tensor, scale: float, cfg: GluonConfig,
                   max_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of tree attention, as ``packattn::tree_fwd``: q ``(total, heads_q, d)``, k / v
    ``(total, heads_kv, d)``, ``key_end`` int32 ``(total,)`` (`Tree.row_subtree_end`), ``tiles`` /
    ``intervals`` built with ``cfg``'s blocks. ``max_programs`` caps the persistent grid (tests)."""
    from packattn.ops.tree.fwd_sm90 import tree_fwd_gluon_kernel

    if not q.shape[0] == k.shape[0] == v.shape[0] == key_end.shape[0]:
        # the kernel relies on K / V rows past `total` reading as zeros (TMA out of bounds)
        raise ValueError(f"q, k, v and key_end need the tree's rows: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}, "
                         f"{key_end.shape[0]}")
    q, k, v = (_as_tma_tensor(x) for x in (q, k, v))
    total, heads_q, head_dim = q.shape
    out = q.new_empty(q.shape)
    lse = torch.empty((heads_q, total), device=q.device, dtype=torch.float32)
    num_work = tiles.shape[0] * heads_q
    if num_work == 0 or total == 0:
        return out, lse
    res = tree_fwd_resources(cfg, head_dim)
    fast_launch.launch(tree_fwd_gluon_kernel, (ws_grid(q.device, num_work, res, max_programs),), (
        _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n), out, lse,
        key_end.to(torch.int32).contiguous(), tiles, intervals, out.stride(0), out.stride(1), lse.stride(0),
        total, heads_q, heads_q // k.shape[1], scale * LOG2E, num_work,
        heads_per_section(heads_q, heads_q // k.shape[1])), dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4,
        maxnreg=res["maxnreg"]))
    return out, lse


def gluon_tree_dq(q, k, v, dout, lse, delta, dq, tiles, intervals, key_end, scale: float,
                  cfg: GluonBwdConfig) -> None:
    """dQ of tree attention into ``dq`` (every row): one program per (query tile, query head). ``tiles`` /
    ``intervals`` built with ``cfg``'s blocks; ``key_end``: int32 `Tree.row_subtree_end`; ``lse`` / ``delta``
    float32 ``(heads_q, total)``. Tensors that TMA cannot read as ``(rows, heads * d)`` matrices are copied."""
    from packattn.ops.tree.dq_sm90 import tree_dq_gluon_ws_kernel

    total, heads_q, head_dim = q.shape
    grid = (tiles.shape[0] * heads_q,)
    if grid[0] == 0 or total == 0:
        return
    q, k, v, dout = (_as_tma_tensor(x) for x in (q, k, v, dout))
    lse, delta = lse.contiguous(), delta.contiguous()
    res = tree_dq_resources(cfg, head_dim)
    fast_launch.launch(tree_dq_gluon_ws_kernel, grid, (
        _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
        _descriptor(dout, cfg.block_m), lse, delta, dq, tiles, intervals, key_end,
        dq.stride(0), dq.stride(1), lse.stride(0), total, heads_q, heads_q // k.shape[1],
        heads_per_section(heads_q, heads_q // k.shape[1]), scale * LOG2E, scale), dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4, maxnreg=res["maxnreg"]))
