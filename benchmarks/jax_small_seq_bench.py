"""Time `packattn.jax.small_seq_attention` on a GPU: the Pallas path against the jax.numpy ("xla")
path and the plain reference, W9 shapes (30720 items, heads 16/16, keys 2..16, bf16), forward and
forward+backward, as bandwidth over the useful bytes (as `packattn.bench.small_seq`).

usage: python3 benchmarks/jax_small_seq_bench.py [head_dim ...]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from packattn.jax import small_seq_attention, small_seq_attention_reference

ITEMS, HEADS, S = 30720, 16, 16


def timed(fn, *args, reps: int = 50) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    dims = [int(x) for x in sys.argv[1:]] or [128, 256, 512]
    lengths = np.random.default_rng(1).integers(2, S + 1, ITEMS).astype(np.int32)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print(f"{'head_dim':>8} {'impl':<10} {'fwd ms':>8} {'fwd TB/s':>9} {'f+b ms':>8} {'f+b TB/s':>9}")
    for d in dims:
        key = jax.random.key(0)
        kq, kk, kv, kd = jax.random.split(key, 4)
        q = jax.random.normal(kq, (ITEMS, HEADS, d), jnp.bfloat16)
        k = jax.random.normal(kk, (ITEMS, S, HEADS, d), jnp.bfloat16)
        v = jax.random.normal(kv, (ITEMS, S, HEADS, d), jnp.bfloat16)
        dout = jax.random.normal(kd, (ITEMS, HEADS, d), jnp.bfloat16)
        n = jnp.asarray(lengths)
        row = HEADS * d * 2
        keys = int(lengths.sum())
        fwd_bytes = row * (2 * ITEMS + 2 * keys)
        fwdbwd_bytes = 3 * row * (ITEMS + 2 * keys) + 2 * row * ITEMS
        impls = {"pallas": lambda *a: small_seq_attention(*a, implementation="pallas"),
                 "xla": lambda *a: small_seq_attention(*a, implementation="xla"),
                 "reference": small_seq_attention_reference}
        for name, fn in impls.items():
            fwd = jax.jit(fn)

            def loss(q, k, v, n, fn=fn):
                return jnp.sum(fn(q, k, v, n).astype(jnp.float32) * dout.astype(jnp.float32))

            fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            f_ms = timed(fwd, q, k, v, n)
            b_ms = timed(fwdbwd, q, k, v, n)
            print(f"{d:>8} {name:<10} {f_ms:8.3f} {fwd_bytes / f_ms / 1e9:9.3f} {b_ms:8.3f} "
                  f"{fwdbwd_bytes / b_ms / 1e9:9.3f}", flush=True)


if __name__ == "__main__":
    main()
