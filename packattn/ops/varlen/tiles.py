"""Tile tables of the varlen kernels, built per batch with device ops only (no host sync) and cached on the
`Varlen` (`Varlen.cached`, keyed by mask and block sizes).

One int32 row ``[seq, start, lo, mid_lo, mid_hi, hi]`` per (sequence, block), with the block's visible
range on the other side from `packattn.mask` (`block_key_range` for query tiles, `block_query_range` for
key tiles) and the fully visible band ``[mid_lo, mid_hi)`` that needs no element mask. The number of tiles
is bounded on the host by ``cdiv(total, BLOCK) + num_seqs``; surplus rows have ``seq = -1`` and their
programs exit. Rows are sorted longest-range-first so long documents do not start last.
"""

from __future__ import annotations

import torch

from packattn import mask as masks
from packattn.varlen import Varlen

TILE_FIELDS = 6  # seq, start, lo, mid_lo, mid_hi, hi


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
    """`build_tile_table`, cached on ``seqs``."""
    key = ("triton_varlen_tiles", mask, by_keys, block, step)
    return seqs.cached(key, lambda: build_tile_table(seqs, mask, by_keys, block, step))
