"""`packattn.cp.plan` and `packattn.cp.attention`: the arguments checked once, then the builder of the
descriptor and strategy (`packattn.cp.plan` / `.tree` / `.hybrid`) or the executor of the plan's strategy
(`EXECUTORS`; all share `packattn.cp.executor`'s signature)."""

from __future__ import annotations

import torch

from packattn.api import check_tree_mask
from packattn.cp import allgather, alltoall, hybrid, ring, tree
from packattn.cp.executor import Call, Executor
from packattn.cp.plan import ALIASES, BALANCES, STRATEGIES, CPPlan, build_varlen_plan, world_and_rank
from packattn.tree.descriptor import Tree
from packattn.varlen import Varlen

EXECUTORS: dict[str, Executor] = {"allgather": allgather.run, "p2p": ring.run, "a2a": alltoall.run,
                                  "a2a+p2p": hybrid.run}


def plan(descriptor: Varlen | Tree, group=None, *, strategy: str = "allgather", balance: str = "documents",
         world: int | tuple[int, int] | None = None, rank: int | None = None,
         outer: str | None = None) -> CPPlan:
    """Build the `CPPlan` of a global self-attention batch for this rank of ``group``.

    ``descriptor``: a `Varlen`, or a `packattn.Tree` (small roots' subtrees whole on one rank; with
    ``strategy="allgather"`` a root larger than half a rank's share is cut across ranks and the
    ancestors' K/V gathered, other strategies keep it whole; see `packattn.cp.tree`).

    ``group``: a process group, a 1-D ``DeviceMesh`` (its group), or for ``strategy="a2a+p2p"`` a
    2-D ``DeviceMesh`` (outer dimension: all-gather / P2P of K/V; inner: all-to-all over heads;
    see `packattn.cp.hybrid`). ``outer`` names the a2a+p2p outer executor ("allgather" or "p2p";
    None: "p2p").
    ``world``/``rank`` override the group's (planning without an initialised process group, e.g.
    to inspect the sharding; for a2a+p2p ``world=(outer, inner)`` and ``rank = outer_rank * inner +
    inner_rank``); the executors still need the group.
    """
    strategy = ALIASES.get(strategy, strategy)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if isinstance(descriptor, Tree):
        if type(group).__name__ == "DeviceMesh" and group.ndim != 1:
            raise ValueError("a Tree plan takes a process group or a 1-D DeviceMesh (only the K/V of ancestors "
                             "of cut roots are all-gathered, over one group)")
        world, rank, group = world_and_rank(group, world, rank)
        return tree.build_tree_plan(descriptor, group, world, rank, strategy, balance)
    if not isinstance(descriptor, Varlen):
        raise TypeError(f"plan needs a packattn.Varlen or a packattn.Tree, got {type(descriptor).__name__}")
    if not descriptor.is_self:
        raise ValueError("a CP plan needs a self-attention descriptor (lengths_kv=None); got separate q and kv")
    if descriptor.lengths_q is None or descriptor.host_starts_q is None:
        raise ValueError("a CP plan needs a Varlen with host lengths (build it with from_lengths / from_cu_seqlens)")
    mesh = group if type(group).__name__ == "DeviceMesh" else None
    if mesh is not None and mesh.ndim == 1:
        group = mesh.get_group()
    elif mesh is not None and strategy != "a2a+p2p":
        raise ValueError(f"a {mesh.ndim}-D DeviceMesh needs strategy='a2a+p2p'; for strategy={strategy!r} "
                         "pass one dimension's group (mesh.get_group(dim)) or a 1-D mesh")
    if strategy == "a2a+p2p":
        return hybrid.build_plan(descriptor, mesh, balance=balance, world=world, rank=rank, outer=outer)
    if outer is not None:
        raise ValueError(f"outer= names the outer executor of strategy 'a2a+p2p'; got it with strategy={strategy!r}")
    world, rank, group = world_and_rank(group, world, rank)
    return build_varlen_plan(descriptor, group, world, rank, strategy, balance)


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
    _check(q, k, v, plan, overlap_groups)
    if plan.is_tree:  # before any collective; the tree's own rule, whatever the strategy (`packattn.cp.tree`)
        check_tree_mask(causal, window, chunk_size)
        overlap_groups = None
    call = Call(causal, window, chunk_size, scale, backend, bool(return_lse), bool(deterministic), overlap_groups)
    out, lse = (tree.run if plan.is_tree else EXECUTORS[plan.strategy])(q, k, v, plan, call)
    return (out, lse) if call.return_lse else out


def _check(q, k, v, plan, overlap_groups) -> None:
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a packattn.cp.CPPlan, got {type(plan).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D (rows, heads, dim) tensor, got {getattr(t, 'shape', t)!r}")
        if t.shape[0] != plan.num_local:
            raise ValueError(f"{name} has {t.shape[0]} rows but this rank holds {plan.num_local} (plan.local_rows)")
    if overlap_groups is not None and plan.strategy != "allgather":
        raise ValueError(f"overlap_groups applies to strategy 'allgather', not {plan.strategy!r}")
