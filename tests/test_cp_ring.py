"""Context parallelism, P2P ring (`packattn.cp.ring`, strategy "p2p") against single-process attention.

One gloo group per world size (2 and 4) runs every case (tests/cp_harness.py: spawn once per
world with a deadline, workers write JSON). Same seeded global inputs on every rank; out, lse,
dq, dk, dv gathered back to the global layout and compared with single-process float64.

Precision. The ring merges per-step results through their lse, and backends return lse in
float32 (also for float64 inputs), so with the reference backend the float64 ring is exact only
to float32 rounding of the merge weights (errors ~1e-7; bound `TOL64_LSE32`). To check that the
algorithm itself is exact (1e-10), the workers also register a test-only float64 brute-force
backend "exact64" that returns its lse in float64.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import packattn
from cp_harness import SPAWN_TIMEOUT_S, check, errors_vs_single, finish, init_gloo, max_err, run_case, spawn
from packattn import cp
from packattn import mask as masks
from packattn.backends.base import Backend
from packattn.cp import ring_layout
from packattn.varlen import Varlen

WORLDS = (2, 4)
TOL64 = 1e-10  # float64 with float64 lse (the "exact64" test backend)
TOL64_LSE32 = 2e-6  # float64 with the reference backend: merge weights from float32 lse (~1e-7 errors seen)

DOCS = {
    "nasty": dict(lengths=[1, 0, 7, 3, 29, 2], pad=None),  # shorter than 2 * world, empty, length 1, long
    "one_doc": dict(lengths=[37], pad=None),  # one document spanning every rank
    "padded": dict(lengths=[5, 0, 13, 1, 9], pad=4),  # padding between sequences and at the end
    "tiny": dict(lengths=[2, 1], pad=None),  # some ranks hold nothing
    "singles": dict(lengths=[1, 1, 1], pad=None),  # every document whole on one rank: no messages at all
}
MASKS = {"causal": dict(causal=True), "top_left": dict(causal="top_left"), "full": dict()}
WINDOW_MASKS = {  # visibility cuts through pieces: per (query piece, key piece) pair, trimmed
    "win_3_0": dict(window=(3, 0)),  # left only, not causal
    "win_2_3": dict(window=(2, 3)),  # keys before and after the queries
    "win_inf_2": dict(window=(-1, 2)),  # right only
    "causal_win": dict(causal=True, window=(4, 0)),
    "top_left_win": dict(causal="top_left", window=(4, 0)),
    "causal_chunk": dict(causal=True, chunk_size=4),
    "chunk": dict(chunk_size=5),
    "chunk_win": dict(causal=True, chunk_size=6, window=(2, 0)),
    "chunk_win_2_2": dict(chunk_size=4, window=(2, 2)),
}
MASKS.update(WINDOW_MASKS)
HEADS = [(4, 4, 8, 8), (4, 2, 8, 6), (4, 1, 4, 4)]  # (heads_q, heads_kv, head_dim, head_dim_v)
TRITON_HEADS = (2, 1, 32, 32)  # the Triton kernels take head dims 32, 64, ...


def _cases():
    cases = {}
    for i, (doc, mask, balance) in enumerate(itertools.product(DOCS, ("causal", "top_left", "full"),
                                                               ("zigzag", "contiguous"))):
        cases[f"{doc}-{mask}-{balance}"] = dict(doc=doc, mask=mask, balance=balance, heads=HEADS[i % 3],
                                                dtype="float64", seed=i, backend="reference", tol=TOL64_LSE32)
    for i, (doc, mask) in enumerate(itertools.product(DOCS, ("causal", "full"))):  # top_left: the same as causal
        balance = ("zigzag", "contiguous")[(i + i // 2) % 2]
        cases[f"{doc}-{mask}-{balance}-exact64"] = dict(doc=doc, mask=mask, balance=balance, heads=HEADS[i % 3],
                                                        dtype="float64", seed=100 + i, backend="exact64", tol=TOL64)
    windowed = [*itertools.product(WINDOW_MASKS, ("nasty", "one_doc", "padded")),
                ("win_2_3", "tiny"), ("chunk_win", "tiny"), ("causal_win", "singles"), ("chunk_win_2_2", "singles")]
    for i, (mask, doc) in enumerate(windowed):  # float64 lse (exact64), but every third with the reference backend
        balance, backend = ("zigzag", "contiguous")[i % 2], ("exact64", "exact64", "reference")[i % 3]
        cases[f"{doc}-{mask}-{balance}-{backend}"] = dict(
            doc=doc, mask=mask, balance=balance, heads=HEADS[i % 3], dtype="float64", seed=200 + i, backend=backend,
            tol=TOL64 if backend == "exact64" else TOL64_LSE32)
    for doc, mask, balance in (("nasty", "causal", "zigzag"), ("padded", "full", "contiguous"),
                               ("one_doc", "causal", "contiguous"), ("one_doc", "chunk_win_2_2", "zigzag")):
        cases[f"{doc}-{mask}-{balance}-float32"] = dict(doc=doc, mask=mask, balance=balance, heads=HEADS[1],
                                                        dtype="float32", seed=1000, backend="reference", tol=None)
    for doc, mask in (("nasty", "causal"), ("padded", "full"), ("one_doc", "win_2_3")):  # two runs, bitwise
        cases[f"{doc}-{mask}-deterministic"] = dict(doc=doc, mask=mask, balance="zigzag", heads=HEADS[1],
                                                    dtype="float32", seed=2000, backend="reference", tol=None,
                                                    deterministic=True)
    if ring_triton_available():  # Triton's interpreter on CPU is slow: three small cases, world 2 only
        for doc, mask, balance in (("padded", "causal", "zigzag"), ("one_doc", "full", "contiguous"),
                                   ("one_doc", "win_2_3", "zigzag")):
            cases[f"{doc}-{mask}-{balance}-triton"] = dict(doc=doc, mask=mask, balance=balance, heads=TRITON_HEADS,
                                                           dtype="float32", seed=3000, backend="triton", tol=None,
                                                           worlds=(2,))
    return cases


# lse in the loss too (the dlse term of the backward): (doc, mask, balance, backend, dtype)
LSE_LOSS_CASES = [("nasty", "causal", "zigzag", "exact64", "float64"),
                  ("padded", "full", "contiguous", "exact64", "float64"),
                  ("one_doc", "causal", "contiguous", "reference", "float32"),
                  ("one_doc", "chunk_win_2_2", "zigzag", "exact64", "float64"),  # dummy queries see zero dlse
                  ("padded", "causal_win", "contiguous", "exact64", "float64"),
                  ("tiny", "causal", "zigzag", "triton", "float32")]


# world 4 only: the ring inside process groups {0, 2} and {1, 3} (group ranks differ from global ranks)
SUBGROUP_CASES = {
    "subgroup-nasty-causal-zigzag-exact64": dict(doc="nasty", mask="causal", balance="zigzag", heads=HEADS[1],
                                                 dtype="float64", seed=500, backend="exact64", tol=TOL64),
    "subgroup-padded-full-contiguous": dict(doc="padded", mask="full", balance="contiguous", heads=HEADS[2],
                                            dtype="float64", seed=501, backend="reference", tol=TOL64_LSE32),
}


def ring_triton_available() -> bool:
    from packattn.backends import triton_varlen

    return triton_varlen.TritonVarlenBackend().unavailable() is None


CASES = _cases()


# ------------------------------------------------------------------ test-only backend: float64 lse
class Exact64Backend(Backend):
    """Float64 brute force per sequence (autograd) that returns lse in float64, unlike every real
    backend; lets the ring's merge and backward be checked to 1e-10."""

    name = "exact64"

    def unsupported(self, params):
        return None if params.kind == "varlen" and params.dtype == torch.float64 else "float64 varlen only"

    def run(self, problem):
        q, k, v, seqs, mask, scale = problem.q, problem.k, problem.v, problem.seqs, problem.mask, problem.scale
        group = q.shape[1] // k.shape[1]
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2]) + 0 * (q.sum() + k.sum() + v.sum())
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
        for i, (lq, lk) in enumerate(zip(seqs.lengths_q, seqs.lengths_kv)):
            if lq == 0:
                continue
            sq, sk = seqs.host_starts_q[i], seqs.host_starts_kv[i]
            rows = torch.arange(sq, sq + lq)
            qs = q[sq: sq + lq].transpose(0, 1)
            ks = k[sk: sk + lk].repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[sk: sk + lk].repeat_interleave(group, dim=1).transpose(0, 1)
            s = (qs @ ks.transpose(1, 2)) * scale
            s = s.masked_fill(~masks.dense_mask(mask, lq, lk), -math.inf)  # every row sees a key in the ring's steps
            row_lse = torch.logsumexp(s, dim=-1)
            out = out.index_copy(0, rows, (torch.exp(s - row_lse[..., None]) @ vs).transpose(0, 1))
            lse = lse.index_copy(1, rows, row_lse)
        return out, (lse if problem.return_lse else None)


