"""Block-level view of the tree mask, shared by the Triton tree kernels' tables and the
FlexAttention BlockMask: key ``s`` is visible to queries ``s <= t < key_end[s]``
(``key_end = Tree.row_subtree_end()``), so per key block the min / max of ``key_end`` decide
which query blocks see some / every pair of it. Device ops only (no host sync)."""

from __future__ import annotations

import torch

INVISIBLE, MASKED, FULL = 0, 1, 2


def block_end_range(key_end: torch.Tensor, total: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block`` rows: (min, max) of ``key_end`` over its real rows (int64)."""
    blocks = -(-total // block)
    pad = blocks * block - total
    ke = key_end.long()
    low = torch.nn.functional.pad(ke, (0, pad), value=total + 1).view(blocks, block).amin(1)
    high = torch.nn.functional.pad(ke, (0, pad), value=0).view(blocks, block).amax(1)
    return low, high


def block_kinds(key_end: torch.Tensor, total: int, block_m: int, block_n: int) -> torch.Tensor:
    """``int32 (query blocks, key blocks)``: `INVISIBLE` (no pair visible), `MASKED` (some), `FULL`
    (every pair visible and the key block complete, so no element mask is needed).

    Compares every pair of blocks: ``O(total^2 / (block_m * block_n))`` small integers."""
    device = key_end.device
    nq, nk = -(-total // block_m), -(-total // block_n)
    m0 = torch.arange(nq, device=device) * block_m
    m1 = (m0 + block_m).clamp(max=total)
    n0 = torch.arange(nk, device=device) * block_n
    n1 = (n0 + block_n).clamp(max=total)
    low, high = block_end_range(key_end, total, block_n)
    visible = (n0[None, :] < m1[:, None]) & (high[None, :] > m0[:, None])
    full = visible & (n0 + block_n <= total)[None, :] & ((n1 - 1)[None, :] <= m0[:, None]) \
        & (low[None, :] >= m1[:, None])
    return visible.to(torch.int32) + full.to(torch.int32)
