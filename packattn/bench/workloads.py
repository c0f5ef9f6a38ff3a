"""The benchmark workloads (shared/workloads.md), exactly as defined there.

Each workload is a recipe: descriptor (Varlen), heads, head_dim and mask options; useful FLOPs
count only the (query, key) pairs the mask lets through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from packattn.mask import Mask, key_range, offset
from packattn.varlen import Varlen


def doc_lengths(total: int, seed: int) -> list[int]:
    """L = int(exp(U(log 128, log 8192))), one uniform_ of one element per draw; last one clipped."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = math.log(128), math.log(8192)
    out: list[int] = []
    remaining = total
    while remaining > 0:
        u = torch.empty(1).uniform_(lo, hi, generator=gen).item()
        n = min(int(math.exp(u)), remaining)
        out.append(n)
        remaining -= n
    return out


@dataclass
class Workload:
    name: str
    lengths_q: list[int]
    lengths_kv: list[int] | None = None
    heads_q: int = 16
    heads_kv: int = 16
    head_dim: int = 128
    options: dict = field(default_factory=dict)  # attention() mask options
    pad_to_multiple: int | None = None

    def varlen(self, device=None) -> Varlen:
        return Varlen.from_lengths(self.lengths_q, self.lengths_kv, pad_to_multiple=self.pad_to_multiple, device=device)

    def visible_pairs(self) -> int:
        """Number of visible (query, key) pairs, summed over sequences (one head)."""
        mask = Mask.make(**self.options)
        lk = self.lengths_kv or self.lengths_q
        total = 0
        for n_q, n_k in zip(self.lengths_q, lk):
            if n_q == 0 or n_k == 0:
                continue
            i = torch.arange(n_q, dtype=torch.int64)
            lo, hi = key_range(mask, i + offset(mask, n_q, n_k), n_k)
            total += int((hi - lo).clamp_min(0).sum())
        return total

    def fwd_flops(self) -> float:
        return 4.0 * self.head_dim * self.heads_q * self.visible_pairs()

    def fwdbwd_flops(self) -> float:
        return 3.5 * self.fwd_flops()

    def make_inputs(self, device, dtype=torch.bfloat16, seed: int = 0, requires_grad: bool = True):
        seqs = self.varlen(device)
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(rows, heads):
            t = torch.randn(rows, heads, self.head_dim, device=device, dtype=dtype, generator=gen)
            return t.requires_grad_(requires_grad)

        return seqs, rand(seqs.total_q, self.heads_q), rand(seqs.total_kv, self.heads_kv), rand(seqs.total_kv, self.heads_kv)


def varlen_workloads() -> dict[str, Workload]:
    docs = doc_lengths(32768, seed=0)
    return {
        "W1": Workload("W1 varlen_mha", docs, options={"causal": True}),
        "W2": Workload("W2 varlen_gqa", docs, heads_q=32, heads_kv=8, options={"causal": True}),
        "W3": Workload("W3 varlen_padded", docs, options={"causal": True}, pad_to_multiple=64),
        "W4": Workload("W4 chunked", [32768], options={"causal": True, "chunk_size": 8192}),
        "W5": Workload("W5 sliding_window", docs, options={"causal": True, "window": (1024, 0)}),
        "W8": Workload("W8 short_docs", [512] * 64, options={"causal": True}),
    }
