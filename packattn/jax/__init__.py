"""JAX entry points (optional extra: ``pip install 'packattn[jax]'``). Needs JAX only: importing this
package imports neither torch nor Triton (``import packattn`` loads its PyTorch parts on first use), so it
works where packattn was installed without its PyTorch dependencies. Without JAX it raises an ImportError
that says how to install it."""

try:
    import jax  # noqa: F401
except ImportError as error:
    raise ModuleNotFoundError(f"packattn.jax needs JAX: pip install 'packattn[jax]' ({error})", name="jax") from error

from packattn.jax.small_seq import small_seq_attention, small_seq_attention_reference  # noqa: E402

__all__ = ["small_seq_attention", "small_seq_attention_reference"]
