"""Context parallelism, all-gather executor with its K/V communication split into kv-head groups that
overlap compute (`packattn.cp.allgather`, ``overlap_groups``), against single-process attention.

One gloo group per world size (2 and 4) runs every case (tests/cp_harness.py: spawned once per
world with a deadline, workers write JSON): the same seeded global inputs on every rank,
single-process float64 attention (reference backend) vs the CP result with ``overlap_groups`` in
{1, 2, 4, 8 (clamped to heads_kv)}, out, lse, dq, dk, dv gathered back to the global layout, and
two ``deterministic=True`` runs compared bitwise. Other cases count the collectives one
forward+backward issues (``G`` all-gathers and ``G`` reduce-scatters when something is shared,
none otherwise) and check the ``return_lse=False`` path and the environment variable.

What holds across ``G``: equal up to float rounding (all within 1e-10 of float64), not bitwise --
the reference backend on CPU itself gives last-bit differences for a subset of the heads.
"""

from __future__ import annotations

import itertools
import os
from unittest import mock

import pytest
import torch

from cp_harness import SPAWN_TIMEOUT_S, check, errors_vs_single, finish, grads, init_gloo, run_case, spawn
from packattn import cp
from packattn.cp import allgather, comm
from packattn.mask import Mask
from packattn.varlen import Varlen

WORLDS = (2, 4)
TOL64 = 1e-10

DOCS = {
    "nasty": dict(lengths=[1, 0, 7, 3, 29, 2], pad=None),  # shorter than the world, empty, length 1, long
    "one_doc": dict(lengths=[37], pad=None),  # one document spanning every rank
    "padded": dict(lengths=[5, 0, 13, 1, 9], pad=4),  # padding between sequences and at the end
    "tiny": dict(lengths=[2, 1], pad=None),  # some ranks hold nothing
    "whole": dict(lengths=[3, 1, 2, 5], pad=None),  # with balance "documents": nothing shared
}
MASKS = {
    "causal": dict(causal=True),
    "causal_win": dict(causal=True, window=(3, 0)),
    "win_2_3": dict(window=(2, 3)),
    "causal_chunk": dict(causal=True, chunk_size=4),
    "chunk_win_2_2": dict(chunk_size=4, window=(2, 2)),
}
HEADS = {"gqa": (8, 2, 8, 8), "mha": (4, 4, 8, 6)}  # (heads_q, heads_kv, head_dim, head_dim_v)


def _case(doc, mask, heads, groups, seed, *, balance="zigzag", dtype="float64", lse_in_loss=False):
    return dict(doc=doc, mask=mask, heads=heads, groups=groups, seed=seed, balance=balance, dtype=dtype,
                lse_in_loss=lse_in_loss)


