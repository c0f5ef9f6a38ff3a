"""W9 small_seq (shared/workloads.md): one query per item over 2..16 keys, 30720 items, heads 16/16,
head_dim 128 / 256 / 512. Memory-bound, so it is reported as bandwidth: useful bytes (q, k, v read
and out written; the backward adds q, k, v, dout read and dq, dk, dv written) over time, next to a
device-to-device copy measured in the same run.

Implementations: ours on the packed THD batch (`packattn.attention` with a `Varlen` of q lengths 1,
backend ``small_seq``) and on the dense batch (`packattn.small_seq_attention`); anchors on dense
``(B, H, 16, D)`` keys: SDPA with a boolean mask and the eager matmul-softmax-matmul. Each gets
its inputs in its own layout, built outside the timed region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import packattn
from packattn.varlen import Varlen

ITEMS, HEADS, MAX_KEYS = 30720, 16, 16
IMPLS = ("packattn:small_seq", "packattn:small_seq_dense", "sdpa_mask", "eager")


@dataclass
class SmallSeqWorkload:
    name: str
    head_dim: int
    items: int = ITEMS
    heads: int = HEADS  # query heads
    heads_kv: int | None = None  # None: heads (MHA)
    min_keys: int = 2  # key counts are uniform in [min_keys, 16]

    @property
    def kv_heads(self) -> int:
        return self.heads if self.heads_kv is None else self.heads_kv

    def lengths(self) -> torch.Tensor:
        return torch.randint(self.min_keys, MAX_KEYS + 1, (self.items,), generator=torch.Generator().manual_seed(1))

    def _rows(self, element_size: int) -> tuple[int, int, int]:
        """``(bytes of a query row, bytes of a key row, keys)``."""
        return (self.heads * self.head_dim * element_size, self.kv_heads * self.head_dim * element_size,
                int(self.lengths().sum()))

    def bytes_fwd(self, element_size: int = 2) -> float:
        q_row, kv_row, keys = self._rows(element_size)
        return float(2 * q_row * self.items + 2 * kv_row * keys)  # q, out; k, v

    def bytes_fwdbwd(self, element_size: int = 2) -> float:
        q_row, kv_row, keys = self._rows(element_size)
        qkv = q_row * self.items + 2 * kv_row * keys
        return float(3 * qkv + 2 * q_row * self.items)  # fwd: q k v o; bwd: q k v do in, dq dk dv out


def small_seq_workloads() -> dict[str, SmallSeqWorkload]:
    return {f"W9d{d}": SmallSeqWorkload(f"W9d{d} small_seq", d) for d in (128, 256, 512)}


def make_impl(w: SmallSeqWorkload, impl: str, device, dtype=torch.bfloat16):
    """``(fn, (q, k, v))``: ``fn(q, k, v) -> out`` in the implementation's own layout."""
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = w.lengths().to(device)
    B, H, Hkv, D = w.items, w.heads, w.kv_heads, w.head_dim

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_()

    if impl == "packattn:small_seq":
        seqs = Varlen.from_lengths([1] * B, w.lengths().tolist(), device=device)
        q, k, v = rand(B, H, D), rand(seqs.total_kv, Hkv, D), rand(seqs.total_kv, Hkv, D)
        return (lambda q, k, v: packattn.attention(q, k, v, seqs, backend="small_seq")), (q, k, v)
    if impl == "packattn:small_seq_dense":
        q, k, v = rand(B, H, D), rand(B, MAX_KEYS, Hkv, D), rand(B, MAX_KEYS, Hkv, D)
        return (lambda q, k, v: packattn.small_seq_attention(q, k, v, lengths)), (q, k, v)
    if Hkv != H:
        raise ValueError(f"{impl} is timed on MHA inputs only (heads {H}, kv heads {Hkv})")
    mask = (torch.arange(MAX_KEYS, device=device)[None, :] < lengths[:, None])[:, None, None, :]  # (B,1,1,16)
    q, k, v = rand(B, H, 1, D), rand(B, H, MAX_KEYS, D), rand(B, H, MAX_KEYS, D)
    if impl == "sdpa_mask":
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), (q, k, v)
    if impl == "eager":
        scale = D ** -0.5

        def eager(q, k, v):
            s = (q @ k.transpose(-1, -2)).float() * scale
            return torch.softmax(s.masked_fill(~mask, float("-inf")), -1).to(v.dtype) @ v

        return eager, (q, k, v)
    raise KeyError(impl)


def run_one(w: SmallSeqWorkload, impl: str, device, bench) -> dict:
    row = {"workload": w.name.split()[0], "impl": impl}
    try:
        fn, (q, k, v) = make_impl(w, impl, device)
        dout = torch.randn_like(fn(q, k, v))
        fwd_ms = bench(lambda: fn(q, k, v))
        fwdbwd_ms = bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))
        row.update(fwd_ms=round(fwd_ms, 4), fwdbwd_ms=round(fwdbwd_ms, 4),
                   fwd_TBps=round(w.bytes_fwd() / (fwd_ms * 1e-3) / 1e12, 3),
                   fwdbwd_TBps=round(w.bytes_fwdbwd() / (fwdbwd_ms * 1e-3) / 1e12, 3))
    except Exception as e:  # noqa: BLE001 - a failed run is a row, not a crash
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    torch.cuda.empty_cache()
    return row
