"""Model-facing modules: a compact reference decoder over packed tokens."""

from packattn.nn.decoder import Decoder, DecoderConfig

__all__ = ["Decoder", "DecoderConfig"]
