"""Inner-attention modules in the style of torchtitan: a nested ``Config`` dataclass whose ``build()``
returns the module, and ``forward(q, k, v, *, attention_masks=...)`` with q, k, v first (so context-
and tensor-parallel hooks can wrap them).

    attn = PackedAttention.Config(causal=True).build()
    out = attn(q, k, v, attention_masks=descriptor)

Layouts (``heads`` is always the second-to-last dimension, as in torchtitan's models before the
transpose to SDPA's ``(batch, heads, seq, dim)``; that SDPA layout is NOT accepted):

* dense: ``q (batch, seq_q, heads_q, dim)``, ``k, v (batch, seq_kv, heads_kv, dim)`` and
  ``attention_masks=None``;
* packed (THD): ``q (total_q, heads_q, dim)``, ``k, v (total_kv, heads_kv, dim)`` and
  ``attention_masks`` the descriptor of the step, a `packattn.Varlen` or a `packattn.Tree`, built
  once per step by the caller and passed to every layer;
* packed, torchtitan-shaped: ``(batch, seq, heads, dim)`` with a descriptor of ``batch * seq``
  rows; the rows are flattened, attended as THD, and the result given back as ``(batch, seq, ...)``.

The output has q's layout. A descriptor that does not match the tensors raises ValueError.

Tensor parallelism: when q, k, v are DTensors sharded on the heads dimension (or replicated), the
attention runs on the local shards and the result is a DTensor with q's placements. Sharding on
any other dimension is refused: sequence sharding is context parallelism, not a local computation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from packattn.api import attention
from packattn.mask import Mask
from packattn.tree import Tree
from packattn.varlen import Varlen

def _dtensor_class():
    """``torch.distributed.tensor.DTensor`` when that module is loaded, else None: no input can be a DTensor
    before it is, and importing it costs about a second (so ``import packattn.nn`` does not)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _local_map():
    """``torch.distributed.tensor.experimental.local_map``, or None on a torch without it."""
    try:
        from torch.distributed.tensor.experimental import local_map
    except ImportError:  # pragma: no cover (older torch)
        return None
    return local_map


def _descriptor_rows(descriptor) -> tuple[int, int]:
    """(query rows, key rows) that ``descriptor`` describes."""
    if isinstance(descriptor, Tree):
        return descriptor.total, descriptor.total
    return descriptor.total_q, descriptor.total_kv


def _packed(q, k, v, descriptor, options: dict) -> torch.Tensor:
    """THD attention, or ``(batch, seq, heads, dim)`` flattened to THD and shaped back."""
    rows_q, rows_kv = _descriptor_rows(descriptor)
    kind = type(descriptor).__name__
    if q.dim() == 3:
        return attention(q, k, v, descriptor, layout="thd", **options)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"with a {kind} descriptor, q, k, v must be (total, heads, dim) or (batch, seq, heads, dim); "
                         f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, seq_q = q.shape[:2]
    seq_kv = k.shape[1]
    if batch * seq_q != rows_q or k.shape[0] * seq_kv != rows_kv:
        hint = ""
        if q.shape[0] * q.shape[2] == rows_q:
            hint = "; q looks like (batch, heads, seq, dim): PackedAttention takes (batch, seq, heads, dim)"
        raise ValueError(f"the {kind} descriptor packs {rows_q} query / {rows_kv} key rows but q {tuple(q.shape)} has "
                         f"batch * seq = {batch * seq_q} and k {tuple(k.shape)} has {k.shape[0] * seq_kv}{hint}")
    flat = [t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v)]
    out = attention(*flat, descriptor, layout="thd", **options)
    return out.view(batch, seq_q, out.shape[-2], out.shape[-1])


def _dense(q, k, v, options: dict) -> torch.Tensor:
    if q.dim() != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: a packed (total, heads, dim) batch needs its descriptor as "
                         "attention_masks= (a packattn.Varlen or Tree); a dense batch is (batch, seq, heads, dim)")
    return attention(q, k, v, None, layout="bshd", **options)


