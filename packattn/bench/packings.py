"""Random packings of a fixed token budget, as a training loop sees them: a new `Varlen` or `Tree` every step
with the same number of rows. Used to check that torch.compile builds one graph for all of them (the tests,
`scripts/compile_gpu_check.py`)."""

from __future__ import annotations

import torch

from packattn.tree import Tree
from packattn.varlen import Varlen


def _cuts(total: int, pieces: int, rng: torch.Generator) -> list[int]:
    """``pieces`` positive lengths summing to ``total`` (random cut points)."""
    inner = torch.randperm(total - 1, generator=rng)[: pieces - 1].add(1).sort().values.tolist()
    bounds = [0, *inner, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def random_varlen(total: int, num_seqs: int, rng: torch.Generator, device=None) -> Varlen:
    """``num_seqs`` sequences of ``total`` rows in all; with 2 or more one has length 1, with 4 or more one is empty."""
    if num_seqs < 1 or num_seqs > total:
        raise ValueError(f"num_seqs must be in [1, {total}], got {num_seqs}")
    if num_seqs == 1:
        return Varlen.from_lengths([total], device=device)
    lengths = _cuts(total - 1, num_seqs - 1, rng) + [1]
    if num_seqs >= 4 and lengths[0] > 0:
        lengths[1] += lengths[0]
        lengths[0] = 0
    return Varlen.from_lengths(lengths, device=device)


def random_tree(total: int, num_nodes: int, rng: torch.Generator, device=None) -> Tree:
    """A random trie of ``total`` rows in ``num_nodes`` nodes: each node's parent lies on the path to the
    node before it (DFS pre-order), or it starts a new root."""
    parents, path = [], []
    for _ in range(num_nodes):
        keep = int(torch.randint(0, len(path) + 1, (1,), generator=rng))  # ancestors kept from the last path
        path = path[:keep]
        parents.append(path[-1] if path else -1)
        path.append(len(parents) - 1)
    cu = torch.tensor([0, *_cuts(total, num_nodes, rng)]).cumsum(0)
    return Tree.from_nodes(cu, torch.tensor(parents), device=device)


def packings(total: int, count: int, seed: int = 0, max_seqs: int = 30, max_nodes: int = 12,
             device=None) -> list:
    """``count`` descriptors of ``total`` rows: every third a `Tree` of 2..``max_nodes`` nodes, the others
    `Varlen` batches of 1..``max_seqs`` sequences (the first two: 1 and ``max_seqs``)."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if i % 3 == 2:
            out.append(random_tree(total, int(torch.randint(2, max_nodes + 1, (1,), generator=rng)), rng, device))
        else:
            n = (1, max_seqs)[i] if i < 2 else int(torch.randint(2, max_seqs + 1, (1,), generator=rng))
            out.append(random_varlen(total, n, rng, device))
    return out


def position_ids(descriptor) -> torch.Tensor:
    """Each row's position in its sequence (a tree's depths), on the descriptor's device."""
    if isinstance(descriptor, Tree):
        return descriptor.position_ids
    return torch.cat([torch.arange(n) for n in descriptor.lengths_q]).to(descriptor.device)
