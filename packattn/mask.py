"""Mask semantics: the one place that says which key a query sees.

Within one sequence with ``Lq`` queries and ``Lk`` keys, query ``i`` is first *aligned* to a key
position ``a(i)``:

* bottom-right (default, flash-attn convention): ``a(i) = i + Lk - Lq`` -- the last query lines up
  with the last key;
* top-left (``causal="top_left"``): ``a(i) = i``.

Then key ``j`` (``0 <= j < Lk``) is visible iff every enabled rule lets it through:

* ``causal``:              ``j <= a(i)``
* ``window=(left, right)``: ``a(i) - left <= j <= a(i) + right`` (``-1`` = unbounded on that side)
* ``chunk_size=c``:         ``j // c == a(i) // c`` (floor division; a query aligned before key 0
  sees nothing)

Pictures (``x`` = visible), 4 queries, 6 keys::

    causal (bottom-right)    causal="top_left"     window=(1, 0)          chunk_size=2, causal
    x x x . . .              x . . . . .           . x x . . .            . . x . . .
    x x x x . .              x x . . . .           . . x x . .            . . x x . .
    x x x x x .              x x x . . .           . . . x x .            . . . . x .
    x x x x x x              x x x x . .           . . . . x x            . . . . x x

A query row that sees no key produces zeros and ``lse = -inf``.

Everything here works on Python ints and on integer tensors alike, so the reference backend,
the block-mask builders and the kernel launchers all use the same formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mask:
    """Which keys each query sees; hashable, so it is part of the dispatch key."""

    causal: bool = False
    window: tuple[int, int] | None = None
    chunk_size: int | None = None
    align: str = "bottom_right"

    @classmethod
    def make(cls, causal=False, window=None, chunk_size=None) -> Mask:
        """Validate the user's options and build a canonical Mask. The two plain masks (causal or not,
        no window, no chunks: most calls) are built once and shared (a Mask is frozen)."""
        plain = window is None and chunk_size is None and (causal is True or causal is False or causal is None)
        if plain and cls is Mask:
            return _PLAIN[causal is True]
        if causal is True or causal == "bottom_right":
            is_causal, align = True, "bottom_right"
        elif causal == "top_left":
            is_causal, align = True, "top_left"
        elif causal is False or causal is None:
            is_causal, align = False, "bottom_right"
        else:
            raise ValueError(f"causal must be True, False, 'bottom_right' or 'top_left', got {causal!r}")
        if window is not None:
            if not isinstance(window, (tuple, list)) or len(window) != 2:
                raise ValueError(f"window must be a (left, right) pair, got {window!r}")
            for side, w in zip(("left", "right"), window):
                if isinstance(w, bool) or not isinstance(w, int) or w < -1:
                    raise ValueError(f"window {side} must be an int >= -1 (-1 = unbounded), got {w!r}")
            left, right = int(window[0]), int(window[1])
            if is_causal and right != -1:
                right = min(right, 0)
            if is_causal and right == -1:
                right = 0
            window = None if (left, right) == (-1, -1) or (is_causal and (left, right) == (-1, 0)) else (left, right)
        if chunk_size is not None:
            if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
                raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return cls(causal=is_causal, window=window, chunk_size=chunk_size, align=align)

    @property
    def is_full(self) -> bool:
        return not self.causal and self.window is None and self.chunk_size is None

    @property
    def left(self) -> int:
        return -1 if self.window is None else self.window[0]

    @property
    def right(self) -> int:
        """Keys visible past the aligned diagonal; -1 = unbounded. Causal means 0."""
        if self.window is not None:
            return self.window[1]
        return 0 if self.causal else -1

    def describe(self) -> str:
        parts = []
        if self.causal:
            parts.append("causal" + ("(top_left)" if self.align == "top_left" else ""))
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.chunk_size is not None:
            parts.append(f"chunk={self.chunk_size}")
        return "+".join(parts) or "full"


_PLAIN = {True: Mask(causal=True), False: Mask()}  # the plain masks `Mask.make` shares


def offset(mask: Mask, len_q, len_kv):
    """Shift from query index to aligned key position: ``a(i) = i + offset``."""
    return (len_kv - len_q) if mask.align == "bottom_right" else (len_kv - len_kv)


def _floor_div(a, b):
    if isinstance(a, torch.Tensor):
        return torch.div(a, b, rounding_mode="floor")
    return a // b


def _min(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


def _max(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def key_range(mask: Mask, aligned, len_kv):
    """Visible keys of a query aligned at ``aligned``: the half-open interval ``[lo, hi)``.

    Every rule keeps an interval, so their composition is one interval; ``lo >= hi`` means none.
    """
    lo, hi = 0 * aligned, aligned * 0 + len_kv
    if mask.right >= 0:
        hi = _min(hi, aligned + mask.right + 1)
    if mask.left >= 0:
        lo = _max(lo, aligned - mask.left)
    if mask.chunk_size is not None:
        c = mask.chunk_size
        start = _floor_div(aligned, c) * c
        lo = _max(lo, start)
        hi = _min(hi, start + c)
    return lo, hi


def block_key_range(mask: Mask, q_start, q_end, len_q, len_kv):
    """For queries ``[q_start, q_end)`` of one sequence (non-empty block): keys any of them may see
    ``[lo, hi)`` and keys all of them see ``[full_lo, full_hi)`` (no element mask needed there).

    Kernels skip key blocks outside ``[lo, hi)`` and mask elements only outside the full range.
    """
    off = offset(mask, len_q, len_kv)
    first, last = q_start + off, q_end - 1 + off
    lo_first, hi_first = key_range(mask, first, len_kv)
    lo_last, hi_last = key_range(mask, last, len_kv)
    # lo and hi are non-decreasing in the aligned position (each rule's bounds are), so the
    # union of the rows' intervals is spanned by the first row's lo and the last row's hi
    # and the intersection by the last row's lo and the first row's hi.
    return lo_first, hi_last, lo_last, hi_first


def block_query_range(mask: Mask, k_start, k_end, len_q, len_kv):
    """For keys ``[k_start, k_end)`` of one sequence (non-empty, inside ``[0, len_kv)``): queries any
    of which sees some key of the block ``[lo, hi)`` and queries that see every key of the block
    ``[full_lo, full_hi)``; lower ends are ``>= 0``, upper ends ``<= len_q``, and ``lo >= hi`` means none.

    The inverse of `block_key_range`, used by backward kernels that walk, per key block, the
    queries that can see it. ``lo(a)``/``hi(a)`` of `key_range` are non-decreasing in the aligned
    position ``a`` and a row's visible keys are one interval, so each set is an interval of ``a``;
    per rule (``j`` a key of the block, ``last = k_end - 1``, ``S(a) = floor(a / c) * c``):

    * some key:  ``a >= k_start - right``, ``a <= last + left``, ``S(a) + c > k_start``, ``S(a) <= last``;
    * every key: ``a >= last - right``, ``a <= k_start + left``, ``S(a) + c > last``, ``S(a) <= k_start``.
    """
    off = offset(mask, len_q, len_kv)
    last = k_end - 1
    # aligned positions of the sequence's queries: [off, off + len_q)
    lo = full_lo = 0 * k_start + off
    hi = full_hi = 0 * k_start + off + len_q
    if mask.right >= 0:
        lo = _max(lo, k_start - mask.right)
        full_lo = _max(full_lo, last - mask.right)
    if mask.left >= 0:
        hi = _min(hi, last + mask.left + 1)
        full_hi = _min(full_hi, k_start + mask.left + 1)
    if mask.chunk_size is not None:
        c = mask.chunk_size
        first_chunk, last_chunk = _floor_div(k_start, c) * c, _floor_div(last, c) * c
        lo = _max(lo, first_chunk)
        hi = _min(hi, last_chunk + c)
        full_lo = _max(full_lo, last_chunk)
        full_hi = _min(full_hi, first_chunk + c)
    return lo - off, hi - off, full_lo - off, full_hi - off


def visible(mask: Mask, q_pos: torch.Tensor, k_pos: torch.Tensor, len_q, len_kv) -> torch.Tensor:
    """Boolean visibility of key position ``k_pos`` to query position ``q_pos`` (broadcasting).

    ``len_q``/``len_kv`` are the sequence lengths (ints or broadcastable tensors); positions
    outside ``[0, len)`` are invisible.
    """
    aligned = q_pos + offset(mask, len_q, len_kv)
    lo, hi = key_range(mask, aligned, len_kv)
    ok = (k_pos >= lo) & (k_pos < hi) & (k_pos >= 0) & (q_pos >= 0) & (q_pos < len_q)
    return ok


def dense_mask(mask: Mask, len_q: int, len_kv: int, device=None) -> torch.Tensor:
    """The ``(len_q, len_kv)`` boolean matrix of one sequence (small sizes only)."""
    q = torch.arange(len_q, device=device)[:, None]
    k = torch.arange(len_kv, device=device)[None, :]
    return visible(mask, q, k, len_q, len_kv)
