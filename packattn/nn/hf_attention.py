"""The attention half of ``attn_implementation="packattn"``: transformers' attention hook.

`packattn_attention` runs `packattn.attention` with the layer's `HFMask` (see `packattn.nn.hf_mask`) and,
for packed or padded batches, a descriptor found in this order:

1. ``packattn_descriptor=`` passed to the model call (a `Varlen` or a `Tree`);
2. ``cu_seq_lens_q`` / ``max_length_q`` (what ``DataCollatorWithFlattening`` gives flash-attn);
3. the padding mask: each row's real tokens laid in a slot of the row's length;
4. ``position_ids`` (no cached keys): a new sequence starts at every row start and wherever a position
   id is not the previous one plus 1 (e.g. restarting at 0), transformers' own rule. One host sync
   per forward, shared by the layers.

Anything else runs as a dense ``bshd`` batch.
"""

from __future__ import annotations

import torch

import packattn
from packattn.nn.hf_mask import DESCRIPTOR_KWARG, NAME, HFMask, read_on_host
from packattn.tree import Tree
from packattn.varlen import Varlen


# ------------------------------------------------------------------------------- packed descriptors
def _varlen_from_position_ids(position_ids: torch.Tensor, batch: int, seqlen: int) -> Varlen | None:
    """Sequences of a ``(batch, seq)`` batch laid back to back: a new one starts at every row start and
    wherever a position id is not the previous plus 1. None when each row is one sequence.
    Host sync: the sequence starts are read back once."""
    if position_ids.dim() != 2 or position_ids.shape[-1] != seqlen or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not describe a ({batch}, {seqlen}) "
                         f"batch; pass {DESCRIPTOR_KWARG}= to describe the packing")
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([batch * seqlen], device=pos.device)])
    cu = cu.cpu()
    if cu.numel() == batch + 1:
        return None
    return Varlen.from_cu_seqlens(cu, max_seqlen_q=int(cu.diff().max()))