# ------------------------------------------------------------------ worker side
def _run_case(case, group=None):
    spec = DOCS[case["doc"]]
    seqs = Varlen.from_lengths(spec["lengths"], pad_to_multiple=spec["pad"])

    def make_plan(seqs):
        return cp.plan(seqs, group, strategy="p2p", balance=case["balance"])

    return errors_vs_single(seqs, MASKS[case["mask"]], case["heads"], getattr(torch, case["dtype"]), case["seed"],
                            make_plan, backend=case["backend"], check_deterministic=case.get("deterministic", False))


def _lse_loss_errors(doc, mask, balance, backend, dtype):
    """Gradients of ``sum(out * g) + sum(lse * h)`` (finite lse): ring vs single-process float64."""
    spec, mask = DOCS[doc], MASKS[mask]
    seqs = Varlen.from_lengths(spec["lengths"], pad_to_multiple=spec["pad"])
    hq, hk, d, dv = TRITON_HEADS if backend == "triton" else HEADS[1]
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(seqs.total_q, h, dim, generator=gen, dtype=torch.float64)
              for h, dim in ((hq, d), (hk, d), (hk, dv))]
    g = torch.randn(seqs.total_q, hq, dv, generator=gen, dtype=torch.float64)
    h = torch.randn(hq, seqs.total_q, generator=gen, dtype=torch.float64)

    def loss_grads(fn, tensors, g, h):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out, lse = fn(*leaves)
        ((out * g).sum() + (torch.where(torch.isfinite(lse), lse, 0).to(h.dtype) * h).sum()).backward()
        return [t.grad for t in leaves]

    def single(q, k, v):
        return packattn.attention(q, k, v, seqs, backend="reference", return_lse=True, **mask)

    ref = loss_grads(single, inputs, g, h)
    dtype = getattr(torch, dtype)
    plan = cp.plan(seqs, strategy="p2p", balance=balance)
    local = loss_grads(lambda q, k, v: cp.attention(q, k, v, plan, backend=backend, return_lse=True, **mask),
                       [plan.shard(t.to(dtype)) for t in inputs], plan.shard(g.to(dtype)),
                       plan.shard(h.t().contiguous()).t().to(dtype))
    errors = {"cp": {name: max_err(plan.unshard(t), r) for name, t, r in zip(("dq", "dk", "dv"), local, ref)}}
    if dtype != torch.float64:
        same_dtype = loss_grads(single, [t.to(dtype) for t in inputs], g.to(dtype), h.to(dtype))
        errors["single"] = {name: max_err(t, r) for name, t, r in zip(("dq", "dk", "dv"), same_dtype, ref)}
    return errors


