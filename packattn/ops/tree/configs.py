"""The tree kernels' own tables (`packattn.Tree`): which kernel each pass runs and with what blocks.

* where the Gluon tree kernels may run: `GLUON_HEAD_DIMS`, `GLUON_DTYPES` (passed to `sm90.sm90_runs`;
  `TREE_FWD_CONFIGS` covers each head dim, `TREE_DQ_CONFIGS` a subset: `_check_tables`);
* forward: the warp-specialised Gluon tree forward with `TREE_FWD_CONFIGS` where `sm90.sm90_runs` says so
  (TMA-readable tensors), else the Triton tree forward with the varlen family's `triton_config("fwd", ...)`;
* dQ: the warp-specialised Gluon tree dQ with `TREE_DQ_CONFIGS` where the Gluon kernels may run and the table
  has the head dim, else the Triton tree dQ with the varlen family's `triton_config("dq", ...)`; the dQ
  tables are built with the blocks of the kernel that runs (`dq_blocks`);
* dK/dV: the varlen dK/dV kernels with the tree mask (``TREE``), chosen by the varlen rule
  (`packattn.ops.varlen.configs.dkdv_config`, the key tables built for that pass): there is one dK/dV
  kernel for both families, so a tree dK/dV fix goes there (`packattn.ops.varlen.launch_sm90.gluon_dkdv`,
  `packattn.ops.varlen.bwd_dkdv_sm90`).

`override` changes these tables in-process, as the varlen family's `configs.override`.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from packattn.ops.runtime.launch import overriding
from packattn.ops.runtime.sm90 import sm90_runs
from packattn.ops.varlen.configs import GluonBwdConfig, GluonConfig, check_dq_config, triton_config

# The head dims and dtypes of the Gluon tree forward and dQ (the dK/dV follows the varlen family's).
GLUON_HEAD_DIMS = (64, 128, 256)
GLUON_DTYPES = (torch.float16, torch.bfloat16)
# The tree forward takes the varlen forward's tiles (NOTES.md, v14 and v33): 128 x 128, 4 / 3 stages at d = 64 /
# 128, 128 x 32, 3 stages at d = 256.
TREE_FWD_CONFIGS = {64: GluonConfig(128, 128, 4, 8), 128: GluonConfig(128, 128, 3, 8),
                    256: GluonConfig(128, 32, 3, 8)}
# The tree dQ: two consumer warp groups over 128 x 64 tiles at d = 128 (NOTES.md, v14); the Triton one at d = 64 and
# 256 (its kernel needs two consumers: at d = 256 their shared memory does not fit).
TREE_DQ_CONFIGS = {128: GluonBwdConfig(128, 64, 4, 8)}


def tree_fwd_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> GluonConfig | None:
    """The Gluon tree forward's config on these tensors, None where the Triton tree forward runs."""
    if sm90_runs(q, k, v, True, GLUON_HEAD_DIMS, GLUON_DTYPES):
        return TREE_FWD_CONFIGS[q.shape[-1]]
    return None


def fwd_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """``(block_m, block_n)`` of the forward's query tables (`tree_fwd_config`'s, or the Triton forward's)."""
    cfg = tree_fwd_config(q, k, v)
    if cfg is None:
        cfg = triton_config("fwd", q, v)
    return cfg.block_m, cfg.block_n


def tree_dq_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> GluonBwdConfig | None:
    """The Gluon tree dQ's config on these tensors, None where the Triton tree dQ runs; decided from dtypes,
    shapes and device only, so the forward (which builds the dQ tables, `dq_blocks`) and the backward agree."""
    cfg = TREE_DQ_CONFIGS.get(q.shape[-1])
    if cfg is None or not sm90_runs(q, k, v, False, GLUON_HEAD_DIMS, GLUON_DTYPES):
        return None
    return cfg


def dq_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """``(block_m, block_n)`` of the dQ pass's query tables: `tree_dq_config`'s where the Gluon tree dQ runs,
    else the Triton tree dQ's (`triton_config("dq", ...)`, what `packattn.ops.tree.op` launches it with)."""
    cfg = tree_dq_config(q, k, v)
    if cfg is None:
        cfg = triton_config("dq", q, v)
    return cfg.block_m, cfg.block_n


def _check_tables() -> None:
    """`TREE_FWD_CONFIGS` has a config for each of `GLUON_HEAD_DIMS`, `TREE_DQ_CONFIGS` for some of them
    (warp-specialised configs the dQ kernel takes): an entry the plans never look up would be ignored."""
    dims = set(GLUON_HEAD_DIMS)
    if set(TREE_FWD_CONFIGS) != dims:
        raise ValueError(f"TREE_FWD_CONFIGS has head dims {sorted(TREE_FWD_CONFIGS)}, GLUON_HEAD_DIMS {sorted(dims)}")
    if not set(TREE_DQ_CONFIGS) <= dims:
        raise ValueError(f"TREE_DQ_CONFIGS has head dims {sorted(TREE_DQ_CONFIGS)} outside GLUON_HEAD_DIMS")
    for cfg in TREE_DQ_CONFIGS.values():
        check_dq_config(cfg)


_check_tables()


@contextlib.contextmanager
def override(**values):
    """Replace `TREE_FWD_CONFIGS` / `TREE_DQ_CONFIGS` (or `GLUON_HEAD_DIMS`, ...) while the ``with`` block runs
    (experiments, tests); checked as at import (`_check_tables`)."""
    with overriding(sys.modules[__name__], values, _check_tables):
        yield
