"""The mask half of ``attn_implementation="packattn"``: transformers' mask hook.

transformers calls `packattn_mask` once per forward and mask kind (full / sliding) in place of building
a ``(batch, 1, q, kv)`` mask. It returns an `HFMask`: what the mask asks for (causal or bidirectional,
sliding window, packed sequences) and, per batch row, the one run of key rows that holds real tokens.
Every layer of that kind receives it as ``attention_mask``.

Key rows, query rows. The attention call gets ``q_length`` queries and ``kv_length`` keys per row.
For a causal or windowed mask, query ``j`` is the token at key row ``q_shift + j`` (``q_shift`` = query
offset - key offset: the cached keys in front of the queries); keys past the last query
(``q_shift + q_length``) are never real tokens (they are the empty slots of a static cache), so they
are dropped. A 2-D padding mask may then remove keys at the start of a row (left padding) or at its
end (right padding, before any token is cached); each row's real keys must stay one contiguous run.
The real queries of a row are its real keys that are queries, so they end with the run: causal and
windowed masks stay aligned at the bottom right. A bidirectional mask without a window does not
depend on where the queries sit (``q_shift`` is None: cross-attention too): every query is real and
sees its row's run of real keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

try:
    from transformers import masking_utils
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
except ImportError as err:  # pragma: no cover
    raise ImportError(f"packattn.nn.hf needs transformers>=5 (pip install 'packattn[hf]'): {err}") from err

NAME = "packattn"
DESCRIPTOR_KWARG = "packattn_descriptor"


@dataclass(eq=False)
class HFMask:
    """What the model's mask asks for, without a dense mask. One per forward and mask kind, shared by
    the layers of that kind (they also share the descriptors built from it, see `cached`).

    It stands where transformers keeps a prepared 4-D mask (``generate()`` with a static cache builds
    the masks before the forward): ``ndim``, ``shape`` and ``contiguous()`` answer as that mask would,
    and the mask hook hands an `HFMask` it receives back unchanged."""

    ndim = 4

    batch_size: int
    causal: bool
    window: int | None  # transformers' sliding_window: key k is visible to query q iff q - k < window
    packed: bool  # transformers saw position ids that do not increase by 1 (packed sequences)
    q_length: int
    kv_length: int
    # key row of query 0 (the number of cached keys in front of the queries); None: bidirectional without
    # a window, where every query sees every key of its row
    q_shift: int | None = 0
    # per batch row, the real key rows [start, end); None: rows [0, kv_used) of every row
    spans: tuple[tuple[int, int], ...] | None = None
    # causal and window are the layer's (its is_causal and sliding_window): set while torch.compile traces,
    # where transformers' mask function cannot be taken apart
    from_layer: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch_size, 1, self.q_length, self.kv_length

    def contiguous(self) -> HFMask:
        return self

    @property
    def kv_used(self) -> int:
        """Key rows up to the last query (the rest are empty static-cache slots); every row when
        `q_shift` is None."""
        return self.kv_length if self.q_shift is None else self.q_shift + self.q_length

    @property
    def fresh(self) -> bool:
        """No cached keys: the keys in use are the queries' own tokens (for a mask that does not place the
        queries: as many keys as queries)."""
        return self.q_length == self.kv_length if self.q_shift is None else self.q_shift == 0

    def cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


# ------------------------------------------------------------------------------- mask function pieces
def _closure(fn) -> dict:
    """The variables a nested function closes over, by name."""
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def _mask_pieces(fn) -> tuple[list, bool]:
    """(leaves, packed) of a transformers mask function. Leaves of ``and_masks`` are collected; the
    packed-sequence pieces are taken off: the position remapping (on a packed sequence, positions and
    rows differ by a constant, so a causal or windowed mask reads the same on either) and the
    same-sequence piece (the attention function finds the sequences itself)."""
    name = getattr(fn, "__qualname__", "")
    if name == "and_masks.<locals>.and_mask":
        leaves, packed = [], False
        for sub in _closure(fn)["mask_functions"]:
            sub_leaves, sub_packed = _mask_pieces(sub)
            leaves += sub_leaves
            packed |= sub_packed
        return leaves, packed
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _mask_pieces(_closure(fn)["mask_function"])[0], True
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return [], True
    return [fn], False


def _nested_code(make) -> object:
    """The code object of the nested functions a transformers mask builder returns (None if it has none)."""
    try:
        return make().__code__
    except (AttributeError, TypeError):  # a builder this transformers does not have
        return None


# while torch.compile traces, a nested function's closure cannot be read, only its code object
_COMPOSED_CODES = tuple(code for code in (
    _nested_code(lambda: masking_utils.and_masks(causal_mask_function)),
    _nested_code(lambda: masking_utils.remap_positions_for_packed_sequence(causal_mask_function, None)),
) if code is not None)


def read_traced_mask_function(fn) -> tuple[bool, bool]:
    """(causal, from_layer) of a mask function inside a traced graph: causal and bidirectional read
    directly; ``and_masks`` and the packed-position remapping (whose pieces cannot be read there) leave
    causality and window to the layer; anything else raises."""
    if fn is causal_mask_function or fn is bidirectional_mask_function:
        return fn is causal_mask_function, False
    if any(getattr(fn, "__code__", None) is code for code in _COMPOSED_CODES):
        return True, True
    raise NotImplementedError(
        f"attn_implementation='{NAME}' cannot read this transformers mask function inside a graph traced by "
        "torch.compile (it is not built from and_masks: e.g. or_masks for image tokens or bidirectional "
        "windows); use attn_implementation='sdpa' or 'eager' for this model, or run it uncompiled")


def read_mask_function(fn) -> tuple[bool, int | None, bool]:
    """(causal, sliding window, packed) of a transformers mask function; NotImplementedError on a piece
    packattn cannot honour (it is never dropped silently)."""
    causal = bidirectional = False
    window = None
    leaves, packed = _mask_pieces(fn)
    for piece in leaves:
        name = getattr(piece, "__qualname__", None) or type(piece).__name__
        if piece is causal_mask_function:
            causal = True
        elif piece is bidirectional_mask_function:
            bidirectional = True
        elif name == "sliding_window_overlay.<locals>.inner_mask":
            window = int(_closure(piece)["sliding_window"])
        else:
            raise NotImplementedError(
                f"attn_implementation='{NAME}' cannot honour the transformers mask piece {name!r} (from a model "
                "feature such as image tokens, chunked attention or a custom and_mask_function / or_mask_function); "
                "use attn_implementation='sdpa' or 'eager' for this model")
    if causal == bidirectional:
        raise NotImplementedError(f"attn_implementation='{NAME}' cannot read the mask function {fn!r}: it is "
                                  "neither causal nor bidirectional")
    return causal, window, packed


# ------------------------------------------------------------------------------------ padding mask
def _padding_spans(attention_mask: torch.Tensor, kv_offset: int, kv_used: int) -> tuple[tuple[int, int], ...] | None:
    """Per row, the run [start, end) of key rows ``0 .. kv_used`` that the 2-D padding mask keeps
    (mask column = ``kv_offset`` + key row; columns past the mask's end count as padding, as in
    transformers). None when every row keeps every key. Reads the mask on the host: one sync."""
    columns = attention_mask[:, kv_offset: kv_offset + kv_used].bool()
    if columns.shape[-1] < kv_used:
        columns = torch.nn.functional.pad(columns, (0, kv_used - columns.shape[-1]), value=False)
    counts = columns.sum(-1)
    starts = columns.int().argmax(-1)
    rows = torch.arange(kv_used, device=columns.device)
    contiguous = (columns == ((rows >= starts[:, None]) & (rows < (starts + counts)[:, None]))).all(-1)
    summary = torch.stack([starts, counts, contiguous.long()], -1).tolist()
    bad = [row for row, (_, _, ok) in enumerate(summary) if not ok]
    if bad:
        raise ValueError(
            f"attn_implementation='{NAME}' needs the real tokens of each row to be one contiguous run (left or right "
            f"padding); rows {bad} of this attention_mask have padding between real tokens. With a cache this comes "
            "from right-padded prompts: pad prompts on the left (tokenizer.padding_side = 'left'), or pack the "
            "sequences (position_ids restarting at 0, or packattn_descriptor=)")
    if all(count == kv_used for _, count, _ in summary):
        return None
    return tuple((start, start + count) if count else (0, 0) for start, count, _ in summary)


def read_on_host(what: str) -> None:
    """Raise, naming the fix, where reading ``what`` on the host would break a graph being traced."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            f"attn_implementation='{NAME}' reads {what} on the host, which a graph traced by torch.compile cannot do: "
            f"pass {DESCRIPTOR_KWARG}= (a packattn.Varlen of the batch's sequences, e.g. Varlen.from_lengths"
            "([seq_len] * batch) for unpacked rows) with no attention_mask and no static cache, compile without "
            "fullgraph=True (generate() does so by itself and builds its static-cache masks before the compiled "
            "forward), or run uncompiled")