def _worker(rank, world, init_file, out_dir, case_names):
    init_gloo(rank, world, init_file, SPAWN_TIMEOUT_S)
    packattn.backends.REGISTRY.append(Exact64Backend())  # this process only; asked for by name
    triton_steps = []
    if ring_triton_available():
        triton = packattn.backends.get("triton")
        from_stats = triton.backward_from_stats

        def counting(*args, **kwargs):  # which backward path ran: count the triton backend's (no recompute)
            grads = from_stats(*args, **kwargs)
            if grads is not None:
                triton_steps.append(1)
            return grads

        triton.backward_from_stats = counting  # this process's instance only
    results = {}
    try:
        for name in case_names:
            before = len(triton_steps)
            results[name] = run_case(_run_case, CASES[name])
            results[name]["triton_backward_steps"] = len(triton_steps) - before
        if world == 4:
            import torch.distributed as dist

            groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
            for name, case in SUBGROUP_CASES.items():
                results[name] = run_case(_run_case, case, groups[rank % 2])
        for i, args in enumerate(LSE_LOSS_CASES):
            if args[3] == "triton" and not ring_triton_available():
                continue
            results[f"lse_loss{i}"] = run_case(_lse_loss_errors, *args)
    finally:
        finish(rank, out_dir, results)