def _cases() -> dict:
    cases = {}
    for i, (doc, mask) in enumerate(itertools.product(("nasty", "one_doc", "padded", "tiny"), MASKS)):
        heads, groups = ("gqa", "mha")[i % 2], (2, 4)[i // 2 % 2]
        cases[f"{doc}-{mask}-{heads}-G{groups}"] = _case(doc, mask, heads, groups, seed=i)
    extra = [
        _case("nasty", "causal", "gqa", 1, 100),  # one collective: the path without overlap
        _case("padded", "win_2_3", "mha", 1, 101),
        _case("one_doc", "causal_chunk", "gqa", 1, 102),
        _case("one_doc", "causal", "gqa", 8, 103),  # clamped to heads_kv = 2
        _case("nasty", "win_2_3", "mha", 8, 104),  # clamped to heads_kv = 4
        _case("nasty", "causal", "gqa", 2, 105, dtype="float32"),
        _case("one_doc", "causal_chunk", "mha", 4, 106, dtype="float32"),
        _case("padded", "causal", "gqa", 2, 107, lse_in_loss=True),  # dlse flows back through the groups
        _case("tiny", "win_2_3", "mha", 4, 108, lse_in_loss=True),
        _case("nasty", "causal_win", "gqa", 4, 109, balance="contiguous"),
        _case("nasty", "causal", "mha", 2, 110, balance="documents"),  # short documents whole, the long one cut
        _case("whole", "causal", "mha", 4, 111, balance="documents"),  # nothing to communicate
    ]
    for c in extra:
        name = f"{c['doc']}-{c['mask']}-{c['heads']}-G{c['groups']}-{c['balance']}-{c['dtype']}"
        cases[name + ("-lse_loss" if c["lse_in_loss"] else "")] = c
    return cases


CASES = _cases()

# collectives of one forward+backward: (doc, mask, heads, overlap_groups, balance, environment value)
COUNT_CASES = {
    "one_doc-G1": ("one_doc", "causal", "gqa", 1, "zigzag", None),
    "one_doc-G2": ("one_doc", "causal", "gqa", 2, "zigzag", None),
    "nasty-G4": ("nasty", "win_2_3", "mha", 4, "zigzag", None),
    "nasty-G8-clamped": ("nasty", "causal", "gqa", 8, "zigzag", None),
    "tiny-G4": ("tiny", "causal", "mha", 4, "zigzag", None),
    "whole-G4-nothing_shared": ("whole", "causal", "mha", 4, "documents", None),
    "padded-env4": ("padded", "causal", "mha", None, "zigzag", "4"),
    "padded-env1": ("padded", "causal", "mha", None, "zigzag", "1"),
    "padded-default": ("padded", "causal", "mha", None, "zigzag", ""),
}


# ------------------------------------------------------------------ worker side
def _seqs(doc: str) -> Varlen:
    spec = DOCS[doc]
    return Varlen.from_lengths(spec["lengths"], pad_to_multiple=spec["pad"])


def _run_case(case: dict) -> dict:
    return errors_vs_single(_seqs(case["doc"]), MASKS[case["mask"]], HEADS[case["heads"]],
                            getattr(torch, case["dtype"]), case["seed"],
                            lambda seqs: cp.plan(seqs, balance=case["balance"]), check_deterministic=True,
                            lse_in_loss=case["lse_in_loss"], cp_options={"overlap_groups": case["groups"]})


def _count_case(doc, mask_name, heads_name, groups, balance, env) -> dict:
    """Collectives of one forward+backward (``return_lse=False``), the expected counts, and whether
    out and the gradients equal those of a ``return_lse=True`` run bitwise (and out that of a
    forward under ``torch.no_grad()``)."""
    seqs, mask, (hq, hk, d, dv) = _seqs(doc), MASKS[mask_name], HEADS[heads_name]
    plan = cp.plan(seqs, balance=balance)
    g = torch.Generator().manual_seed(7)
    inputs = [plan.shard(torch.randn(seqs.total_q, h, dim, generator=g, dtype=torch.float64))
              for h, dim in ((hq, d), (hk, d), (hk, dv))]
    grad_out = plan.shard(torch.randn(seqs.total_q, hq, dv, generator=g, dtype=torch.float64))
    environ = {} if env is None else {allgather.ENV_OVERLAP_GROUPS: env}

    def attention(q, k, v, return_lse):
        return cp.attention(q, k, v, plan, backend="reference", return_lse=return_lse, overlap_groups=groups, **mask)

    def run(return_lse: bool):
        def fn(q, k, v):
            res = attention(q, k, v, return_lse)
            return res if return_lse else (res, res.new_zeros(0))
        return grads(fn, inputs, grad_out)

    with mock.patch.dict(os.environ, environ), \
            mock.patch.object(comm, "_all_gather", wraps=comm._all_gather) as all_gather, \
            mock.patch.object(comm, "_reduce_scatter", wraps=comm._reduce_scatter) as reduce_scatter:
        out, _, grads_plain = run(return_lse=False)
        counts = [all_gather.call_count, reduce_scatter.call_count]
        out_lse, _, grads_lse = run(return_lse=True)
        with torch.no_grad():
            out_inference = attention(*inputs, return_lse=False)
        resolved = allgather.resolve_overlap_groups(groups, hk)
    shared = allgather.build_layout(plan, Mask.make(**mask), "cpu").max_shared > 0
    same = (torch.equal(out, out_lse) and torch.equal(out, out_inference)
            and all(torch.equal(a, b) for a, b in zip(grads_plain, grads_lse)))
    return {"counts": counts, "expected": [resolved if shared else 0] * 2, "groups": resolved, "same_variants": same}


def _worker(rank, world, init_file, out_dir, case_names, count_names):
    init_gloo(rank, world, init_file, SPAWN_TIMEOUT_S)
    results = {}
    try:
        for name in case_names:
            results[name] = run_case(_run_case, CASES[name])
        for name in count_names:
            results[name] = run_case(_count_case, *COUNT_CASES[name])
    finally:
        finish(rank, out_dir, results)


# ------------------------------------------------------------------ parent side
_RESULTS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    world = request.param
    if world not in _RESULTS:
        _RESULTS[world] = spawn(_worker, world, str(tmp_path_factory.mktemp(f"cp_overlap_world{world}")),
                                (list(CASES), list(COUNT_CASES)), SPAWN_TIMEOUT_S)
    return world, _RESULTS[world]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(CASES))
