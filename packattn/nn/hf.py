"""Hugging Face transformers integration: ``attn_implementation="packattn"``.

    import packattn.nn.hf
    packattn.nn.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packattn")

`register()` adds two functions to transformers' public registries under one name:

* the **mask function** (``AttentionMaskInterface``). transformers calls it once per forward in
  place of building a ``(batch, 1, q, kv)`` mask. It reads the mask transformers asked for (causal
  or bidirectional, sliding window, padding) and returns a small `HFMask` that every layer receives
  as ``attention_mask``. A mask piece packattn cannot honour raises instead of being dropped.
* the **attention function** (``AttentionInterface``), which runs `packattn.attention` with that
  mask and, for packed batches, a descriptor found in this order:

  1. ``packattn_descriptor=`` passed to the model call (a `Varlen` or a `Tree`); transformers
     forwards unknown keyword arguments to the attention function. With a `Tree`, pass
     ``input_ids=tree.tokens[None]`` and ``position_ids=tree.position_ids[None]``.
  2. ``cu_seq_lens_q`` / ``max_length_q`` (what ``DataCollatorWithFlattening`` gives flash-attn).
  3. ``position_ids``: a new sequence starts wherever a position id is not the previous one plus 1
     (e.g. restarting at 0), transformers' own rule. Finding the lengths reads the position ids on
     the host: one device sync per forward (computed by the first layer and kept on the `HFMask`).
     Pass a descriptor to avoid it.

Without packing, a ``(batch, seq)`` batch runs as dense ``bshd`` attention. A padding mask is
honoured when every row is right-padded (real tokens first); any other padding raises.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

import packattn
from packattn.tree import Tree
from packattn.varlen import Varlen

NAME = "packattn"
DESCRIPTOR_KWARG = "packattn_descriptor"

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function
except ImportError as err:  # pragma: no cover
    raise ImportError(f"packattn.nn.hf needs transformers>=5 (pip install 'packattn[hf]'): {err}") from err


@dataclass(eq=False)
class HFMask:
    """What the model's mask asks for, without a dense mask. One per forward, shared by its layers."""

    causal: bool
    window: int | None  # transformers' sliding_window: key k is visible to query q iff q - k < window
    fresh: bool  # no cached keys: queries and keys are the same tokens
    packed: bool  # transformers saw position ids that do not increase by 1 (packed sequences)
    lengths: tuple[int, ...] | None = None  # real length of each right-padded row (None: no padding)
    _cache: dict = field(default_factory=dict, repr=False)

    def cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


# ------------------------------------------------------------------------------------ mask function
def _mask_pieces(fn) -> list:
    """The leaves of a transformers mask function built with ``and_masks``."""
    if getattr(fn, "__qualname__", "") == "and_masks.<locals>.and_mask":
        return [leaf for f in inspect.getclosurevars(fn).nonlocals["mask_functions"] for leaf in _mask_pieces(f)]
    return [fn]


def _read_mask_function(fn) -> tuple[bool, int | None, bool]:
    """(causal, sliding window, packed) of a transformers mask function; raises on any other piece."""
    causal = bidirectional = packed = False
    window = None
    for piece in _mask_pieces(fn):
        name = getattr(piece, "__qualname__", repr(piece))
        if piece is causal_mask_function:
            causal = True
        elif piece is bidirectional_mask_function:
            bidirectional = True
        elif name == "sliding_window_overlay.<locals>.inner_mask":
            window = int(inspect.getclosurevars(piece).nonlocals["sliding_window"])
        elif name == "packed_sequence_mask_function.<locals>.inner_mask":
            packed = True  # the attention function finds the sequences itself
        else:
            raise NotImplementedError(
                f"attn_implementation='packattn' cannot honour the transformers mask piece {name!r}; "
                "use attn_implementation='sdpa' or 'eager' for this model")
    if causal == bidirectional:
        raise NotImplementedError(f"attn_implementation='packattn' cannot read the mask function {fn!r}")
    return causal, window, packed


def _right_padded_lengths(attention_mask: torch.Tensor) -> tuple[int, ...] | None:
    """Real length of each row of a 2-D padding mask (None when nothing is padded); ValueError unless
    every row is right-padded. Reads the mask on the host (one sync per forward)."""
    keep = attention_mask.bool()
    lengths = keep.sum(-1)
    right_padded = keep == (torch.arange(keep.shape[-1], device=keep.device) < lengths[:, None])
    if not bool(right_padded.all()):
        raise ValueError("attn_implementation='packattn' honours right padding only (real tokens first in every "
                         "row); this attention_mask pads elsewhere. Pack the sequences instead (position_ids "
                         f"restarting at 0 or {DESCRIPTOR_KWARG}=), or use attn_implementation='sdpa'")
    lengths = tuple(lengths.tolist())
    return None if all(n == keep.shape[-1] for n in lengths) else lengths