def _query_shift(q_offset, kv_offset, q_length: int, kv_length: int, cache_position) -> int:
    """The key row of query 0 (query offset - key offset) as a host int. Static caches keep the query offset
    in a tensor, and transformers < 5.4 passes the query positions instead: reading either is one sync,
    skipped where the queries are all the keys."""
    if cache_position is not None:
        q_offset = cache_position[:1]
    if isinstance(q_offset, torch.Tensor):
        if q_length == kv_length:
            return 0
        read_on_host("the query offset of a static cache")
        q_offset = int(q_offset.reshape(-1)[0]) if q_offset.numel() else 0
    return int(q_offset) - int(kv_offset)


def packattn_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                  mask_function=causal_mask_function, attention_mask=None, cache_position=None, **kwargs) -> HFMask:
    """transformers' mask hook for packattn: an `HFMask`, never a dense mask. Takes both call forms:
    ``q_length``/``q_offset`` (transformers >= 5.4) and ``cache_position`` (earlier 5.x)."""
    if q_length is None:
        q_length = int(cache_position.shape[0])
    if isinstance(attention_mask, HFMask):  # built ahead of the forward by generate()
        if (attention_mask.batch_size, attention_mask.q_length, attention_mask.kv_length) != (batch_size, q_length,
                                                                                              kv_length):
            raise ValueError(f"the packattn mask passed in was built for {attention_mask.shape}, this forward needs "
                             f"{(batch_size, 1, q_length, kv_length)}")
        return attention_mask
    from_layer = False
    if torch.compiler.is_compiling():
        (causal, from_layer), window, packed = read_traced_mask_function(mask_function), None, False
    else:
        causal, window, packed = read_mask_function(mask_function)
    q_shift = None
    if causal or window is not None:
        q_shift = _query_shift(q_offset, kv_offset, q_length, kv_length, cache_position)
        if q_shift < 0 or q_shift + q_length > kv_length:
            raise NotImplementedError(
                f"attn_implementation='{NAME}' needs every query's own key in the keys of the call; this call has "
                f"{q_length} queries starting at key row {q_shift} of {kv_length} keys (a cache transformers sizes "
                "differently); use DynamicCache or StaticCache")
    mask = HFMask(batch_size=int(batch_size), causal=causal, window=window, packed=packed, q_length=int(q_length),
                  kv_length=int(kv_length), q_shift=q_shift, from_layer=from_layer)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise TypeError(f"attn_implementation='{NAME}' takes a 2-D padding mask, got shape "
                            f"{tuple(attention_mask.shape)}")
        read_on_host("the attention_mask")
        mask.spans = _padding_spans(attention_mask, int(kv_offset), mask.kv_used)
    return mask