def _slots(starts: list[int], lengths: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens, cu_seqlens_padded) of sequences starting at physical rows ``starts`` (increasing)."""
    return torch.tensor([0, *lengths]).cumsum(0), torch.tensor([*starts, total])


def _varlen_from_spans(mask: HFMask, batch: int) -> Varlen:
    """Row ``b`` of the batch holds one sequence: keys at key rows ``mask.spans[b]`` of a slot of
    ``kv_used`` rows, queries at the same tokens' query rows (those at or past ``q_shift``) of a slot
    of ``q_length`` rows, so both runs end at the same token and masks stay bottom-right aligned.
    Where `q_shift` is None every query row is real."""
    q_len, kv_len, shift = mask.q_length, mask.kv_used, mask.q_shift
    kv_starts, kv_lengths, q_starts, q_lengths = [], [], [], []
    for row, (start, end) in enumerate(mask.spans):
        kv_starts.append(row * kv_len + start)
        kv_lengths.append(end - start)
        if shift is None:
            q_starts.append(row * q_len)
            q_lengths.append(q_len)
        else:
            first_query = min(max(start, shift), end)
            q_starts.append(row * q_len + first_query - shift)
            q_lengths.append(end - first_query)
    if kv_starts[0] or q_starts[0]:  # the first slot starts at row 0: an empty sequence covers the rows before
        kv_starts, kv_lengths, q_starts, q_lengths = [0, *kv_starts], [0, *kv_lengths], [0, *q_starts], [0, *q_lengths]
    cu_q, cu_q_padded = _slots(q_starts, q_lengths, batch * q_len)
    if shift == 0:
        return Varlen.from_cu_seqlens(cu_q, max_seqlen_q=max(q_lengths), cu_seqlens_q_padded=cu_q_padded)
    cu_kv, cu_kv_padded = _slots(kv_starts, kv_lengths, batch * kv_len)
    return Varlen.from_cu_seqlens(cu_q, cu_kv, max_seqlen_q=max(q_lengths), max_seqlen_kv=max(kv_lengths),
                                  cu_seqlens_q_padded=cu_q_padded, cu_seqlens_kv_padded=cu_kv_padded)


def _given_descriptor(mask: HFMask, kwargs: dict) -> Varlen | Tree | None:
    """The descriptor the caller passed (``packattn_descriptor=`` or flash-attn's ``cu_seq_lens_q``)."""
    given = kwargs.get(DESCRIPTOR_KWARG)
    cu = kwargs.get("cu_seq_lens_q")
    if given is None and cu is None:
        return None
    if not mask.fresh or mask.spans is not None:
        raise ValueError("a packed batch cannot be combined with cached keys or a padding mask: pass use_cache=False "
                         f"and no attention_mask with {DESCRIPTOR_KWARG}= or cu_seq_lens_q=")
    if given is None:
        read_on_host("cu_seq_lens_q")
        return mask.cached("cu_seq_lens_q", lambda: Varlen.from_cu_seqlens(
            cu, max_seqlen_q=int(kwargs.get("max_length_q") or int(cu.diff().max()))))
    if not isinstance(given, (Varlen, Tree)):
        raise TypeError(f"{DESCRIPTOR_KWARG} must be a packattn.Varlen or packattn.Tree, got {type(given).__name__}")
    return given


def _descriptor(mask: HFMask, kwargs: dict, batch: int) -> Varlen | Tree | None:
    """The packed descriptor of this call, or None for a dense batch."""
    given = _given_descriptor(mask, kwargs)
    if given is not None:
        return given
    if mask.spans is not None:
        return mask.cached("padding", lambda: _varlen_from_spans(mask, batch))
    position_ids = kwargs.get("position_ids")
    if mask.fresh and position_ids is not None:
        read_on_host("the position_ids (to find packed sequences)")
        return mask.cached("position_ids", lambda: _varlen_from_position_ids(position_ids, batch, mask.q_length))
    if mask.packed:
        raise ValueError("transformers found packed sequences but the attention call got no position_ids; "
                         f"pass {DESCRIPTOR_KWARG}=")
    return None


# ------------------------------------------------------------------------------ attention function
def _check_call(module, mask, query, key, dropout, kwargs) -> tuple[HFMask, bool, int | None]:
    """(mask, causal, sliding window) of the call: its `HFMask` (one made from the module when the model
    built no mask) and what the layer runs; raises on anything the mask or packattn cannot honour."""
    layer_causal = kwargs.get("is_causal")
    layer_causal = bool(getattr(module, "is_causal", True) if layer_causal is None else layer_causal)
    if mask is None:  # the model built no mask: the layer decides
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = HFMask(batch_size=query.shape[0], causal=layer_causal, window=None, packed=False, q_length=q_len,
                      kv_length=kv_len, q_shift=kv_len - q_len if layer_causal else None)
    elif not isinstance(mask, HFMask):
        raise TypeError(f"attn_implementation='{NAME}' cannot honour a precomputed attention mask "
                        f"({type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}); "
                        "pass a 2-D padding mask, packed position_ids or a packattn descriptor")
    if dropout:
        raise NotImplementedError(f"attn_implementation='{NAME}' has no attention dropout (got {dropout}); "
                                  "set the config's attention_dropout to 0")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='{NAME}' does not support {name}; "
                                      "use attn_implementation='eager' for this model")
    if mask.from_layer:
        return mask, layer_causal, kwargs.get("sliding_window")
    if kwargs.get("is_causal") is not None and bool(kwargs["is_causal"]) != mask.causal:
        raise ValueError(f"the call asks for is_causal={kwargs['is_causal']} but the model's mask has "
                         f"causal={mask.causal}")
    if kwargs.get("sliding_window") is not None and kwargs["sliding_window"] != mask.window:
        raise ValueError(f"the layer asks for sliding_window={kwargs['sliding_window']} but its mask has {mask.window}")
    if (query.shape[2], key.shape[2]) != (mask.q_length, mask.kv_length):
        raise ValueError(f"the mask was built for {mask.q_length} queries and {mask.kv_length} keys, the layer has "
                         f"{query.shape[2]} and {key.shape[2]}")
    return mask, mask.causal, mask.window


def packattn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention hook: query ``(batch, heads_q, seq_q, d)``, key/value
    ``(batch, heads_kv, seq_kv, d)`` -> ``(out (batch, seq_q, heads_q, d_v), None)``."""
    mask, causal, window = _check_call(module, attention_mask, query, key, dropout, kwargs)
    window = None if window is None else (window - 1, 0)
    batch, heads_q, seq_q, _ = query.shape
    # (batch, seq, heads, d); keys past the last query are empty static-cache slots
    q = query.transpose(1, 2)
    k, v = (t[:, :, :mask.kv_used].transpose(1, 2) for t in (key, value))
    seqs = _descriptor(mask, kwargs, batch)
    if seqs is None:
        out = packattn.attention(q, k, v, causal=causal, window=window, scale=scaling, layout="bshd")
        return out, None
    if isinstance(seqs, Tree) and (not causal or window is not None):
        raise ValueError("a packattn.Tree is causal by construction; this layer asks for a non-causal or windowed mask")
    thd = [t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v)]
    out = packattn.attention(*thd, seqs, causal=causal, window=window, scale=scaling)
    return out.view(batch, seq_q, heads_q, out.shape[-1]), None
