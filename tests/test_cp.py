"""Context parallelism (`packattn.cp`, all-gather strategy) against single-process attention.

One gloo group per world size (2 and 4) runs every case: the same seeded global inputs on every
rank, the single-process reference backend in float64 vs the CP result, with out, lse, dq, dk, dv
gathered back to the global layout. Workers write their errors to JSON files; the parent joins
them with a deadline, so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os

import pytest
import torch

import packattn
from cp_harness import SPAWN_TIMEOUT_S, run_case, spawn
from packattn import cp
from packattn.varlen import Varlen

WORLDS = (2, 4)
TOL64 = 1e-10

DOCS = {
    "nasty": dict(lengths=[1, 0, 7, 3, 29, 2], pad=None),  # shorter than cp, empty, length 1, long
    "one_doc": dict(lengths=[37], pad=None),  # one document spanning every rank
    "padded": dict(lengths=[5, 0, 13, 1, 9], pad=4),  # padding between sequences and at the end
    "tiny": dict(lengths=[2, 1], pad=None),  # some ranks hold nothing
}
MASKS = {
    "causal": dict(causal=True),
    "top_left": dict(causal="top_left"),
    "full": dict(),
    "causal_win": dict(causal=True, window=(3, 0)),
    "win_3_0": dict(window=(3, 0)),
    "win_2_3": dict(window=(2, 3)),
    "win_inf_2": dict(window=(-1, 2)),
    "win_4_inf": dict(window=(4, -1)),
    "causal_chunk": dict(causal=True, chunk_size=4),
    "chunk": dict(chunk_size=5),
    "chunk_win": dict(causal=True, chunk_size=6, window=(2, 0)),
    "chunk_win_2_2": dict(chunk_size=4, window=(2, 2)),
}
HEADS = [(4, 4, 8, 8), (4, 2, 8, 6), (4, 1, 4, 4)]  # (heads_q, heads_kv, head_dim, head_dim_v)


def _cases():
    cases = {}
    for i, ((doc, mask), balance) in enumerate(itertools.product(itertools.product(DOCS, MASKS), ("zigzag", "contiguous"))):
        cases[f"{doc}-{mask}-{balance}"] = dict(doc=doc, mask=mask, balance=balance, heads=HEADS[i % 3],
                                                dtype="float64", seed=i)
    for i, (doc, mask) in enumerate(itertools.product(("nasty", "padded"), MASKS)):  # some documents whole, some cut
        cases[f"{doc}-{mask}-documents"] = dict(doc=doc, mask=mask, balance="documents", heads=HEADS[i % 3],
                                                dtype="float64", seed=500 + i)
    for doc, mask in (("nasty", "causal"), ("padded", "win_2_3"), ("one_doc", "causal_chunk")):
        cases[f"{doc}-{mask}-float32"] = dict(doc=doc, mask=mask, balance="zigzag", heads=HEADS[1],
                                              dtype="float32", seed=1000)
    return cases


CASES = _cases()


# ------------------------------------------------------------------ worker side
def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    (out * grad_out).sum().backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|; inf when their non-finite entries (lse = -inf) differ."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
        return math.inf
    diff = (a[finite] - b[finite]).abs()
    return float(diff.max()) if diff.numel() else 0.0


def _run_case(case, group_plan_args):
    spec, mask = DOCS[case["doc"]], MASKS[case["mask"]]
    hq, hk, d, dv = case["heads"]
    seqs = Varlen.from_lengths(spec["lengths"], pad_to_multiple=spec["pad"])
    g = torch.Generator().manual_seed(case["seed"])
    total = seqs.total_q
    ref_inputs = [torch.randn(total, h, dim, generator=g, dtype=torch.float64)
                  for h, dim in ((hq, d), (hk, d), (hk, dv))]
    grad_out = torch.randn(total, hq, dv, generator=g, dtype=torch.float64)

    def single(q, k, v):
        return packattn.attention(q, k, v, seqs, backend="reference", return_lse=True, **mask)

    out_ref, lse_ref, grads_ref = _grads(single, ref_inputs, grad_out)
    dtype = getattr(torch, case["dtype"])
    inputs = [t.to(dtype) for t in ref_inputs]
    errors = {}
    if dtype != torch.float64:  # the single-process error in this dtype is the yardstick
        out32, lse32, grads32 = _grads(single, inputs, grad_out.to(dtype))
        errors["single"] = dict(zip(("out", "lse", "dq", "dk", "dv"),
                                    [_max_err(out32, out_ref), _max_err(lse32, lse_ref)]
                                    + [_max_err(a, b) for a, b in zip(grads32, grads_ref)]))

    plan = cp.plan(seqs, balance=case["balance"], **group_plan_args)
    local = [plan.shard(t) for t in inputs]

    def parallel(q, k, v):
        return cp.attention(q, k, v, plan, backend="reference", return_lse=True, **mask)

    out_l, lse_l, grads_l = _grads(parallel, local, plan.shard(grad_out.to(dtype)))
    with torch.no_grad():
        out_g, lse_g = plan.unshard(out_l), plan.unshard(lse_l.t().contiguous()).t()
        grads_g = [plan.unshard(t) for t in grads_l]
    errors["cp"] = dict(zip(("out", "lse", "dq", "dk", "dv"),
                            [_max_err(out_g, out_ref), _max_err(lse_g, lse_ref)]
                            + [_max_err(a, b) for a, b in zip(grads_g, grads_ref)]))
    pad = seqs.row_map_q()[0] < 0
    errors["padding_nonzero"] = sum(int(t[pad].count_nonzero()) for t in [out_g, *grads_g])
    errors["position_ids_ok"] = bool(torch.equal(plan.position_ids, seqs.row_map_q()[1][plan.local_rows]))
    return errors


def _check_unshard_backward(world):
    seqs = Varlen.from_lengths([3, 8, 1], pad_to_multiple=4)
    plan = cp.plan(seqs)
    x = torch.arange(seqs.total_q * 2, dtype=torch.float64).view(-1, 2)
    w = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)
    x_local = plan.shard(x).requires_grad_()
    y = plan.unshard(x_local)
    (y * w).sum().backward()  # every rank's loss depends on every row: gradients sum over ranks
    return bool(torch.equal(y, x)) and bool(torch.allclose(x_local.grad, world * plan.shard(w)))


def _worker(rank, world, init_file, out_dir, case_names):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=SPAWN_TIMEOUT_S))
    results = {}
    try:
        for name in case_names:
            results[name] = run_case(_run_case, CASES[name], {})
        results["__unshard_backward__"] = _check_unshard_backward(world)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


# ------------------------------------------------------------------ parent side
_RESULTS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    world = request.param
    if world not in _RESULTS:
        _RESULTS[world] = spawn(_worker, world, str(tmp_path_factory.mktemp(f"cp_world{world}")), (list(CASES),),
                                 SPAWN_TIMEOUT_S)
    return world, _RESULTS[world]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(CASES))
def test_cp_allgather_matches_single_process(results, name):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        errors = res[name]
        assert "exception" not in errors, f"rank {rank}: {errors}"
        assert errors["padding_nonzero"] == 0, f"rank {rank}: padding rows not zero"
        assert errors["position_ids_ok"], f"rank {rank}: position_ids"
        for key, err in errors["cp"].items():
            if CASES[name]["dtype"] == "float64":
                assert err <= TOL64, f"rank {rank} world {world}: {key} error {err}"
            else:
                bound = 2 * errors["single"][key] + 1e-5
                assert err <= bound, f"rank {rank} world {world}: {key} error {err} > {bound}"


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_cp_unshard_backward_sums_over_ranks(results):
    _, per_rank = results
    assert all(res["__unshard_backward__"] for res in per_rank)


# ------------------------------------------------------------------ plan only (no process group)
@pytest.mark.parametrize("balance", ["zigzag", "contiguous", "documents"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_plan_partitions_every_row(world, balance):
    seqs = Varlen.from_lengths([1, 0, 7, 3, 29, 2, 16], pad_to_multiple=3)
    plans = [cp.plan(seqs, world=world, rank=r, balance=balance) for r in range(world)]
    rows = torch.cat([p.local_rows for p in plans])
    assert torch.equal(rows.sort().values, torch.arange(seqs.total_q))
    for p in plans:
        assert torch.equal(p.local_rows, p.local_rows.sort().values)
        assert torch.equal(p.owner[p.local_rows], torch.full_like(p.local_rows, p.rank))
        covered = sum(int(b - a) for _, a, b, _, _ in p.pieces.tolist())
        assert covered == int((seqs.row_map_q()[0][p.local_rows] >= 0).sum())


def test_plan_zigzag_balances_causal_work():
    seqs = Varlen.from_lengths([4096, 1000, 333])
    work = []
    for r in range(4):
        p = cp.plan(seqs, world=4, rank=r, balance="zigzag")
        work.append(sum((b * (b + 1) - a * (a + 1)) // 2 for _, a, b, _, _ in p.pieces.tolist()))
    assert max(work) / min(work) < 1.01
    work_contig = [sum((b * (b + 1) - a * (a + 1)) // 2 for _, a, b, _, _ in
                       cp.plan(seqs, world=4, rank=r, balance="contiguous").pieces.tolist()) for r in range(4)]
    assert max(work_contig) / min(work_contig) > 3


def test_plan_documents_keeps_short_documents_whole():
    from packattn.bench.workloads import doc_lengths
    from packattn.cp.allgather import build_layout
    from packattn.mask import Mask

    for world in (2, 4, 8):
        seqs = Varlen.from_lengths(doc_lengths(32768 * world, seed=0))  # W10
        plans = [cp.plan(seqs, world=world, rank=r, balance="documents") for r in range(world)]
        tokens = [p.num_local for p in plans]
        work = [sum((b * (b + 1) - a * (a + 1)) // 2 for _, a, b, _, _ in p.pieces.tolist()) for p in plans]
        assert max(tokens) / min(tokens) < 1.02 and max(work) / min(work) < 1.02, (tokens, work)
        cut = [length > 32768 / 2 for length in seqs.lengths_q]
        for p in plans:
            whole = p.pieces[:, 1].eq(0) & p.pieces[:, 2].eq(p.pieces[:, 3])
            assert all(bool(w) or cut[d] for d, w in zip(p.pieces[:, 0].tolist(), whole.tolist()))
        if not any(cut):  # nothing to communicate
            assert build_layout(plans[0], Mask.make(True, None, None), "cpu").max_shared == 0
    # one document longer than half a rank's share is cut over every rank, the others stay whole
    seqs = Varlen.from_lengths([100, 5, 7, 3])
    owners = cp.plan(seqs, world=2, rank=0, balance="documents").owner
    assert set(owners[:100].tolist()) == {0, 1} and len(set(owners[100:105].tolist())) == 1


def test_plan_errors():
    seqs = Varlen.from_lengths([4, 5])
    with pytest.raises(ValueError, match="strategy"):
        cp.plan(seqs, world=2, rank=0, strategy="rings")
    assert cp.plan(seqs, world=2, rank=0, strategy="ring").strategy == "p2p"
    with pytest.raises(ValueError, match="balance"):
        cp.plan(seqs, world=2, rank=0, balance="random")
    with pytest.raises(ValueError, match="self-attention"):
        cp.plan(Varlen.from_lengths([4, 5], [2, 2]), world=2, rank=0)
    with pytest.raises(TypeError, match="Varlen or a packattn.Tree"):
        cp.plan([4, 5], world=2, rank=0)
