"""Model-facing modules: a compact reference decoder over packed tokens, and `PackedAttention`,
packattn as a torchtitan-style inner attention (``PackedAttention.Config(...).build()``)."""

from packattn.nn.attention import PackedAttention
from packattn.nn.decoder import Decoder, DecoderConfig

__all__ = ["Decoder", "DecoderConfig", "PackedAttention"]