# ------------------------------------------------------------------ parent side
_RESULTS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    world = request.param
    if world not in _RESULTS:
        names = [name for name, case in CASES.items() if world in case.get("worlds", WORLDS)]
        _RESULTS[world] = spawn(_worker, world, str(tmp_path_factory.mktemp(f"cp_ring_world{world}")),
                                (names,), SPAWN_TIMEOUT_S)
    return world, _RESULTS[world]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(CASES))
def test_cp_ring_matches_single_process(results, name):
    world, per_rank = results
    case = CASES[name]
    if world not in case.get("worlds", WORLDS):
        pytest.skip(f"run with world sizes {case['worlds']} only")
    for rank, errors in enumerate(per_rank):
        where = f"rank {rank} world {world} {name}"
        check(errors[name], case["dtype"], case["tol"], where)
        if case["backend"] == "triton":  # the backward went through Backend.backward_from_stats (no recompute)
            assert sum(res[name]["triton_backward_steps"] for res in per_rank) > 0, where
        else:
            assert errors[name]["triton_backward_steps"] == 0, where


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("index", range(len(LSE_LOSS_CASES)), ids=lambda i: "-".join(LSE_LOSS_CASES[i]))
def test_cp_ring_lse_gradient(results, index):
    world, per_rank = results
    dtype = LSE_LOSS_CASES[index][4]
    if LSE_LOSS_CASES[index][3] == "triton" and not ring_triton_available():
        pytest.skip("triton backend unavailable here")
    for rank, res in enumerate(per_rank):
        errors = res[f"lse_loss{index}"]
        assert "exception" not in errors, f"rank {rank}: {errors}"
        for key, err in errors["cp"].items():
            bound = TOL64 if dtype == "float64" else 2 * errors["single"][key] + 1e-5
            assert err <= bound, f"rank {rank} world {world}: {key} error {err} > {bound}"


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SUBGROUP_CASES))
def test_cp_ring_in_subgroups(results, name):
    world, per_rank = results
    if world != 4:
        pytest.skip("world 4 only")
    for rank, res in enumerate(per_rank):
        check(res[name], SUBGROUP_CASES[name]["dtype"], SUBGROUP_CASES[name]["tol"], f"rank {rank} {name}")


# ------------------------------------------------------------------ no process group needed
def _global_pairs(plans, mask):
    """Every (query row, key row) pair the ring's layouts compute, over all ranks, steps and parts
    (dummy query rows left out). Checks on the way that no local sequence is invisible (such pairs
    are skipped) and that a sequence has fewer dummy queries than keys."""
    layouts = [ring_layout.build_layout(p, mask, "cpu") for p in plans]
    pairs = []
    for p, layout in zip(plans, layouts):
        for step in layout.steps:
            for part in step.parts:
                if step.src < 0:
                    keys = p.local_rows[part.kv.index]
                else:
                    keys = plans[step.src].local_rows[layouts[step.src].own_rows[part.kv.index]]
                queries = torch.cat([p.local_rows, torch.tensor([-1])])[part.q.index]  # -1: a dummy row
                qs, ks = part.seqs.host_starts_q, part.seqs.host_starts_kv
                for i, (lq, lk) in enumerate(zip(part.seqs.lengths_q, part.seqs.lengths_kv)):
                    vis = masks.dense_mask(part.mask, lq, lk)
                    qi, ki = vis.nonzero().unbind(1)
                    seen = [pair for pair in zip(queries[qs[i] + qi].tolist(), keys[ks[i] + ki].tolist())
                            if pair[0] >= 0]
                    assert seen, f"an invisible local sequence in {part.mask.describe()}"
                    assert int((queries[qs[i]: qs[i] + lq] < 0).sum()) < lk
                    pairs += seen
    return pairs


LAYOUT_MASKS = {"causal": dict(causal=True), "full": dict(), "causal_win": dict(causal=True, window=(5, 0)),
                "win_2_3": dict(window=(2, 3)), "win_inf_4": dict(window=(-1, 4)), "win_9_inf": dict(window=(9, -1)),
                "causal_chunk": dict(causal=True, chunk_size=4), "chunk": dict(chunk_size=6),
                "chunk_win": dict(causal=True, chunk_size=7, window=(3, 0)),
                "chunk_win_2_2": dict(chunk_size=5, window=(2, 2))}


