"""`packattn.cp.attention`: checks the local tensors against the plan and runs the executor of the
plan's strategy (each executor lives in its own module)."""

from __future__ import annotations

import importlib

import torch

from packattn.cp.plan import CPPlan

EXECUTORS = {
    "allgather": "packattn.cp.allgather",
    "p2p": "packattn.cp.ring",
    "a2a": "packattn.cp.alltoall",
    "a2a+p2p": "packattn.cp.hybrid",
}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CPPlan,
    *,
    causal: bool | str | None = None,
    window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
    overlap_groups: int | None = None,
):
    """Attention of this rank's rows (``q, k, v`` with ``plan.num_local`` rows, THD) against the
    whole batch; same masks and results as `packattn.attention` on the global batch, restricted
    to the local rows. Returns local ``out`` (and local ``lse (heads_q, num_local)``).

    A collective: every rank of the plan's group must call it (and run its backward) in step.

    ``overlap_groups`` (strategy "allgather"): the K/V of documents shared by several ranks are
    all-gathered (their dK/dV reduce-scattered) in this many kv-head groups, each group's
    communication overlapping another group's attention (`packattn.cp.allgather`, "Overlap"); at
    most ``heads_kv``; 1: one collective, no overlap; None: ``$PACKATTN_CP_OVERLAP_GROUPS``, else 1.
    The same on every rank. Tree plans do not use it.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a packattn.cp.CPPlan, got {type(plan).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D (rows, heads, dim) tensor, got {getattr(t, 'shape', t)!r}")
        if t.shape[0] != plan.num_local:
            raise ValueError(f"{name} has {t.shape[0]} rows but this rank holds {plan.num_local} (plan.local_rows)")
    options = {}  # keywords of one executor only
    if overlap_groups is not None:
        if plan.strategy != "allgather":
            raise ValueError(f"overlap_groups applies to strategy 'allgather', not {plan.strategy!r}")
        if not plan.is_tree:
            options["overlap_groups"] = overlap_groups
    # a Tree plan has one executor for every strategy (packattn.cp.tree): whole root subtrees need
    # nothing, roots cut across ranks (strategy "allgather" only) all-gather their ancestors' K/V
    executor = importlib.import_module("packattn.cp.tree" if plan.is_tree else EXECUTORS[plan.strategy])
    return executor.attention(q, k, v, plan, causal=causal, window=window, chunk_size=chunk_size, scale=scale,
                              backend=backend, return_lse=return_lse, deterministic=deterministic, **options)
