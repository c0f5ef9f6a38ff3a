"""All-to-all (Ulysses, strategy "a2a") and hybrid ("a2a+p2p") context parallelism against
single-process attention.

One gloo group per world size (2 and 4), spawned once for the module, runs every case: the same
seeded global inputs on every rank, single-process float64 reference vs the CP result, with out,
lse, dq, dk, dv gathered back to the global layout (machinery in tests/cp_harness.py). World 4
also builds 2-D DeviceMeshes for the hybrid cases: (2, 2) with the dimension names in either
order, the degenerate (1, 4) (unnamed: pure all-to-all) and (4, 1) (pure all-gather), and a (1, 2)
sub-mesh of a (dp=2, 1, 2) mesh (a mesh smaller than the world). A few hybrid cases run the P2P
ring (`packattn.cp.ring`) as the outer executor.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import cp_harness
from packattn import cp
from packattn.cp.plan import BALANCES
from packattn.varlen import Varlen

WORLDS = (2, 4)
TOL64 = 1e-10
TOL64_RING = 2e-6  # the P2P ring merges partial results through float32 lse (packattn.cp.ring)

DOCS = {
    "nasty": dict(lengths=[1, 0, 7, 3, 29, 2], pad=None),  # shorter than cp, empty, length 1, long
    "one_doc": dict(lengths=[37], pad=None),  # one document spanning every rank
    "padded": dict(lengths=[5, 0, 13, 1, 9], pad=4),  # padding between sequences and at the end
    "tiny": dict(lengths=[2, 1], pad=None),  # some ranks hold nothing
    "one_row": dict(lengths=[1], pad=None),  # hybrid: an inner group with no rows at all
}
MASKS = {
    "causal": dict(causal=True),
    "top_left": dict(causal="top_left"),
    "full": dict(),
    "win_3_0": dict(window=(3, 0)),
    "win_2_3": dict(window=(2, 3)),
    "causal_chunk": dict(causal=True, chunk_size=4),
}
# (heads_q, heads_kv, head_dim, head_dim_v); at world 4 (and inner size 2 or 4) heads_kv 2 and 1 replicate kv heads
HEADS = {"mha": (4, 4, 8, 8), "gqa": (4, 2, 8, 6), "mqa": (4, 1, 4, 4)}
MESHES = {  # name: (shape, mesh_dim_names); world 4 only
    "2x2": ((2, 2), ("cp_outer", "cp_inner")),
    "2x2_swapped": ((2, 2), ("cp_inner", "cp_outer")),  # outer is dimension 1
    "1x4": ((1, 4), None),  # positional: outer 1, inner 4 (all-to-all only)
    "4x1": ((4, 1), ("cp_outer", "cp_inner")),  # all-gather only
    "dp2_1x2": ((2, 1, 2), ("dp", "cp_outer", "cp_inner")),  # a (1, 2) sub-mesh per data-parallel replica
}


def _cases(world):
    cases = {}
    for i, (doc, mask, heads) in enumerate(itertools.product(list(DOCS)[:4], MASKS, HEADS)):
        cases[f"a2a-{doc}-{mask}-{heads}"] = dict(strategy="a2a", doc=doc, mask=mask, heads=heads, seed=i,
                                                  balance=BALANCES[i // 3 % len(BALANCES)])
    for doc, mask in (("nasty", "causal"), ("padded", "win_2_3")):
        cases[f"a2a-{doc}-{mask}-float32"] = dict(strategy="a2a", doc=doc, mask=mask, heads="gqa", seed=1000,
                                                  dtype="float32")
    cases["a2a-padded-causal_chunk-deterministic"] = dict(strategy="a2a", doc="padded", mask="causal_chunk",
                                                          heads="mqa", seed=7, deterministic=True)
    cases["a2a-nasty-win_2_3-lse_in_loss"] = dict(strategy="a2a", doc="nasty", mask="win_2_3", heads="mqa", seed=9,
                                                  lse_in_loss=True)
    cases["a2a-nasty-causal-1d_mesh"] = dict(strategy="a2a", doc="nasty", mask="causal", heads="gqa", seed=8,
                                             mesh="1d")
    if world != 4:
        return cases
    for i, (doc, mask) in enumerate(itertools.product(list(DOCS)[:4], MASKS)):
        cases[f"hybrid-{doc}-{mask}"] = dict(strategy="a2a+p2p", doc=doc, mask=mask, heads=list(HEADS)[i % 3],
                                             seed=100 + i, mesh="2x2", balance=BALANCES[i % len(BALANCES)])
    other_meshes = ("2x2_swapped", "1x4", "4x1", "dp2_1x2")
    for i, (mesh, doc, mask) in enumerate(itertools.product(other_meshes, ("nasty", "padded"), ("causal", "win_2_3"))):
        cases[f"hybrid-{mesh}-{doc}-{mask}"] = dict(strategy="a2a+p2p", doc=doc, mask=mask, mesh=mesh, seed=200 + i,
                                                    heads=list(HEADS)[i % 3])
    for doc, mask in (("nasty", "causal"), ("one_doc", "causal_chunk")):
        cases[f"hybrid-{doc}-{mask}-float32"] = dict(strategy="a2a+p2p", doc=doc, mask=mask, heads="mqa", seed=300,
                                                     mesh="2x2", dtype="float32")
    for mesh in ("2x2", "2x2_swapped"):
        cases[f"hybrid-{mesh}-one_row-causal"] = dict(strategy="a2a+p2p", doc="one_row", mask="causal", heads="mqa",
                                                     seed=303, mesh=mesh)
    cases["hybrid-padded-causal-lse_in_loss"] = dict(strategy="a2a+p2p", doc="padded", mask="causal", heads="gqa",
                                                     seed=302, mesh="2x2", lse_in_loss=True)
    cases["hybrid-nasty-win_3_0-deterministic"] = dict(strategy="a2a+p2p", doc="nasty", mask="win_3_0", heads="gqa",
                                                       seed=301, mesh="2x2", deterministic=True)
    # the P2P outer executor; windows and chunks fall back to the all-gather one (exact)
    for doc, mask in (("nasty", "causal"), ("padded", "full"), ("padded", "win_2_3"), ("one_doc", "causal_chunk")):
        ring_runs = mask in ("causal", "full")
        cases[f"hybrid-{doc}-{mask}-outer_p2p"] = dict(strategy="a2a+p2p", doc=doc, mask=mask, heads="gqa",
                                                       seed=400, mesh="2x2", outer="p2p",
                                                       tol=TOL64_RING if ring_runs else TOL64)
    return cases


CASES = {w: _cases(w) for w in WORLDS}


# ------------------------------------------------------------------ worker side
def _seqs(doc):
    spec = DOCS[doc]
    return Varlen.from_lengths(spec["lengths"], pad_to_multiple=spec["pad"])


def _run_case(case, meshes):
    def make_plan(seqs):
        group = meshes[case["mesh"]] if "mesh" in case else None
        extra = {"outer": case.get("outer", "allgather")} if case["strategy"] == "a2a+p2p" else {}
        return cp.plan(seqs, group, strategy=case["strategy"], balance=case.get("balance", "zigzag"), **extra)

    return cp_harness.errors_vs_single(_seqs(case["doc"]), MASKS[case["mask"]], HEADS[case["heads"]],
                                       getattr(torch, case.get("dtype", "float64")), case["seed"], make_plan,
                                       check_deterministic=case.get("deterministic", False),
                                       lse_in_loss=case.get("lse_in_loss", False))


def _expect_value_error(fn, match):
    try:
        fn()
    except ValueError as exc:
        return match in str(exc)
    return False


def _error_checks(world, meshes):
    """Bad inputs raise ValueError on every rank before any communication (the group stays in step:
    the cases that follow still pass)."""
    seqs = _seqs("nasty")
    q = torch.randn(seqs.total_q, 3, 4, dtype=torch.float64)
    k = torch.randn(seqs.total_q, 1, 4, dtype=torch.float64)
    out = {}
    p = cp.plan(seqs, strategy="a2a")
    lq, lk = p.shard(q), p.shard(k)
    out["a2a_heads_q"] = _expect_value_error(lambda: cp.attention(lq, lk, lk, p, causal=True), "heads_q (3)")
    if "2x2" in meshes:
        h = cp.plan(seqs, meshes["2x2"], strategy="a2a+p2p", outer="allgather")
        hq_, hk_ = h.shard(q), h.shard(k)
        out["hybrid_heads_q"] = _expect_value_error(lambda: cp.attention(hq_, hk_, hk_, h), "heads_q (3)")
        out["mesh_needs_hybrid"] = _expect_value_error(lambda: cp.plan(seqs, meshes["2x2"], strategy="a2a"),
                                                       "a2a+p2p")
    return out


def _meshes(world):
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        for name, (shape, names) in MESHES.items():
            meshes[name] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        meshes["dp2_1x2"] = meshes["dp2_1x2"]["cp_outer", "cp_inner"]
    return meshes


def _worker(rank, world, init_file, out_dir, case_names):
    cp_harness.init_gloo(rank, world, init_file, cp_harness.SPAWN_TIMEOUT_S)
    results = {}
    try:
        meshes = _meshes(world)
        results["__errors__"] = _error_checks(world, meshes)
        for name in case_names:
            results[name] = cp_harness.run_case(_run_case, CASES[world][name], meshes)
    finally:
        cp_harness.finish(rank, out_dir, results)


# ------------------------------------------------------------------ parent side
_RESULTS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    world = request.param
    if world not in _RESULTS:
        tmp = str(tmp_path_factory.mktemp(f"cp_a2a_world{world}"))
        _RESULTS[world] = cp_harness.spawn(_worker, world, tmp, (list(CASES[world]),), cp_harness.SPAWN_TIMEOUT_S)
    return world, _RESULTS[world]


@pytest.mark.timeout(cp_harness.SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("results, name", [pytest.param(w, n, id=f"world{w}-{n}") for w in WORLDS for n in CASES[w]],
                         indirect=["results"])
def test_cp_a2a_matches_single_process(results, name):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        case = CASES[world][name]
        cp_harness.check(res[name], case.get("dtype", "float64"), case.get("tol", TOL64), f"rank {rank} world {world}")


@pytest.mark.timeout(cp_harness.SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("results", WORLDS, ids=lambda w: f"world{w}", indirect=True)
def test_cp_a2a_bad_inputs_raise_before_communication(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        errors = res["__errors__"]
        assert errors and all(errors.values()), f"rank {rank} world {world}: {errors}"


# ------------------------------------------------------------------ plan only (no process group)
@pytest.mark.parametrize("balance", ["zigzag", "contiguous", "documents"])
@pytest.mark.parametrize("sizes", [(1, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2)])
def test_hybrid_plan_partitions_every_row(sizes, balance):
    seqs = Varlen.from_lengths([1, 0, 7, 3, 29, 2, 16], pad_to_multiple=3)
    world = sizes[0] * sizes[1]
    plans = [cp.plan(seqs, strategy="hybrid", balance=balance, world=sizes, rank=r, outer="allgather")
             for r in range(world)]
    rows = torch.cat([p.local_rows for p in plans])
    assert torch.equal(rows.sort().values, torch.arange(seqs.total_q))
    seq, pos = seqs.row_map_q()
    for p in plans:
        assert p.strategy == "a2a+p2p" and p.world == world and p.outer.strategy == "allgather"
        assert torch.equal(p.local_rows, p.local_rows.sort().values)
        assert torch.equal(p.owner[p.local_rows], torch.full_like(p.local_rows, p.rank))
        assert torch.equal(p.position_ids, pos[p.local_rows])
        first = p.rank * p.max_local
        assert sorted(p.flat_pos[p.local_rows].tolist()) == list(range(first, first + p.num_local))
        covered = sum(int(b - a) for _, a, b, _, _ in p.pieces.tolist())
        assert covered == int((seq[p.local_rows] >= 0).sum())
        for d, a, b, _, first in p.pieces.tolist():  # every piece is a run of this rank's rows
            assert set(range(first + a, first + b)) <= set(p.local_rows.tolist())
    # an inner group holds exactly its outer rank's rows, split contiguously
    for o in range(sizes[0]):
        group_rows = torch.cat([plans[o * sizes[1] + i].local_rows for i in range(sizes[1])])
        assert torch.equal(group_rows, plans[o * sizes[1]].outer.local_rows)
        counts = [plans[o * sizes[1] + i].num_local for i in range(sizes[1])]
        assert max(counts) - min(counts) <= 1


def test_a2a_plan_and_head_split():
    from packattn.cp.alltoall import HeadSplit

    for hq, hk, world in [(4, 4, 2), (4, 2, 4), (4, 1, 4), (12, 6, 4), (12, 4, 2), (8, 2, 4), (6, 3, 3), (16, 4, 8)]:
        split = HeadSplit.build(hq, hk, world, "cpu")
        select = split.kv_select if split.kv_select is not None else torch.arange(hk)
        group = split.heads_q_local // split.heads_kv_local
        for r, i in itertools.product(range(world), range(split.heads_q_local)):
            # local q head i on rank r uses local kv head i // group: it must be the global one
            assert select[r * split.heads_kv_local + i // group] == (r * split.heads_q_local + i) // (hq // hk)
        if hk % world == 0:
            assert split.kv_select is None


def test_hybrid_plan_errors():
    seqs = Varlen.from_lengths([4, 5])
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        cp.plan(seqs, world=4, rank=0, strategy="a2a+p2p")
    with pytest.raises(ValueError, match="outer must be"):
        cp.plan(seqs, world=(2, 2), rank=0, strategy="a2a+p2p", outer="tree")
    with pytest.raises(ValueError, match="outer="):
        cp.plan(seqs, world=2, rank=0, strategy="a2a", outer="allgather")
    p = cp.plan(seqs, world=(2, 2), rank=3, strategy="hybrid")
    assert p.outer.strategy == "p2p"  # the default outer executor


def test_a2a_heads_error_needs_no_process_group():
    seqs = Varlen.from_lengths([4, 5])
    p = cp.plan(seqs, world=2, rank=0, strategy="ulysses")
    q = torch.randn(p.num_local, 3, 8)
    with pytest.raises(ValueError, match=r"heads_q \(3\) must be a multiple of 2"):
        cp.attention(q, q, q, p)
    x = torch.randn(p.num_local, 4, 8)
    with pytest.raises(ValueError, match="window"):
        cp.attention(x, x, x, p, window=(1,))