@pytest.mark.parametrize("mask", list(LAYOUT_MASKS))
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring_layout_computes_every_visible_pair_once(world, balance, mask):
    """Host only: over all ranks, the steps' parts compute each visible (query, key) pair of the
    global batch exactly once and no other pair (windows and chunks: trimmed pairs, dummy rows)."""
    seqs = Varlen.from_lengths([1, 0, 7, 3, 29, 2, 16, 40], pad_to_multiple=3)
    plans = [cp.plan(seqs, world=world, rank=r, strategy="p2p", balance=balance) for r in range(world)]
    m = masks.Mask.make(**LAYOUT_MASKS[mask])
    pairs = _global_pairs(plans, m)
    assert len(pairs) == len(set(pairs))
    expected = set()
    for start, length in zip(seqs.host_starts_q, seqs.lengths_q):
        vis = masks.dense_mask(m, length, length)
        expected |= {(start + a, start + b) for a, b in vis.nonzero().tolist()}
    assert set(pairs) == expected


def test_duplicate_free_passes():
    index = torch.tensor([3, 1, 3, 2, 3, 1])
    passes = ring_layout._duplicate_free_passes(index)
    assert [p.tolist() for p in passes] == [[0, 1, 3], [2, 5], [4]]
    assert ring_layout._duplicate_free_passes(torch.tensor([4, 0, 2])) == ()


def test_rows_span_only_for_a_run_without_dummies_or_repeats():
    run = ring_layout.Rows.build(torch.tensor([4, 5, 6]), "cpu", dummy=9)
    assert run.span == (4, 3)
    x = torch.arange(20.0).reshape(10, 2)
    assert run.gather(x).data_ptr() == x[4].data_ptr()  # a view, no copy
    acc = torch.zeros(10, 2)
    run.add_to(acc, torch.ones(3, 2))
    assert acc.sum(1).tolist() == [0, 0, 0, 0, 2, 2, 2, 0, 0, 0]
    for index in ([4, 6, 7], [4, 5, 9], [4, 5, 4], [5, 4]):  # a gap, a dummy, a repeat, descending
        rows = ring_layout.Rows.build(torch.tensor(index), "cpu", dummy=9)
        assert rows.span is None
        assert torch.equal(rows.gather(torch.cat([x, x.new_zeros(1, 2)])), torch.cat([x, x.new_zeros(1, 2)])[index])


@pytest.mark.parametrize("mask", list(LAYOUT_MASKS))
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_ring_first_writes_are_exactly_the_untouched_rows(balance, mask):
    """Host only: a pass marked first writes rows no earlier pass wrote, a pass not marked first
    writes some row an earlier pass wrote (else it would merge into zeros for nothing)."""
    seqs = Varlen.from_lengths([1, 0, 7, 3, 29, 2, 16, 40], pad_to_multiple=3)
    m = masks.Mask.make(**LAYOUT_MASKS[mask])
    for rank in range(3):
        plan = cp.plan(seqs, world=3, rank=rank, strategy="p2p", balance=balance)
        layout = ring_layout.build_layout(plan, m, "cpu")
        written = set()
        for step in layout.steps:
            for part in step.parts:
                for (_, rows), first in zip(part.q.groups(), part.q.first, strict=True):
                    rows = set(rows.tolist())
                    assert first == (not rows & written)
                    written |= rows


def test_ring_layout_is_local_only_exactly_when_no_document_is_shared():
    """Host only: whole documents on every rank (balance "documents", short documents) give one local
    call; cut documents (zigzag) give ring steps."""
    seqs = Varlen.from_lengths([1, 2, 1, 2, 1, 1])
    m = masks.Mask.make(True, None, None)
    for balance, expected in (("documents", True), ("zigzag", False)):
        for rank in range(2):
            plan = cp.plan(seqs, world=2, rank=rank, strategy="p2p", balance=balance)
            layout = ring_layout.build_layout(plan, m, "cpu")
            assert layout.local_only == expected
            assert layout.local_only == (layout.message_rows == 0 and len(layout.steps) == 1)
