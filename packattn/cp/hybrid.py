"""Hybrid context parallelism (strategy "a2a+p2p"): all-to-all over heads inside one dimension
of a 2-D ``DeviceMesh``, a K/V exchange across the other.

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("cp_outer", "cp_inner"))
    plan = packattn.cp.plan(varlen, mesh, strategy="a2a+p2p")      # used like any other plan

Mesh dimensions. The dimensions named ``"cp_outer"`` and ``"cp_inner"`` when the mesh has both
names, else dimension 0 is outer and 1 is inner. Put the fast links (the GPUs of one node) on the
inner dimension: its all-to-alls move every activation; the outer dimension only moves K/V.

Rows. The outer dimension has its own plan (``plan.outer``: the same descriptor over the outer
ranks, balanced as ``balance`` says): outer rank ``o`` decides the rows ``R_o`` that
the inner group at outer coordinate ``o`` holds. Inside that group ``R_o`` (ascending) is cut
contiguously, as evenly as possible, among the inner ranks. The resulting `CPPlan` is global over
the whole mesh (``local_rows``, ``position_ids``, ``shard``, ``unshard``, ``owner``, ``flat_pos``
with ranks numbered in a process group of exactly the mesh's ranks), so callers use it exactly
like the plans of the other strategies.

Algorithm, for the rank at mesh coordinate ``(o, i)``:

1. all-to-all in the inner group (`packattn.cp.alltoall`): local rows of all heads -> all rows
   ``R_o`` for inner rank ``i``'s slice of heads (``heads_q % inner_size == 0``; kv heads split
   or replicated as in the a2a strategy);
2. the outer executor runs ``R_o`` for those heads against the whole batch with ``plan.outer``:
   the ranks of one outer group share the inner coordinate ``i``, hence the same heads, so they
   exchange exactly the K/V those heads need;
3. the inverse all-to-all gives every rank its rows with all heads (and lse, when asked).

Backward runs the same three steps in reverse through autograd.

Outer executor, chosen by name with ``plan(..., outer=NAME)``: ``"allgather"``
(`packattn.cp.allgather`: all-gather K/V, reduce-scatter dK/dV) or ``"p2p"`` (the P2P ring of
`packattn.cp.ring`, the default: `DEFAULT_OUTER`); ``plan.outer.strategy`` says which one a plan uses. With
``"p2p"`` a call with a window or ``chunk_size`` runs its outer exchange with the all-gather
executor over the same outer plan (`outer_executor`): the ring runs those masks too, but as several
parts per step merged through the backend's lse (float32 in most backends), while the all-gather
runs each local problem once, exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from packattn.cp import allgather, ring
from packattn.cp.alltoall import Exchange, HeadSplit, check_heads, exchange_heads_for_rows, exchange_rows_for_heads
from packattn.cp.executor import Call, Executor
from packattn.cp.plan import CPPlan, _piece_of_position, _pieces, build_varlen_plan, piece_bounds
from packattn.mask import Mask
from packattn.varlen import Varlen

MESH_DIM_NAMES = ("cp_outer", "cp_inner")
OUTER_EXECUTORS: dict[str, Executor] = {"allgather": allgather.run, "p2p": ring.run}
OUTER_ALIASES = {"ring": "p2p"}
DEFAULT_OUTER = "p2p"  # the outer executor of ``plan(..., outer=None)``
_FLAT_GROUPS: dict = {}  # DeviceMesh -> process group of exactly its ranks (meshes smaller than the world)


# ------------------------------------------------------------------ plan
def _index_among_owner(owner: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's index among its owner's rows (ascending rows) and the number of rows per rank."""
    order = torch.sort(owner, stable=True).indices
    counts = torch.bincount(owner, minlength=world)
    offsets = torch.cumsum(counts, 0) - counts
    index = torch.empty_like(owner)
    index[order] = torch.arange(owner.numel()) - offsets[owner[order]]
    return index, counts


def _mesh_dims(mesh) -> tuple[int, int]:
    if mesh is None or mesh.ndim != 2:
        raise ValueError(f"strategy 'a2a+p2p' needs a 2-D DeviceMesh, got a {getattr(mesh, 'ndim', 0)}-D one")
    names = tuple(mesh.mesh_dim_names or ())
    if set(MESH_DIM_NAMES) <= set(names):
        return names.index(MESH_DIM_NAMES[0]), names.index(MESH_DIM_NAMES[1])
    return 0, 1


def _mesh_group(mesh, outer_dim: int, inner_dim: int):
    """A process group of exactly the mesh's ranks, and the rank in it of every ``(outer, inner)``."""
    ranks = mesh.mesh.permute(outer_dim, inner_dim)
    if ranks.numel() == dist.get_world_size():
        group = dist.group.WORLD
    else:
        group = _FLAT_GROUPS.get(mesh)
        if group is None:  # creating a group is a collective: once per mesh
            try:
                group = _FLAT_GROUPS[mesh] = mesh._flatten().get_group()
            except Exception as exc:  # pragma: no cover - depends on the torch version
                raise ValueError("strategy 'a2a+p2p' on a mesh smaller than the world needs DeviceMesh._flatten "
                                 f"({type(exc).__name__}: {exc})") from exc
    table = torch.tensor([[dist.get_group_rank(group, r) for r in row] for row in ranks.tolist()], dtype=torch.int64)
    return group, table


