"""Launcher of the warp-specialised Gluon tree forward for Hopper (`packattn.ops.tree.fwd_sm90`).

`gluon_tree_fwd` does what the body of ``packattn::tree_fwd`` (`packattn.backends.triton_tree`) does
for the Triton tree forward, with TMA descriptors instead of raw pointers for q, k and v. The
query tables must be built with this kernel's block sizes::

    block_m, block_n = tree_fwd_blocks(head_dim)       # 128, 128 (d = 64 / 128)
    tiles, intervals = build_query_tiles(key_end, total, block_m, block_n)
    if use_gluon_tree_fwd(q, k, v):
        out, lse = gluon_tree_fwd(q, k, v, key_end, tiles, intervals, scale)

`use_gluon_tree_fwd` says whether it should run (sm_90, float16 / bfloat16, head dim 64 / 128,
TMA-compatible tensors, not Triton's interpreter; ``PACKATTN_TRITON_FWD=triton`` keeps the Triton
tree forward, as for varlen). Configurations are the varlen Gluon forward's warp-specialised ones
(`triton_fwd_gluon.CONFIGS`: persistent grid, direct store); ``$PACKATTN_GLUON_TREE_FWD_CONFIG``
("block_m,block_n,stages,num_warps,ws[,persistent][,direct]", `triton_fwd_gluon.parse_config`)
overrides them for A/B runs.
"""

from __future__ import annotations

import torch

from packattn import env
from packattn.ops.runtime import fast_launch
from packattn.backends.triton_base import interpreting
from packattn.ops.varlen.launch_sm90_fwd import (CONFIGS, LOG2E, GluonConfig, _as_tma_tensor, _descriptor,
                                                gluon_fwd_supported, heads_per_section, parse_config, shared_bytes,
                                                ws_grid, ws_split)

ENV_TREE_CONFIG = "PACKATTN_GLUON_TREE_FWD_CONFIG"


def tree_config(head_dim: int) -> GluonConfig:
    """The warp-specialised configuration of the tree forward at ``head_dim`` (``$PACKATTN_GLUON_TREE_FWD_CONFIG``
    overrides the table; it must name a warp-specialised one)."""
    override = env.get(ENV_TREE_CONFIG)
    cfg = parse_config(override) if override else CONFIGS[head_dim]
    if not cfg.warp_specialize:
        raise ValueError(f"{ENV_TREE_CONFIG}={override!r}: the Gluon tree forward is warp-specialised only (add ',ws')")
    return cfg


def tree_fwd_blocks(head_dim: int) -> tuple[int, int]:
    """``(block_m, block_n)`` to build the query tables (`triton_tree.build_query_tiles`) with."""
    cfg = tree_config(head_dim)
    return cfg.block_m, cfg.block_n


def tree_shared_bytes(cfg: GluonConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one CTA: the varlen forward's (Q, K/V ring, barriers) plus key_end per ring slot."""
    return shared_bytes(cfg, head_dim, element_size) + 4 * cfg.stages * cfg.block_n


def tree_ws_resources(cfg: GluonConfig, head_dim: int) -> dict:
    """Occupancy and register split (`triton_fwd_gluon.ws_split`) of the tree forward."""
    return ws_split(cfg.num_warps, tree_shared_bytes(cfg, head_dim))


def use_gluon_tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Run `gluon_tree_fwd` instead of the Triton tree forward: CUDA sm_90, float16 / bfloat16, head
    dim 64 / 128, TMA-compatible tensors, not Triton's interpreter, and ``$PACKATTN_TRITON_FWD`` is
    not ``triton``."""
    if interpreting() or not q.is_cuda or env.get("PACKATTN_TRITON_FWD") == "triton":
        return False
    return gluon_fwd_supported(q, k, v)


def gluon_tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_end: torch.Tensor, tiles: torch.Tensor,
                   intervals: torch.Tensor, scale: float, config: GluonConfig | None = None,
                   max_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of tree attention, as ``packattn::tree_fwd``: q ``(total, heads_q, d)``, k / v
    ``(total, heads_kv, d)``, ``key_end`` int32 ``(total,)`` (`Tree.row_subtree_end`), ``tiles`` /
    ``intervals`` from ``build_query_tiles(key_end, total, *tree_fwd_blocks(d))`` (``config``'s blocks
    when given: it replaces `tree_config`), ``scale >= 0`` (the backend flips q otherwise).
    ``max_programs`` caps a persistent grid (tests: many work items per program)."""
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
    cfg = config or tree_config(head_dim)
    res = tree_ws_resources(cfg, head_dim)
    fast_launch.launch(tree_fwd_gluon_kernel, (ws_grid(q.device, cfg, num_work, res, max_programs),), (
        _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n), out, lse,
        key_end.to(torch.int32).contiguous(), tiles, intervals, out.stride(0), out.stride(1), lse.stride(0),
        total, heads_q, heads_q // k.shape[1], scale * LOG2E, num_work,
        heads_per_section(heads_q, heads_q // k.shape[1])), dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        DIRECT_STORE=cfg.direct_store, CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"],
        num_warps=4, maxnreg=res["maxnreg"]))
    return out, lse
