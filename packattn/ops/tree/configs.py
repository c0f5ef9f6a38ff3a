"""The tree kernels' own tables (`packattn.Tree`): which kernel each pass runs and with what blocks.

* forward: the warp-specialised Gluon tree forward with `TREE_FWD_CONFIGS` where `sm90.sm90_runs` says so
  (TMA-readable tensors), else the Triton tree forward with the varlen family's `launch_config("fwd", ...)`;
* dQ: the warp-specialised Gluon tree dQ with `TREE_DQ_CONFIGS` where the Gluon kernels may run and the
  config's blocks are the Triton dQ's (`launch_config("dq", ...)`: the dQ tables then serve both kernels),
  else the Triton tree dQ;
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
from packattn.ops.varlen.configs import GluonBwdConfig, GluonConfig, launch_config

# The tree forward takes the varlen forward's tiles (NOTES.md, v14): 128 x 128, 4 / 3 stages at d = 64 / 128.
TREE_FWD_CONFIGS = {64: GluonConfig(128, 128, 4, 8), 128: GluonConfig(128, 128, 3, 8)}
# The tree dQ: two consumer warp groups over 128 x 64 tiles at d = 128 (NOTES.md, v14); the Triton one at d = 64.
TREE_DQ_CONFIGS = {128: GluonBwdConfig(128, 64, 4, 8, True)}


def tree_fwd_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> GluonConfig | None:
    """The Gluon tree forward's config on these tensors, None where the Triton tree forward runs."""
    if sm90_runs(q, k, v, tma=True):
        return TREE_FWD_CONFIGS.get(q.shape[-1])
    return None


def fwd_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """``(block_m, block_n)`` of the forward's query tables (`tree_fwd_config`'s, or the Triton forward's)."""
    cfg = tree_fwd_config(q, k, v)
    if cfg is None:
        cfg = launch_config("fwd", q.shape[-1], q.dtype, q.device)
    return cfg.block_m, cfg.block_n


def tree_dq_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> GluonBwdConfig | None:
    """The Gluon tree dQ's config on these tensors, None where the Triton tree dQ runs; decided from dtypes,
    shapes and device only, so the forward (which builds the dQ tables) and the backward agree."""
    cfg = TREE_DQ_CONFIGS.get(q.shape[-1])
    if cfg is None or not sm90_runs(q, k, v, tma=False):
        return None
    triton_cfg = launch_config("dq", q.shape[-1], q.dtype, q.device)
    return cfg if (cfg.block_m, cfg.block_n) == (triton_cfg.block_m, triton_cfg.block_n) else None


@contextlib.contextmanager
def override(**values):
    """Replace `TREE_FWD_CONFIGS` / `TREE_DQ_CONFIGS` while the ``with`` block runs (experiments, tests)."""
    with overriding(sys.modules[__name__], values):
        yield
