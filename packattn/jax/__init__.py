"""JAX entry points (optional extra: `pip install packattn[jax]`). `import packattn` never imports
JAX; importing this package does, and nothing torch- or Triton-specific beyond packattn's own import."""

from packattn.jax.small_seq import small_seq_attention, small_seq_attention_reference

__all__ = ["small_seq_attention", "small_seq_attention_reference"]
