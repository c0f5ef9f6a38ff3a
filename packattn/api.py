"""Public entry points: `attention()` and the `DotProductAttention` module."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from packattn import dispatch
from packattn.backends.base import Problem
from packattn.mask import Mask
from packattn.varlen import Varlen

if TYPE_CHECKING:
    from packattn.tree import Tree

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYOUTS = ("thd", "bshd", "sbhd")


def _check_tensors(q, k, v, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; packattn takes float16, bfloat16, float32 or float64")
        want = 3 if layout == "thd" else 4
        if t.dim() != want:
            raise ValueError(f"{name} must be {want}-D for layout={layout!r}, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    hq, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
    if hk != hv:
        raise ValueError(f"k has {hk} heads but v has {hv}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hk}) for GQA/MQA")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} != k head_dim {k.shape[-1]}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError("head_dim must be positive")


@functools.lru_cache(maxsize=64)
def _dense_descriptor(batch: int, seqlen_q: int, seqlen_kv: int, device: torch.device) -> Varlen:
    """One descriptor per dense shape and device, so the per-batch metadata backends cache on it
    (tile tables, block masks) is built once, not on every layer's call."""
    return Varlen.uniform(batch, seqlen_q, seqlen_kv, device)


def _as_tree(seqs):
    """``seqs`` when it is a `packattn.Tree`, else None (the tree package is imported lazily)."""
    if seqs is None or isinstance(seqs, Varlen):
        return None
    from packattn.tree import Tree

    return seqs if isinstance(seqs, Tree) else None


def check_tree_mask(causal, window, chunk_size) -> None:
    """A Tree is its own mask, causal by definition: ``causal`` unset (None) or True, no window or chunks."""
    if causal is False:
        raise ValueError("a Tree is causal by definition (a token sees its ancestors and its own node up to "
                         "itself): leave causal unset or pass causal=True")
    if causal not in (None, True) or window is not None or chunk_size is not None:
        raise ValueError("a Tree defines its own mask (ancestors and the causal prefix of the own node): "
                         "causal='top_left', window and chunk_size do not apply")


def _to_thd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "sbhd":
        x = x.transpose(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])


