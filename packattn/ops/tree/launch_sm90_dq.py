"""Launcher of the warp-specialised Gluon dQ of tree attention (`packattn.ops.tree.dq_sm90`).

`use_gluon_tree_dq(q, k, v)` says whether the tree backward (`triton_tree.tree_bwd`) runs it instead
of the Triton `tree.tree_dq_kernel`: sm_90, float16 / bfloat16, GQA, the Gluon dQ config
(`triton_bwd_gluon.dq_config`) warp-specialised and with the Triton dQ pass's blocks (128 queries x 64
keys at head dim 128), so that the dQ tables `triton_tree.tree_tables` builds from
``launch_config("dq", ...)`` fit both kernels. It depends only on dtypes, shapes, device and the
environment; ``PACKATTN_TRITON_BWD=triton`` keeps Triton. `gluon_tree_dq(...)` launches it.
"""

from __future__ import annotations

import torch

from packattn import env
from packattn.ops.runtime import fast_launch
from packattn.backends.triton_base import interpreting


def use_gluon_tree_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Run the Gluon tree dQ (module docstring) on these tensors?"""
    if interpreting() or not q.is_cuda or env.get("PACKATTN_TRITON_BWD") == "triton":
        return False
    from packattn.ops.varlen.launch_sm90_bwd import dq_config, gluon_bwd_eligible
    from packattn.backends.triton_varlen import launch_config

    if not gluon_bwd_eligible(q, k, v):
        return False
    cfg = dq_config(q.shape[-1])
    triton_cfg = launch_config("dq", q.shape[-1], q.dtype, q.device)
    return cfg.warp_specialize and (cfg.block_m, cfg.block_n) == (triton_cfg.block_m, triton_cfg.block_n)


def tree_dq_shared_bytes(cfg, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one CTA: the warp-specialised dQ's (`triton_bwd_gluon.dq_ws_shared_bytes`) plus
    the ring of the blocks' ``key_end`` (``stages x block_n`` int32)."""
    from packattn.ops.varlen.launch_sm90_bwd import dq_ws_shared_bytes

    return dq_ws_shared_bytes(cfg, head_dim, element_size) + 4 * cfg.stages * cfg.block_n


def tree_dq_ws_resources(cfg, head_dim: int) -> dict:
    """Register split of the kernel (`triton_fwd_gluon.ws_split`, as `triton_bwd_gluon.dq_ws_resources`
    with this kernel's shared memory): at d = 128 (128 x 64, 4 stages) one CTA per SM, maxnreg 168,
    consumers 240, producer 24."""
    from packattn.ops.varlen.launch_sm90_bwd import dq_ws_resources
    from packattn.ops.varlen.launch_sm90_fwd import ws_split

    dq_ws_resources(cfg, head_dim)  # validates the config (block_m 128, block_n 64 / 128, 8 warps, ws)
    return ws_split(cfg.num_warps, tree_dq_shared_bytes(cfg, head_dim))


def gluon_tree_dq(q, k, v, dout, lse, delta, dq, tiles, intervals, key_end, scale: float) -> None:
    """dQ of tree attention into ``dq`` (every row): one program per (query tile, query head). ``tiles``
    / ``intervals``: `triton_tree.build_query_tiles` with ``dq_config(d).block_m`` / ``.block_n``;
    ``key_end``: int32 `Tree.row_subtree_end`; ``lse`` / ``delta`` float32 ``(heads_q, total)``; ``scale
    >= 0``. Tensors that TMA cannot read as ``(rows, heads * d)`` matrices are copied."""
    from packattn.ops.varlen.launch_sm90_bwd import dq_config
    from packattn.ops.varlen.launch_sm90_fwd import LOG2E, _as_tma_tensor, _descriptor, heads_per_section
    from packattn.ops.tree.dq_sm90 import tree_dq_gluon_ws_kernel

    total, heads_q, head_dim = q.shape
    grid = (tiles.shape[0] * heads_q,)
    if grid[0] == 0 or total == 0:
        return
    q, k, v, dout = (_as_tma_tensor(x) for x in (q, k, v, dout))
    lse, delta = lse.contiguous(), delta.contiguous()
    cfg = dq_config(head_dim)
    res = tree_dq_ws_resources(cfg, head_dim)
    fast_launch.launch(tree_dq_gluon_ws_kernel, grid, (
        _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
        _descriptor(dout, cfg.block_m), lse, delta, dq, tiles, intervals, key_end,
        dq.stride(0), dq.stride(1), lse.stride(0), total, heads_q, heads_q // k.shape[1],
        heads_per_section(heads_q, heads_q // k.shape[1]), scale * LOG2E, scale), dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4, maxnreg=res["maxnreg"]))
