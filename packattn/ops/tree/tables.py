"""Tables of the tree kernels (`packattn.Tree`), built once per tree and block size with device ops (cached on
the `Tree`, no host sync). The tree is one "sequence" of ``total`` rows; key ``s`` is visible to queries
``s <= t < key_end[s]`` with ``key_end = tree.row_subtree_end()``.

* query tiles (forward, dQ): per key block ``j`` the min / max of ``key_end`` over its rows; key block ``j``
  is *visible* to query tile ``[m0, m1)`` when ``n0 < m1`` and ``max_end > m0``, and *full* (no element mask)
  when it is complete, ``n1 - 1 <= m0`` and ``min_end >= m1``. Runs of consecutive blocks of the same kind
  (0 invisible, 1 masked, 2 full) become intervals ``[lo, hi, kind]``; each tile row is
  ``[q_start, first_interval, num_intervals]``. This compares every (query tile, key block) pair:
  ``O(total^2 / (BLOCK_M * BLOCK_N))`` small integers.
* key tiles (dK/dV, the varlen row format ``[0, k_start, lo, mid_lo, mid_hi, hi]``): the queries that see key
  tile ``[n0, n1)`` are ``[n0, max_end)``, every pair visible for queries in ``[n1 - 1, min_end)``.
"""

from __future__ import annotations

import torch

from packattn.ops.tree import configs as tree_configs
from packattn.ops.varlen.op import bwd_plan
from packattn.ops.varlen.tiles import unmasked_band
from packattn.tree.blocks import FULL, MASKED, block_end_range, block_kinds  # noqa: F401 (kinds re-exported)


def build_query_tiles(key_end: torch.Tensor, total: int, block_m: int, block_n: int):
    """``(tiles int32 (num_tiles, 3), intervals int32 (n, 3))`` for the forward and dQ kernels."""
    device = key_end.device
    nq, nk = -(-total // block_m), -(-total // block_n)
    kind = block_kinds(key_end, total, block_m, block_n)
    padded = torch.nn.functional.pad(kind, (1, 1))  # (nq, nk + 2), zero columns on both sides
    change = padded[:, 1:] != padded[:, :-1]  # (nq, nk + 1): a run of one kind starts at block c
    # boundaries in row-major order, without a host sync: scatter each into its rank among all
    # boundaries; unused slots (and the dump slot at the end) keep kind 0
    flat = change.flatten()
    slots = nq * (nk + 1)
    rank = torch.cumsum(flat.to(torch.int64), 0) - 1
    where = torch.where(flat, rank, torch.full_like(rank, slots))
    column = torch.arange(nk + 1, device=device).repeat(nq)
    starts = torch.zeros(slots + 1, dtype=torch.int64, device=device).scatter_(0, where, column)
    kinds = torch.zeros(slots + 1, dtype=torch.int64, device=device).scatter_(
        0, where, padded[:, 1:].flatten().long())
    # a run ends where the next boundary (same row: every row ends with a change to kind 0) starts
    ends = torch.cat([starts[1:], starts.new_zeros(1)])
    intervals = torch.stack([starts * block_n, (ends * block_n).clamp(max=nk * block_n), kinds], 1)
    counts = change.sum(1)
    first = torch.cumsum(counts, 0) - counts
    m0 = torch.arange(nq, device=device) * block_m
    tiles = torch.stack([m0, first, counts], 1)
    order = torch.argsort((kind > 0).sum(1), descending=True, stable=True)  # longest work first
    return tiles[order].to(torch.int32).contiguous(), intervals.to(torch.int32).contiguous()


def build_key_tiles(key_end: torch.Tensor, total: int, block_n: int, step: int) -> torch.Tensor:
    """``int32 (num_key_tiles, 6)`` rows ``[0, k_start, lo, mid_lo, mid_hi, hi]`` (query positions),
    the row format of the varlen dK/dV kernel."""
    device = key_end.device
    nk = -(-total // block_n)
    n0 = torch.arange(nk, device=device) * block_n
    n1 = (n0 + block_n).clamp(max=total)
    low, high = block_end_range(key_end, total, block_n)
    lo, hi = n0, high.clamp(max=total)
    empty = lo >= hi
    mid_lo, mid_hi = unmasked_band(lo, hi, n1 - 1, low.clamp(max=total), step, empty)
    order = torch.argsort(hi - lo, descending=True, stable=True)
    table = torch.stack([torch.zeros_like(n0), n0, lo, mid_lo, mid_hi, hi], 1)[order]
    return table.to(torch.int32).contiguous()


def tree_tables(tree, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_grad: bool) -> tuple:
    """(key_end, fwd tiles, fwd intervals, dq tiles, dq intervals, dkdv tiles, extents), cached on the tree.
    Built for the kernels `packattn.ops.tree.configs` picks on these tensors (`fwd_blocks`, `dq_blocks`) and
    for the dK/dV pass of the varlen rule (`bwd_plan`): both sides decide from dtypes, shapes and device only,
    so they agree."""
    device = q.device
    fwd_blocks = tree_configs.fwd_blocks(q, k, v)
    total = tree.total
    key_end = tree.cached("triton_tree_key_end", lambda: tree.row_subtree_end().to(torch.int32).contiguous())

    def query_tables(block_m: int, block_n: int):
        return tree.cached(("triton_tree_query_tiles", block_m, block_n),
                           lambda: build_query_tiles(key_end, total, block_m, block_n))

    fwd_tiles, fwd_intervals = query_tables(*fwd_blocks)
    if need_grad:
        dkdv_keys, dkdv_step = bwd_plan(q, k, v).dkdv_choice[:2]
        dq_tiles, dq_intervals = query_tables(*tree_configs.dq_blocks(q, k, v))
        dkdv_tiles = tree.cached(("triton_tree_key_tiles", dkdv_keys, dkdv_step),
                                 lambda: build_key_tiles(key_end, total, dkdv_keys, dkdv_step))
    else:
        dq_tiles, dq_intervals, dkdv_tiles = fwd_tiles[:0], fwd_intervals[:0], fwd_tiles.new_empty(0, 6)
    # the dK/dV kernel reads the tree as one sequence of `total` rows
    extents = tree.cached("triton_tree_extents",
                          lambda: (torch.tensor([0, total], dtype=torch.int32, device=device),
                                   torch.zeros(1, dtype=torch.int32, device=device)))
    return key_end, fwd_tiles, fwd_intervals, dq_tiles, dq_intervals, dkdv_tiles, extents