def _check_tensor_parallel(q, k, v) -> None:
    """Raise unless q, k, v are DTensors on one mesh with one placement, sharded on heads or replicated."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, _dtensor_class()):
            raise TypeError(f"q is a DTensor but {name} is a {type(t).__name__}; pass all three as DTensors or none")
        if t.device_mesh != q.device_mesh or tuple(t.placements) != tuple(q.placements):
            raise ValueError(f"q and {name} must share a mesh and placements, got {q.placements} and {t.placements}")
    heads_dim = q.dim() - 2
    shards = 1
    for mesh_dim, p in enumerate(q.placements):
        if p.is_shard():
            if p.dim % q.dim() != heads_dim:
                raise ValueError(f"q is sharded on dim {p.dim} ({q.placements}); PackedAttention runs tensor-"
                                 f"parallel shards on the heads dim ({heads_dim}) only: sequence sharding is "
                                 "context parallelism")
            shards *= q.device_mesh.size(mesh_dim)
        elif not p.is_replicate():
            raise ValueError(f"placement {p} of q is not supported: shard on the heads dim or replicate")
    if q.shape[heads_dim] % shards or k.shape[heads_dim] % shards:
        raise ValueError(f"heads_q ({q.shape[heads_dim]}) and heads_kv ({k.shape[heads_dim]}) must be multiples of "
                         f"the {shards} head shards, so every shard keeps whole GQA groups")


def run_on_local_shards(fn, q, k, v):
    """``fn(q, k, v)`` on the local shards of DTensors sharded on heads; the result is a DTensor with
    q's placements. Uses ``local_map`` when this torch has it, else ``to_local`` / ``from_local``."""
    _check_tensor_parallel(q, k, v)
    placements, mesh = list(q.placements), q.device_mesh  # a list: local_map reads a tuple as one per output
    local_map = _local_map()
    if local_map is None:
        out = fn(q.to_local(), k.to_local(), v.to_local())
        return _dtensor_class().from_local(out, mesh, placements, run_check=False)
    return local_map(fn, out_placements=placements, in_placements=(placements,) * 3, device_mesh=mesh)(q, k, v)


class PackedAttention(nn.Module):
    """packattn as a torchtitan inner attention; layouts and tensor parallelism in the module docstring."""

    @dataclass
    class Config:
        backend: str = "auto"
        causal: bool | str = True  # True (bottom-right aligned), "top_left", or False
        window: tuple[int, int] | None = None
        chunk_size: int | None = None
        deterministic: bool = False

        def build(self) -> PackedAttention:
            return PackedAttention(self)

    def __init__(self, config: PackedAttention.Config | None = None):
        super().__init__()
        self.config = config = config or PackedAttention.Config()
        Mask.make(config.causal, config.window, config.chunk_size)  # validate early

    def forward(self, q, k, v, *, attention_masks: Varlen | Tree | None = None, scale: float | None = None,
                enable_gqa: bool = False, **kwargs):
        """Attention of q over k, v. ``attention_masks``: None for dense ``(batch, seq, heads, dim)``, or
        the step's `Varlen` / `Tree`. ``enable_gqa`` must be True when k, v have fewer heads than q
        (as in SDPA). Extra keyword arguments are accepted only when None (e.g. ``block_mask=None``)."""
        unknown = sorted(name for name, value in kwargs.items() if value is not None)
        if unknown:
            raise TypeError(f"PackedAttention.forward got unexpected keyword arguments {unknown}")
        if attention_masks is not None and not isinstance(attention_masks, (Varlen, Tree)):
            raise TypeError("attention_masks must be a packattn.Varlen or packattn.Tree (built once per step) or "
                            f"None for a dense batch, got {type(attention_masks).__name__}")
        if q.shape[-2] != k.shape[-2] and not enable_gqa:
            raise ValueError(f"q has {q.shape[-2]} heads but k has {k.shape[-2]}: pass enable_gqa=True for GQA/MQA")
        c = self.config
        options = dict(causal=c.causal, window=c.window, chunk_size=c.chunk_size, scale=scale, backend=c.backend,
                       deterministic=c.deterministic)

        def local(q, k, v):
            if attention_masks is None:
                return _dense(q, k, v, options)
            return _packed(q, k, v, attention_masks, options)

        dtensor = _dtensor_class()
        if dtensor is not None and isinstance(q, dtensor):
            return run_on_local_shards(local, q, k, v)
        return local(q, k, v)

    def extra_repr(self) -> str:
        c = self.config
        mask = Mask.make(c.causal, c.window, c.chunk_size).describe()
        return f"mask={mask}, backend={c.backend}" + (", deterministic" if c.deterministic else "")