def packattn_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                  mask_function=causal_mask_function, attention_mask=None, **kwargs) -> HFMask:
    """transformers' mask hook for packattn: an `HFMask`, never a dense mask."""
    causal, window, packed = _read_mask_function(mask_function)
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        raise NotImplementedError("attn_implementation='packattn' does not support static caches; use DynamicCache")
    fresh = q_offset == 0 and kv_offset == 0 and q_length == kv_length
    if (causal or window is not None) and q_offset + q_length != kv_offset + kv_length:
        raise NotImplementedError(
            f"attn_implementation='packattn' aligns queries with the last keys; this call has queries at "
            f"{q_offset}..{q_offset + q_length} but keys at {kv_offset}..{kv_offset + kv_length}")
    lengths = None
    if attention_mask is not None:
        lengths = _right_padded_lengths(attention_mask[:, -kv_length:])
        if lengths is not None and not fresh:
            raise ValueError("attn_implementation='packattn' honours a padding mask only without cached keys")
    return HFMask(causal=causal, window=window, fresh=fresh, packed=packed, lengths=lengths)


# ------------------------------------------------------------------------------- packed descriptors
def _varlen_from_position_ids(position_ids: torch.Tensor, batch: int, seqlen: int) -> Varlen | None:
    """Sequences of a ``(batch, seq)`` batch laid back to back: a new one starts at every row start and
    wherever a position id is not the previous plus 1. None when each row is one sequence.
    Host sync: the sequence starts are read back once."""
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([batch * seqlen], device=pos.device)])
    cu = cu.cpu()
    if cu.numel() == batch + 1:
        return None
    return Varlen.from_cu_seqlens(cu, max_seqlen_q=int(cu.diff().max()))


def _varlen_from_right_padding(lengths: tuple[int, ...], seqlen: int) -> Varlen:
    """Row ``i`` holds ``lengths[i]`` real tokens at the start of a slot of ``seqlen`` rows."""
    cu = torch.tensor([0, *lengths]).cumsum(0)
    slots = torch.arange(len(lengths) + 1) * seqlen
    return Varlen.from_cu_seqlens(cu, max_seqlen_q=max(lengths), cu_seqlens_q_padded=slots)


def _descriptor(mask: HFMask, kwargs: dict, batch: int, seqlen: int) -> Varlen | Tree | None:
    """The packed descriptor of this call, or None for a dense batch."""
    given = kwargs.get(DESCRIPTOR_KWARG)
    cu = kwargs.get("cu_seq_lens_q")
    if given is not None or cu is not None:
        if not mask.fresh or mask.lengths is not None:
            raise ValueError("a packed batch cannot be combined with cached keys or a padding mask")
        if given is None:
            return mask.cached("cu_seq_lens_q", lambda: Varlen.from_cu_seqlens(
                cu, max_seqlen_q=int(kwargs.get("max_length_q") or int(cu.diff().max()))))
        if not isinstance(given, (Varlen, Tree)):
            raise TypeError(f"{DESCRIPTOR_KWARG} must be a packattn.Varlen or packattn.Tree, "
                            f"got {type(given).__name__}")
        return given
    if mask.lengths is not None:
        return mask.cached("padding", lambda: _varlen_from_right_padding(mask.lengths, seqlen))
    position_ids = kwargs.get("position_ids")
    if mask.fresh and position_ids is not None:
        return mask.cached("position_ids", lambda: _varlen_from_position_ids(position_ids, batch, seqlen))
    if mask.packed:
        raise ValueError("transformers found packed sequences but the attention call got no position_ids; "
                         f"pass {DESCRIPTOR_KWARG}=")
    return None


# ------------------------------------------------------------------------------ attention function
def packattn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention hook: query ``(batch, heads_q, seq_q, d)``, key/value
    ``(batch, heads_kv, seq_kv, d)`` -> ``(out (batch, seq_q, heads_q, d_v), None)``."""
    if attention_mask is None:  # the model built no mask: its own causality flag decides
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        attention_mask = HFMask(causal=causal, window=None, fresh=query.shape[2] == key.shape[2], packed=False)
    elif not isinstance(attention_mask, HFMask):
        raise TypeError(f"attn_implementation='packattn' cannot honour a precomputed attention mask "
                        f"({type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}); "
                        "pass a 2-D padding mask, packed position_ids or a packattn descriptor")
    if dropout:
        raise NotImplementedError(f"attn_implementation='packattn' has no attention dropout (got {dropout})")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='packattn' does not support {name}")
    mask = attention_mask
    if kwargs.get("is_causal") is not None and bool(kwargs["is_causal"]) != mask.causal:
        raise ValueError(f"the call asks for is_causal={kwargs['is_causal']} but the model's mask has "
                         f"causal={mask.causal}")
    if kwargs.get("sliding_window") is not None and kwargs["sliding_window"] != mask.window:
        raise ValueError(f"the layer asks for sliding_window={kwargs['sliding_window']} but its mask has {mask.window}")
    window = None if mask.window is None else (mask.window - 1, 0)

    batch, heads_q, seq_q, _ = query.shape
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seq, heads, d)
    seqs = _descriptor(mask, kwargs, batch, seq_q)
    if seqs is None:
        out = packattn.attention(q, k, v, causal=mask.causal, window=window, scale=scaling, layout="bshd")
        return out, None
    if isinstance(seqs, Tree) and (not mask.causal or window is not None):
        raise ValueError("a packattn.Tree is causal by construction; this layer asks for a non-causal or windowed mask")
    thd = [t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v)]
    out = packattn.attention(*thd, seqs, causal=mask.causal, window=window, scale=scaling)
    return out.view(batch, seq_q, heads_q, out.shape[-1]), None


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default "packattn") available to every transformers model.
    Registers the attention function and its mask function together; calling it again is harmless."""
    AttentionInterface.register(name, packattn_attention)
    AttentionMaskInterface.register(name, packattn_mask)