def test_overlap_matches_single_process(results, name):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        check(res[name], CASES[name]["dtype"], TOL64, f"rank {rank} world {world}")


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(COUNT_CASES))
def test_overlap_collectives_per_group(results, name):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        assert "exception" not in res[name], f"rank {rank} world {world}: {res[name]}"
        assert res[name]["counts"] == res[name]["expected"], f"rank {rank} world {world}: {res[name]}"
        assert res[name]["same_variants"], f"rank {rank} world {world}: return_lse=False or no_grad differs"
    expected_groups = {"padded-env4": 4, "padded-env1": 1, "padded-default": allgather.DEFAULT_OVERLAP_GROUPS,
                       "nasty-G8-clamped": 2}
    if name in expected_groups:
        assert per_rank[0][name]["groups"] == expected_groups[name]


# ------------------------------------------------------------------ no process group
def test_resolve_overlap_groups(monkeypatch):
    monkeypatch.delenv(allgather.ENV_OVERLAP_GROUPS, raising=False)
    assert allgather.resolve_overlap_groups(None, 8) == allgather.DEFAULT_OVERLAP_GROUPS
    assert allgather.resolve_overlap_groups(4, 8) == 4
    assert allgather.resolve_overlap_groups(4, 2) == 2  # at most heads_kv
    monkeypatch.setenv(allgather.ENV_OVERLAP_GROUPS, "3")
    assert allgather.resolve_overlap_groups(None, 8) == 3
    assert allgather.resolve_overlap_groups(1, 8) == 1  # the argument wins
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="overlap_groups"):
            allgather.resolve_overlap_groups(bad, 8)
    monkeypatch.setenv(allgather.ENV_OVERLAP_GROUPS, "two")
    with pytest.raises(ValueError, match=allgather.ENV_OVERLAP_GROUPS):
        allgather.resolve_overlap_groups(None, 8)


@pytest.mark.parametrize("heads_kv", [1, 2, 3, 5, 8])
def test_head_groups_partition_the_heads(heads_kv):
    for groups in range(1, heads_kv + 1):
        parts = allgather.head_groups(heads_kv, groups)
        sizes = [s.stop - s.start for s in parts]
        assert len(parts) == groups and parts[0].start == 0 and parts[-1].stop == heads_kv
        assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_overlap_groups_only_for_allgather():
    seqs = Varlen.from_lengths([5, 7])
    plan = cp.plan(seqs, world=2, rank=0, strategy="p2p")
    q = torch.zeros(plan.num_local, 2, 4)
    with pytest.raises(ValueError, match="overlap_groups applies to strategy 'allgather'"):
        cp.attention(q, q, q, plan, causal=True, overlap_groups=2)
