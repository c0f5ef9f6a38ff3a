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
    head_dim_v: int | None = None  # value head dim when it differs from q/k's (MLA), else None

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

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
        """Useful forward FLOPs: per visible pair and query head, 2 * d for Q K^T and 2 * d_v for P V."""
        return 2.0 * (self.head_dim + self.value_dim) * self.heads_q * self.visible_pairs()

    def fwdbwd_flops(self) -> float:
        return 3.5 * self.fwd_flops()

    def make_inputs(self, device, dtype=torch.bfloat16, seed: int = 0, requires_grad: bool = True):
        seqs = self.varlen(device)
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(rows, heads, dim=self.head_dim):
            t = torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen)
            return t.requires_grad_(requires_grad)

        return (seqs, rand(seqs.total_q, self.heads_q), rand(seqs.total_kv, self.heads_kv),
                rand(seqs.total_kv, self.heads_kv, self.value_dim))


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


@dataclass
class TreeWorkload(Workload):
    """A tree workload (W6, W7, W8 tree): ``sequences`` of token ids packed as a `packattn.Tree`.
    ``lengths_q`` are the sequence lengths: the *expanded* batch (every sequence with its own copy
    of its prefix) that the varlen anchors run on. Useful FLOPs are the tree's."""

    sequences: list = field(default_factory=list)

    def tree(self, device=None):
        from packattn.tree import Tree

        return Tree.from_sequences(self.sequences, device=device)

    def expanded(self) -> Workload:
        return Workload(self.name, self.lengths_q, None, self.heads_q, self.heads_kv, self.head_dim, self.options,
                        head_dim_v=self.head_dim_v)

    def visible_pairs(self) -> int:
        """Pairs of the tree: a token at depth d sees d + 1 keys (its path)."""
        tree = self.tree()
        return int(tree.position_ids.sum()) + tree.total

    def make_inputs(self, device, dtype=torch.bfloat16, seed: int = 0, requires_grad: bool = True):
        tree = self.tree(device)
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(heads, dim=self.head_dim):
            t = torch.randn(tree.total, heads, dim, device=device, dtype=dtype, generator=gen)
            return t.requires_grad_(requires_grad)

        return tree, rand(self.heads_q), rand(self.heads_kv), rand(self.heads_kv, self.value_dim)


def _tree_workload(name: str, sequences: list[list[int]]) -> TreeWorkload:
    return TreeWorkload(name, [len(s) for s in sequences], options={"causal": True}, sequences=sequences)


def grpo_sequences(prompts: int, prompt_len: int, group: int, response_len: int) -> list[list[int]]:
    """``prompts`` prompts, each followed by ``group`` different responses (distinct token ids)."""
    out, next_id = [], 0
    for _ in range(prompts):
        prompt = list(range(next_id, next_id + prompt_len))
        next_id += prompt_len
        for _ in range(group):
            out.append(prompt + list(range(next_id, next_id + response_len)))
            next_id += response_len
    return out


def agent_sequences(roots: int, root_len: int, turn_len: int, branching: tuple[int, ...]) -> list[list[int]]:
    """Root-to-leaf paths of ``roots`` trees: a root of ``root_len`` tokens, then one level of turns
    of ``turn_len`` tokens per entry of ``branching`` (children per node at that level)."""
    counter = iter(range(10**9))

    def run(n):
        return [next(counter) for _ in range(n)]

    paths = []
    for _ in range(roots):
        level = [run(root_len)]
        for fan in branching:
            level = [path + run(turn_len) for path in level for _ in range(fan)]
        paths.extend(level)
    return paths


def tree_workloads() -> dict[str, TreeWorkload]:
    return {
        "W6": _tree_workload("W6 tree_grpo", grpo_sequences(2, 2048, 8, 1024)),
        "W7": _tree_workload("W7 tree_agent", agent_sequences(4, 1024, 256, (4, 2, 2, 2))),
        "W8tree": _tree_workload("W8tree short_docs", [list(range(i * 512, (i + 1) * 512)) for i in range(64)]),
    }


def all_workloads() -> dict[str, Workload]:
    return {**varlen_workloads(), **tree_workloads()}


def head_dim_workloads() -> dict[str, Workload]:
    """The head-dim sweep (`packattn bench --sweep head-dims`): W1's document lengths (causal) at every head dim a
    model uses, with the heads of the models that use it, 16384 tokens from d = 192 up (their tiles hold half as
    many rows); MLA (q/k 192, v 128) and q/k 128 with v 64; short documents (W8's 64 x 512, and 256 x 128) at
    64 / 128 / 256 with GQA 32/8, and W8 with 32/32."""
    docs, half = doc_lengths(32768, seed=0), doc_lengths(16384, seed=0)
    causal = {"causal": True}
    out = {
        "D64": Workload("D64 varlen d64", docs, heads_q=32, heads_kv=8, head_dim=64, options=causal),
        "D96": Workload("D96 varlen d96", docs, heads_q=16, heads_kv=4, head_dim=96, options=causal),
        "D128": Workload("D128 varlen d128", docs, heads_q=16, heads_kv=4, head_dim=128, options=causal),
        "D192": Workload("D192 varlen d192", half, heads_q=16, heads_kv=4, head_dim=192, options=causal),
        "D256": Workload("D256 varlen d256", half, heads_q=16, heads_kv=4, head_dim=256, options=causal),
        "MLA": Workload("MLA varlen d192/128", half, heads_q=16, heads_kv=4, head_dim=192, head_dim_v=128,
                        options=causal),
        "D128v64": Workload("D128v64 varlen d128/64", docs, heads_q=16, heads_kv=4, head_dim=128, head_dim_v=64,
                            options=causal),
    }
    for d in (64, 128, 256):
        out[f"S512d{d}"] = Workload(f"S512d{d} short_docs", [512] * 64, heads_q=32, heads_kv=8, head_dim=d,
                                    options=causal)
        out[f"S512d{d}mha"] = Workload(f"S512d{d}mha short_docs", [512] * 64, heads_q=32, heads_kv=32, head_dim=d,
                                       options=causal)
        out[f"S128d{d}"] = Workload(f"S128d{d} short_docs", [128] * 256, heads_q=32, heads_kv=8, head_dim=d,
                                    options=causal)
    return out
