"""Hugging Face transformers integration: ``attn_implementation="packattn"``.

    import packattn.nn.hf
    packattn.nn.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packattn")

`register()` adds two functions to transformers' public registries under one name:

* the **mask function** (`packattn.nn.hf_mask.packattn_mask`, ``AttentionMaskInterface``). transformers
  calls it once per forward and mask kind in place of building a ``(batch, 1, q, kv)`` mask. It reads
  the mask transformers asked for (causal or bidirectional, sliding window, packed sequences, padding,
  cache offsets) and returns a small `HFMask` that every layer receives as ``attention_mask``. A mask
  piece packattn cannot honour raises instead of being dropped.
* the **attention function** (`packattn.nn.hf_attention.packattn_attention`, ``AttentionInterface``),
  which runs `packattn.attention` with that mask and, for packed or padded batches, a descriptor.

What runs, and what equals the model run per sequence with ``attn_implementation="eager"``:

* **Packed training** (``use_cache=False``, with or without gradient checkpointing): pass
  ``packattn_descriptor=`` (a `Varlen` or a `Tree`; transformers forwards unknown keyword arguments to
  the attention function; with a `Tree` pass ``input_ids=tree.tokens[None]`` and
  ``position_ids=tree.position_ids[None]``), or what ``DataCollatorWithFlattening`` gives
  (``cu_seq_lens_q``/``max_length_q`` with ``return_flash_attn_kwargs=True``, else ``position_ids``
  restarting at 0: one host sync per forward to find the sequences).
* **Padding**: a 2-D ``attention_mask`` whose real tokens are one run per row, left-padded (what
  ``generate()`` uses for decoder-only models) or right-padded before anything is cached. Reading the
  mask costs one host sync per forward and mask kind.
* **generate()** with the dynamic cache (sliding-window layers included) or the static cache
  (``cache_implementation="static"``; its query offset is read on the host, so the forward runs
  uncompiled).

Without packing or padding, a ``(batch, seq)`` batch runs as dense ``bshd`` attention.

Under ``torch.compile(fullgraph=True)`` pass ``packattn_descriptor=``: transformers' mask function cannot
be taken apart inside a traced graph, so the layer's ``is_causal`` and ``sliding_window`` decide there,
and whatever needs a host read (position-id packing, ``cu_seq_lens_q``, a padding mask, a static
cache's query offset) raises a message that names the fix. Without fullgraph those reads break the
graph and run eagerly; ``generate()`` builds static-cache masks before its compiled forward.
"""

from __future__ import annotations

from packattn.nn.hf_attention import DESCRIPTOR_KWARG, packattn_attention
from packattn.nn.hf_mask import NAME, HFMask, packattn_mask

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # pragma: no cover
    raise ImportError(f"packattn.nn.hf needs transformers>=5 (pip install 'packattn[hf]'): {err}") from err

__all__ = ["DESCRIPTOR_KWARG", "HFMask", "NAME", "packattn_attention", "packattn_mask", "register"]


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default "packattn") available to every transformers model.
    Registers the attention function and its mask function together; calling it again is harmless."""
    AttentionInterface.register(name, packattn_attention)
    AttentionMaskInterface.register(name, packattn_mask)