def build_plan(descriptor: Varlen, mesh=None, *, balance: str, world=None, rank=None, outer=None) -> CPPlan:
    """The `CPPlan` of strategy "a2a+p2p" (called by `packattn.cp.plan`, which checked the rest)."""
    outer = DEFAULT_OUTER if outer is None else OUTER_ALIASES.get(outer, outer)
    if outer not in OUTER_EXECUTORS:
        raise ValueError(f"outer must be one of {tuple(OUTER_EXECUTORS)}, got {outer!r}")
    if mesh is not None:
        if world is not None or rank is not None:
            raise ValueError("strategy 'a2a+p2p' takes a DeviceMesh or world=(outer, inner) with rank, not both")
        outer_dim, inner_dim = _mesh_dims(mesh)
        outer_group, inner_group = mesh.get_group(outer_dim), mesh.get_group(inner_dim)
        sizes = (dist.get_world_size(outer_group), dist.get_world_size(inner_group))
        o, i = dist.get_rank(outer_group), dist.get_rank(inner_group)
        group, table = _mesh_group(mesh, outer_dim, inner_dim)
    else:
        ok = (isinstance(world, (tuple, list)) and len(world) == 2 and all(isinstance(w, int) and w >= 1 for w in world)
              and isinstance(rank, int) and 0 <= rank < world[0] * world[1])
        if not ok:
            raise ValueError("strategy 'a2a+p2p' needs a 2-D DeviceMesh (or world=(outer, inner) and rank to plan "
                             f"without process groups), got world={world!r}, rank={rank!r}")
        sizes = tuple(world)
        o, i = divmod(rank, sizes[1])
        outer_group = inner_group = group = None
        table = torch.arange(sizes[0] * sizes[1]).view(sizes)
    outer_plan = build_varlen_plan(descriptor, outer_group, sizes[0], o, outer, balance)

    # the inner group at outer coordinate o holds R_o (outer_plan's rows of outer rank o), cut contiguously
    outer_owner = outer_plan.owner
    index, counts = _index_among_owner(outer_owner, sizes[0])
    inner = _piece_of_position(index, counts[outer_owner], sizes[1])
    owner = table[outer_owner, inner]
    world_all, me = sizes[0] * sizes[1], int(table[o, i])
    local_pos, counts = _index_among_owner(owner, world_all)
    max_local = int(counts.max()) if owner.numel() else 0
    local_rows = (owner == me).nonzero().flatten()
    seq, pos = (t.cpu()[local_rows] for t in descriptor.row_map_q())
    pieces = _pieces(seq, pos, local_rows, torch.tensor(descriptor.lengths_q, dtype=torch.int64),
                     torch.tensor(descriptor.host_starts_q, dtype=torch.int64))
    return CPPlan(descriptor, group, world_all, me, "a2a+p2p", balance, owner, owner * max_local + local_pos,
                  max_local, local_rows, pos, pieces, mesh=mesh, outer=outer_plan, inner_group=inner_group,
                  inner_world=sizes[1], inner_rank=i)


def _inner_exchange(plan: CPPlan, device) -> Exchange:
    """Row ``j`` of ``R_o`` sits on inner rank ``piece(j)`` at ``j - start``: its padded-layout row."""
    n = plan.outer.num_local
    j = torch.arange(n)
    lengths = torch.full_like(j, n)
    inner = _piece_of_position(j, lengths, plan.inner_world)
    start, _ = piece_bounds(lengths, plan.inner_world, inner)
    max_rows = -(-n // plan.inner_world)
    return Exchange.build(inner * max_rows + j - start, max_rows, plan.num_local, plan.inner_world,
                          plan.inner_group, device)


# ------------------------------------------------------------------ executor
def outer_executor(plan: CPPlan, mask: Mask) -> str:
    """The executor of the outer exchange for ``mask``: ``plan.outer.strategy``, except "allgather"
    for a window or chunk mask under "p2p" (module docstring)."""
    name = plan.outer.strategy
    if name == "p2p" and (mask.window is not None or mask.chunk_size is not None):
        return "allgather"
    return name


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, call: Call):
    """The a2a+p2p executor (`packattn.cp.executor`)."""
    check_heads(q, k, v, plan.inner_world, plan.strategy)
    device = q.device
    ex = plan.cached(("a2a+p2p inner", str(device)), lambda: _inner_exchange(plan, device))
    split = plan.cached(("a2a heads", q.shape[1], k.shape[1], str(device)),
                        lambda: HeadSplit.build(q.shape[1], k.shape[1], plan.inner_world, device))
    q_o, k_o, v_o = exchange_rows_for_heads(q, k, v, ex, split)
    out, lse = OUTER_EXECUTORS[outer_executor(plan, call.mask)](q_o, k_o, v_o, plan.outer, call)
    return exchange_heads_for_rows(out, lse, ex, split)
