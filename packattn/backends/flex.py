"""FlexAttention backend (CUDA) with a BlockMask built from the descriptor in O(number of blocks).

The packed batch is one long sequence to FlexAttention. Every query row sees one contiguous
interval of physical key rows (its own sequence's keys cut by the mask rules, see
`packattn.mask.key_range`), so the mask_mod is an interval test, and per query block the
union / intersection of its rows' intervals give the partial / full key blocks directly.
"""

from __future__ import annotations

import inspect

import torch

from packattn import mask as masks
from packattn.backends.base import Backend, Problem, empty_rows_lse, zero_padding_rows
from packattn.tree import blocks as tree_blocks
from packattn.varlen import Varlen

BLOCK_SIZE = 128
_BIG = 2**30
_compiled = None


# Compiled flex_attention specialises on shapes (each batch of new total lengths compiles once). Past
# dynamo's recompile limit (8 by default) it would silently fall back to the eager flex_attention,
# which materialises (heads, rows, rows) scores: 256 GB on a 64k-token batch (seen in a bench run with
# nine workloads in one process). The calls run with this limit instead.
FLEX_RECOMPILE_LIMIT = 1024


def _compiled_flex():
    """flex_attention compiled once per process, called with `FLEX_RECOMPILE_LIMIT` as dynamo's
    recompile limit (under an outer torch.compile: the plain function, the outer compile owns it)."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention import flex_attention as _flex

        compiled = torch.compile(_flex.flex_attention, dynamic=False)

        def run(*args, **kwargs):
            if torch.compiler.is_compiling():
                return _flex.flex_attention(*args, **kwargs)
            limits = dict(recompile_limit=FLEX_RECOMPILE_LIMIT, accumulated_recompile_limit=FLEX_RECOMPILE_LIMIT)
            with torch._dynamo.config.patch(**limits):
                return compiled(*args, **kwargs)

        _compiled = run
    return _compiled


class FlexBackend(Backend):
    name = "flex"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA (FlexAttention on CPU evaluates masks densely)"
        try:  # imported where used: it costs about half a second
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as e:  # pragma: no cover - old torch
            return f"torch {torch.__version__} has no FlexAttention ({e})"
        return None

    def unsupported(self, params) -> str | None:
        if params.device_type != "cuda":
            return f"needs CUDA tensors, got {params.device_type}"
        if params.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {params.dtype} not supported"
        if params.head_dim != params.head_dim_v or params.head_dim not in (16, 32, 64, 128, 256):
            return f"head dims {params.head_dim}/{params.head_dim_v}: needs equal q/v head dims in 16, 32, 64, 128, 256"
        if params.deterministic:
            return "FlexAttention's backward is not guaranteed deterministic"
        return None

    def run(self, problem: Problem):
        from torch.nn.attention import flex_attention as _flex

        seqs = problem.seqs
        if isinstance(seqs, Varlen):
            block_mask = seqs.cached(("flex_block_mask", problem.mask, BLOCK_SIZE),
                                     lambda: build_block_mask(seqs, problem.mask))
        else:  # a packattn.Tree
            block_mask = seqs.cached(("flex_tree_block_mask", BLOCK_SIZE), lambda: build_tree_block_mask(seqs))
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (problem.q, problem.k, problem.v))
        kwargs = {"block_mask": block_mask, "scale": problem.scale, "enable_gqa": q.shape[1] != k.shape[1]}
        params = inspect.signature(_flex.flex_attention).parameters
        lse = None
        if problem.return_lse and "return_aux" in params:
            out, aux = _compiled_flex()(q, k, v, return_aux=_flex.AuxRequest(lse=True), **kwargs)
            lse = aux.lse
        elif problem.return_lse:
            out, lse = _compiled_flex()(q, k, v, return_lse=True, **kwargs)
        else:
            out = _compiled_flex()(q, k, v, **kwargs)
        out = out[0].transpose(0, 1)
        if lse is not None:
            lse = empty_rows_lse(lse[0].float())
        if not isinstance(seqs, Varlen):
            return out, lse  # a tree has no padding rows and every row sees itself
        return zero_padding_rows(out, lse, seqs)


def row_key_intervals(seqs: Varlen, mask: masks.Mask) -> tuple[torch.Tensor, torch.Tensor]:
    """For every physical query row, its visible physical key rows ``[lo, hi)`` (empty: lo == hi == 0)."""
    seq, pos = seqs.row_map_q()
    valid = seq >= 0
    d = seq.clamp_min(0)
    if seqs.num_seqs == 0:
        zero = torch.zeros_like(pos)
        return zero, zero
    len_q, len_kv = seqs.seqlens_q.long()[d], seqs.seqlens_kv.long()[d]
    aligned = pos + masks.offset(mask, len_q, len_kv)
    lo, hi = masks.key_range(mask, aligned, len_kv)
    nonempty = valid & (lo < hi)
    start = seqs.starts_kv.long()[d]
    lo = torch.where(nonempty, start + lo, torch.zeros_like(lo))
    hi = torch.where(nonempty, start + hi, torch.zeros_like(hi))
    return lo, hi


def _block_lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (count, indices) per query block from a boolean (query blocks, key blocks) matrix."""
    num = sel.sum(1, dtype=torch.int32)
    idx = torch.argsort((~sel).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def build_tree_block_mask(tree, block: int = BLOCK_SIZE):
    """BlockMask of a `packattn.Tree` (`packattn.tree.blocks`): key ``s`` is visible to queries
    ``s <= t < key_end[s]``."""
    from torch.nn.attention import flex_attention as _flex

    total = tree.total
    key_end = tree.row_subtree_end().to(torch.int32)
    kinds = tree_blocks.block_kinds(key_end, total, block, block)
    kv_num, kv_idx = _block_lists(kinds == tree_blocks.MASKED)
    full_num, full_idx = _block_lists(kinds == tree_blocks.FULL)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < key_end[kv_idx])

    return _flex.BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(total, total)
    )


def build_block_mask(seqs: Varlen, mask: masks.Mask, block: int = BLOCK_SIZE):
    from torch.nn.attention import flex_attention as _flex

    lo, hi = row_key_intervals(seqs, mask)
    tq, tk = seqs.total_q, seqs.total_kv
    nq, nk = -(-tq // block), -(-tk // block)
    empty = lo >= hi
    pad = nq * block - tq
    lo_e = torch.nn.functional.pad(torch.where(empty, _BIG, lo), (0, pad), value=_BIG).view(nq, block)
    hi_e = torch.nn.functional.pad(torch.where(empty, -_BIG, hi), (0, pad), value=-_BIG).view(nq, block)
    any_lo, any_hi = lo_e.amin(1, keepdim=True), hi_e.amax(1, keepdim=True)
    full_lo, full_hi = lo_e.amax(1, keepdim=True), hi_e.amin(1, keepdim=True)
    kb_start = torch.arange(nk, device=lo.device)[None, :] * block
    kb_end = kb_start + block
    touched = (kb_start < any_hi) & (kb_end > any_lo)
    full = (kb_start >= full_lo) & (kb_end <= full_hi)
    partial = touched & ~full

    kv_num, kv_idx = _block_lists(partial)
    full_num, full_idx = _block_lists(full)
    row_lo, row_hi = lo.to(torch.int32), hi.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= row_lo[q_idx]) & (kv_idx < row_hi[q_idx])

    return _flex.BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(tq, tk)
    )