def _to_problem(q, k, v, seqs, layout: str, mask: Mask, causal, window, chunk_size):
    """``(q, k, v, seqs, mask, dense)`` of a checked call in THD: the descriptor on q's device (a dense batch's
    uniform one, ``dense = (batch, seqlen_q, seqlen_kv)``) and the mask dispatch keys on (a Tree's: causal)."""
    tree = _as_tree(seqs)
    if tree is not None:
        if layout != "thd":
            raise ValueError(f"a Tree descriptor needs layout='thd', got {layout!r}")
        check_tree_mask(causal, window, chunk_size)
        seqs = tree.to(q.device)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[0] != seqs.total:
                raise ValueError(f"{name} has {t.shape[0]} rows but the tree packs {seqs.total} tokens")
        mask = Mask.make(True)  # the causal part of the tree rule, for dispatch keys
        return q, k, v, seqs, mask, None
    if layout == "thd":
        if not isinstance(seqs, Varlen):
            raise TypeError(
                f"layout='thd' needs a packattn.Varlen descriptor as seqs, got {type(seqs).__name__}; "
                "pass layout='bshd' or 'sbhd' for dense batches"
            )
        if seqs.device != q.device:  # (`Varlen.to` returns the descriptor itself then)
            seqs = seqs.to(q.device)
        if q.shape[0] != seqs.total_q:
            raise ValueError(f"q has {q.shape[0]} rows but the descriptor describes total_q={seqs.total_q}")
        if k.shape[0] != seqs.total_kv or v.shape[0] != seqs.total_kv:
            raise ValueError(f"k/v have {k.shape[0]}/{v.shape[0]} rows but the descriptor describes total_kv={seqs.total_kv}")
        return q, k, v, seqs, mask, None
    if seqs is not None:
        raise ValueError(f"layout={layout!r} is a dense batch: pass seqs=None (use layout='thd' with a descriptor)")
    b_axis = 0 if layout == "bshd" else 1
    batch, sq, sk = q.shape[b_axis], q.shape[1 - b_axis], k.shape[1 - b_axis]
    if k.shape[b_axis] != batch or v.shape[b_axis] != batch or v.shape[1 - b_axis] != sk:
        raise ValueError(f"q, k, v batch/sequence sizes disagree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    dense = (batch, sq, sk)
    # (under torch.compile the cache is bypassed on purpose: dynamo traces the builder, and warns when it
    # meets an lru_cache wrapper)
    make = _dense_descriptor.__wrapped__ if torch.compiler.is_compiling() else _dense_descriptor
    seqs = make(batch, sq, sk, q.device)
    return _to_thd(q, layout), _to_thd(k, layout), _to_thd(v, layout), seqs, mask, dense



def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale of a call: ``scale``, or ``1 / sqrt(head_dim)`` when None; ValueError unless finite."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return scale


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: Varlen | Tree | None = None,
    *,
    causal: bool | str | None = None,
    window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
    layout: str = "thd",
):
    """Attention over a packed batch (``layout="thd"`` with a `Varlen`) or a dense one.

    * ``thd``: ``q (total_q, heads_q, d)``, ``k, v (total_kv, heads_kv, d)`` and ``seqs`` a `Varlen`.
    * ``bshd`` / ``sbhd``: ``(batch, seq, heads, d)`` / ``(seq, batch, heads, d)``, ``seqs=None``.
    * a `packattn.Tree` as ``seqs`` (thd): tree attention, q, k, v with ``tree.total`` rows; the tree
      is the mask (a token sees its ancestors' tokens and its own node's up to itself).

    Masks (see `packattn.mask`): ``causal`` (True = bottom-right aligned, or "top_left"),
    ``window=(left, right)`` with -1 unbounded, ``chunk_size``. GQA/MQA when heads_q % heads_kv == 0.
    Returns ``out`` (input dtype, same layout as q), or ``(out, lse)`` with ``return_lse=True``:
    lse float32 ``(heads_q, total_q)`` for thd, ``(batch, heads_q, seq_q)`` for dense layouts.
    Rows in no sequence are exact zeros in out and in the gradients; a row that sees no key
    gives zeros and lse -inf.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    _check_tensors(q, k, v, layout)
    mask = Mask.make(causal, window, chunk_size)
    scale = resolve_scale(scale, q.shape[-1])

    qt, kt, vt, seqs, mask, dense = _to_problem(q, k, v, seqs, layout, mask, causal, window, chunk_size)
    return_lse, deterministic = bool(return_lse), bool(deterministic)
    params = dispatch.call_params(
        seqs, device_type=q.device.type, dtype=q.dtype, heads_q=q.shape[-2], heads_kv=k.shape[-2],
        head_dim=q.shape[-1], head_dim_v=v.shape[-1], mask=mask, dense=dense is not None, return_lse=return_lse,
        deterministic=deterministic,
        requires_grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    chosen = dispatch.select(params, backend)
    problem = Problem(qt, kt, vt, seqs, mask, float(scale), return_lse, deterministic, dense)
    out, lse = chosen.run(problem)

    if dense is not None:
        batch, sq, _ = dense
        out = out.view(batch, sq, out.shape[-2], out.shape[-1])
        if layout == "sbhd":
            out = out.transpose(0, 1)
        if lse is not None:
            lse = lse.view(lse.shape[0], batch, sq).transpose(0, 1)
    return (out, lse) if return_lse else out


class DotProductAttention(nn.Module):
    """`attention()` as a module that holds the mask options and the backend choice."""

    def __init__(
        self,
        *,
        causal: bool | str | None = None,
        window: tuple[int, int] | None = None,
        chunk_size: int | None = None,
        scale: float | None = None,
        backend: str = "auto",
        deterministic: bool = False,
        layout: str = "thd",
    ):
        super().__init__()
        Mask.make(causal, window, chunk_size)  # validate early
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        self.causal, self.window, self.chunk_size = causal, window, chunk_size
        self.scale, self.backend, self.deterministic, self.layout = scale, backend, deterministic, layout

    def forward(self, q, k, v, seqs: Varlen | None = None, *, return_lse: bool = False):
        return attention(
            q, k, v, seqs,
            causal=self.causal, window=self.window, chunk_size=self.chunk_size, scale=self.scale,
            backend=self.backend, return_lse=return_lse, deterministic=self.deterministic, layout=self.layout,
        )

    def extra_repr(self) -> str:
        mask = Mask.make(self.causal, self.window, self.chunk_size)
        return f"mask={mask.describe()}, backend={self.backend}, layout={self.layout}"
