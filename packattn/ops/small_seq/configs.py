"""Launch configurations of the small-sequence kernels (`packattn.ops.small_seq.kernels_mma`,
`packattn.ops.small_seq.kernels_stack`), by pass, head dim and GQA group; `override` swaps them for
experiments (benchmarks/small_seq_sweep.py, tests).

A config says how many kv heads a unit takes (``block_h``; one warp each when > 1), how many items a unit
takes (``items``; > 1: the query rows of several items stacked into one tile, `kernels_stack`, one kv head
a unit), how many chunks the head dim is cut into (``d_chunks``), how many units a program loops over
(``units``), the warps of a ``block_h == 1`` program and the pipeline depth (``num_stages`` of the unit
loop: Triton's pipeliner, with the item-table loads ahead of the tile loads, double-buffers the tiles from
5 on).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, replace

from packattn.ops.runtime.launch import overriding

HEAD_DIMS = (64, 128, 256, 512)
MAX_ITEMS = 16  # items a unit (key tiles of 16 rows each)
_FIELDS = {"h": "block_h", "c": "d_chunks", "u": "units", "w": "num_warps", "s": "num_stages", "i": "items"}


@dataclass(frozen=True)
class SmallSeqConfig:
    block_h: int = 1  # kv heads per unit (a power of two); > 1: one warp per kv head
    d_chunks: int = 1  # head-dim chunks (a power of two dividing the head dim)
    units: int = 8  # units per program
    num_warps: int = 4  # warps of a block_h == 1 program
    num_stages: int = 5
    items: int = 1  # items a unit (a power of two); > 1: stacked query rows (block_h must be 1)

    @classmethod
    def parse(cls, text: str) -> SmallSeqConfig:
        """The config `describe` writes: ``"h2 c1 u8 w4 s5"`` or ``"h1 c1 u8 w2 s5 i4"`` (fields in any order,
        missing ones at their defaults; ``w`` is the warps of a ``block_h == 1`` program)."""
        fields = text.split()
        try:
            if not fields:
                raise ValueError
            return cls(**{_FIELDS[f[0]]: int(f[1:]) for f in fields})
        except (KeyError, ValueError, IndexError):
            raise ValueError(f"not a small-seq config: {text!r} (e.g. 'h2 c1 u8 w4 s5', 'h1 c1 u8 w2 s5 i4')") from None

    def describe(self) -> str:
        warps = self.block_h if self.block_h > 1 else self.num_warps
        items = f" i{self.items}" if self.items > 1 else ""
        return f"h{self.block_h} c{self.d_chunks} u{self.units} w{warps} s{self.num_stages}{items}"


# (head_dim, group bucket) -> config; group buckets: 1 (MHA) and 2+ (GQA/MQA). Chosen from sm_90a compiles
# (scripts/check_small_seq_compile.py: registers, shared memory, programs per SM): no spills, an SM holding
# about 30-60 KB of loads in flight (copy bandwidth x DRAM latency is ~25-35 KB per SM on H100/H200), and few
# instructions per byte (each warp of a program repeats the per-unit work: addresses, masks, softmax, so
# fewer warps a unit issue fewer instructions; the forward at 85% of copy bandwidth leaves ~250 warp
# instructions per KB at full issue). benchmarks/small_seq_sweep.py times them against alternatives; the
# forward at (256, 1) and (64, 2) and the backward at (64, 2) and (512, 2) are the sweep's best (benchmarks/NOTES.md,
# v35, v36).
FWD = {
    (64, 1): SmallSeqConfig(block_h=1, num_warps=1),
    (64, 2): SmallSeqConfig(block_h=4, units=4),
    (128, 1): SmallSeqConfig(block_h=1, num_warps=1),
    (128, 2): SmallSeqConfig(block_h=2),
    (256, 1): SmallSeqConfig(block_h=1, d_chunks=2, num_warps=1),
    (256, 2): SmallSeqConfig(block_h=1, d_chunks=2, num_warps=2),
    (512, 1): SmallSeqConfig(block_h=1, d_chunks=2, num_warps=4, units=4),
    (512, 2): SmallSeqConfig(block_h=1, d_chunks=2, num_warps=4, units=4),
}
BWD = {
    (64, 1): SmallSeqConfig(block_h=1, num_warps=1),
    (64, 2): SmallSeqConfig(block_h=1, num_warps=1, items=2),
    (128, 1): SmallSeqConfig(block_h=1, num_warps=1),
    (128, 2): SmallSeqConfig(block_h=1, num_warps=2),
    (256, 1): SmallSeqConfig(block_h=1, num_warps=2),
    (256, 2): SmallSeqConfig(block_h=1, num_warps=2),
    (512, 1): SmallSeqConfig(block_h=1, num_warps=4, units=4),
    (512, 2): SmallSeqConfig(block_h=1, d_chunks=4, units=4, num_warps=4, num_stages=3, items=2),
}
PASSES = {"fwd": "FWD", "bwd": "BWD"}


def block_g(group: int, backward: bool, items: int = 1) -> int:
    """Rows of an item's query-head tile: the group as a power of two; in the backward (its dK/dV products
    reduce over the rows of a unit: a dot's reduction is >= 16 long) ``items`` of them make >= 16 rows, and
    one item alone 1 row (an outer product) or >= 16."""
    g = 1 << (group - 1).bit_length()
    if backward and items > 1:
        return max(g, 16 // min(items, 16))
    return max(g, 16) if backward and g > 1 else g


def block_h(config: SmallSeqConfig, heads_kv: int) -> int:
    """The config's kv heads per unit, no more than ``heads_kv`` rounded up to a power of two."""
    return min(config.block_h, 1 << (heads_kv - 1).bit_length())


def lookup(kind: str, head_dim: int, group: int) -> SmallSeqConfig:
    """The config of pass ``kind`` ("fwd" / "bwd") at ``head_dim`` and GQA ``group``."""
    table = getattr(sys.modules[__name__], PASSES[kind])
    return table[head_dim, 1 if group == 1 else 2]


def _check_tables() -> None:
    for name in PASSES.values():
        table = getattr(sys.modules[__name__], name)
        for (head_dim, bucket), c in table.items():
            where = f"{name}[{head_dim}, {bucket}] = {c}"
            for field in ("block_h", "d_chunks", "num_warps", "items"):
                value = getattr(c, field)
                if value < 1 or value & (value - 1):
                    raise ValueError(f"{where}: {field} must be a power of two")
            if head_dim % c.d_chunks or head_dim // c.d_chunks < 16:
                raise ValueError(f"{where}: d_chunks must leave chunks of >= 16 columns")
            if c.units < 1 or c.num_stages < 1:
                raise ValueError(f"{where}: units and num_stages must be >= 1")
            if c.items > 1 and (c.block_h > 1 or c.items > MAX_ITEMS):
                raise ValueError(f"{where}: items > 1 takes block_h 1 and at most {MAX_ITEMS} items")


@contextlib.contextmanager
def override(fwd: SmallSeqConfig | None = None, bwd: SmallSeqConfig | None = None, **tables):
    """Replace the tables (``FWD=`` / ``BWD=``) while the ``with`` block runs (experiments, tests; not
    thread-safe); ``fwd=`` / ``bwd=``: one config for every head dim and group of that pass."""
    module = sys.modules[__name__]
    for kind, config in (("FWD", fwd), ("BWD", bwd)):
        if config is not None:
            tables[kind] = {key: replace(config) for key in getattr(module, kind)}
    with overriding(module, tables, _check_tables):
        yield
