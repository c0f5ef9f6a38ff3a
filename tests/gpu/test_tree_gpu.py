"""Tree attention at full size on a GPU (skipped without CUDA by tests/gpu/conftest.py): W6 and W7
of shared/workloads.md in bf16 against the reference backend in float32, the tree forward against
our varlen kernel on the expanded sequences (bf16 ulps), W8 as a tree equal to W8 as a Varlen, and
a bitwise-deterministic backward."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.bench.workloads import tree_workloads
from packattn.varlen import Varlen


def rel_l2(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the bf16 spacing at max(|a|, |b|) (8 significant bits)."""
    a, b = a.double(), b.double()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    return (a - b).abs() / ulp


@pytest.fixture(scope="module", params=["W6", "W7"])
def workload(request):
    return tree_workloads()[request.param]


def test_tree_matches_reference(workload):
    tree, q, k, v = workload.make_inputs("cuda", torch.bfloat16)
    dout = torch.randn_like(q)
    out = packattn.attention(q, k, v, tree, backend="triton_tree")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = packattn.attention(*leaves, tree, backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    errors = {name: rel_l2(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    assert all(e < 1e-2 for e in errors.values()), errors


@pytest.mark.parametrize("kernels", ["triton", "default"])
def test_tree_forward_equals_varlen_kernel_on_expanded_sequences(workload, kernels, monkeypatch):
    # "triton": the Triton tree forward vs the Triton varlen forward (they share their inner loop);
    # "default": what each backend runs by default (on sm_90 the Gluon tree forward and the Gluon varlen
    # forward, same tiles and schedule but not the same key blocks: the tree skips invisible ones)
    if kernels == "triton":
        monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    tree, q, k, v = workload.make_inputs("cuda", torch.bfloat16, requires_grad=False)
    out_tree = tree.gather(packattn.attention(q, k, v, tree, backend="triton_tree"))
    expanded = [tree.gather(x) for x in (q, k, v)]
    out_varlen = packattn.attention(*expanded, tree.unpacked, causal=True, backend="triton")
    ulps = bf16_ulps(out_tree, out_varlen)
    print(f"\n{workload.name} ({kernels}): tree vs varlen on expanded: max {ulps.max().item():.0f} bf16 ulps, "
          f"{(ulps > 0).float().mean().item() * 100:.3f}% of elements differ")
    assert ulps.max().item() <= 4


def test_w8_tree_equals_w8_varlen():
    w = tree_workloads()["W8tree"]
    tree, q, k, v = w.make_inputs("cuda", torch.bfloat16)
    varlen = Varlen.from_lengths(w.lengths_q, device="cuda")
    dout = torch.randn_like(q)
    a = packattn.attention(q, k, v, tree, backend="triton_tree")
    b = packattn.attention(q, k, v, varlen, causal=True, backend="triton")
    ga = torch.autograd.grad(a, (q, k, v), dout)
    gb = torch.autograd.grad(b, (q, k, v), dout)
    for x, y in zip((a, *ga), (b, *gb)):
        assert rel_l2(x, y) < 1e-2


def test_tree_backward_is_bitwise_deterministic():
    tree, q, k, v = tree_workloads()["W6"].make_inputs("cuda", torch.bfloat16)
    dout = torch.randn_like(q)

    def grads():
        out = packattn.attention(q, k, v, tree, backend="triton_tree", deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


def test_tree_auto_dispatch_on_cuda():
    tree, q, k, v = tree_workloads()["W6"].make_inputs("cuda", torch.bfloat16, requires_grad=False)
    from packattn import dispatch

    params = dispatch.Params(
        device_type="cuda", dtype=q.dtype, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128, kind="tree",
        pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=17, max_seqlen_kv=17,
        mask=packattn.Mask.make(causal=True), return_lse=False, deterministic=False, requires_grad=False)
    assert dispatch.select(params, "auto").name == "triton_tree"


# ---------------------------------------------------------------- Gluon tree backward (Hopper, d = 128)
# The tree backward runs the warp-specialised Gluon dK/dV (`packattn.ops.varlen.bwd_dkdv_sm90`, TREE=True) and dQ
# (`packattn.ops.tree.dq_sm90`) where the varlen plan / `packattn.ops.tree.configs.tree_dq_config` say so (sm_90,
# bf16/fp16, head dim 128), the Triton passes with PACKATTN_PORTABLE=1. Small
# trees with the awkward shapes: 1-token nodes, depth-32 chains, fan-out 64, nodes straddling 128-row
# tiles, totals that are no multiple of 64 or 128.
def _chain(node_lengths) -> list[list[int]]:
    """A chain of ``len(node_lengths)`` nodes: every prefix ending at a node boundary is a sequence."""
    base = list(range(sum(node_lengths)))
    ends = torch.tensor(node_lengths).cumsum(0).tolist()
    return [base[:end] for end in ends]


def _fan_out(prompt_len: int, children: int, child_len) -> list[list[int]]:
    """One prompt of ``prompt_len`` tokens with ``children`` continuations of ``child_len(i)`` tokens."""
    return [[7] * prompt_len + [1000 + i] * child_len(i) for i in range(children)]


def _grpo(prompt_lens, group: int, response_lens: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths with ``group`` random responses each."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for plen in prompt_lens:
        prompt = torch.randint(0, 1000, (plen,), generator=gen).tolist()
        for _ in range(group):
            n = int(torch.randint(response_lens[0], response_lens[1] + 1, (1,), generator=gen))
            out.append(prompt + torch.randint(1000, 2000, (n,), generator=gen).tolist())
    return out


def _random_sharing(count: int, max_len: int, seed: int = 5) -> list[list[int]]:
    """Sequences over a 3-token vocabulary: lots of sharing, prefixes, duplicates."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, 3, (n,), generator=gen).tolist() for n in lengths]


def _deep_then_wide() -> list[list[int]]:
    """A depth-32 chain of 1..11-token nodes with 16 leaves of 1..23 tokens under its last node."""
    chain = _chain([(5 * i) % 11 + 1 for i in range(32)])
    return chain + [chain[-1] + [2000 + i] * (1 + (7 * i) % 23) for i in range(16)]


NASTY_TREES = {  # name -> sequences (totals: 32, 462, 466, 380, 4099, 3235, 5528 rows)
    "chain_of_1_token_nodes": lambda: _chain([1] * 32),
    "chain_32_straddling_tiles": lambda: _chain([(37 * i) % 29 + 1 for i in range(32)]),
    "fan_out_64_short_leaves": lambda: _fan_out(150, 64, lambda i: 1 + i % 9),
    "deep_then_wide": _deep_then_wide,
    "grpo_straddling_tiles": lambda: _grpo([131, 200, 77], 8, (1, 300)),
    "random_sharing": lambda: _random_sharing(40, 200),
    "fan_out_64_long_leaves": lambda: _fan_out(250, 64, lambda i: 40 + (13 * i) % 90),
}


def _tree_inputs(tree, heads_q: int, heads_kv: int, dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(heads):
        return torch.randn(tree.total, heads, 128, device="cuda", generator=gen).to(dtype)

    q, k, v = (rand(h).requires_grad_() for h in (heads_q, heads_kv, heads_kv))
    return q, k, v, rand(heads_q), torch.randn(heads_q, tree.total, device="cuda", generator=gen)


def _tree_grads(q, k, v, dout, dlse, tree, backend="triton_tree"):
    """``(dq, dk, dv)`` of ``sum(out * dout) + sum(lse * dlse)``."""
    out, lse = packattn.attention(q, k, v, tree, backend=backend, return_lse=True)
    return torch.autograd.grad((out.float() * dout.float()).sum() + (lse * dlse).sum(), (q, k, v))


def _gluon_tree_kernels(q, k, v) -> dict:
    """Which Gluon kernels the tree backward runs on these tensors."""
    from packattn.ops.tree.configs import tree_dq_config
    from packattn.ops.varlen.op import bwd_plan

    return {"dkdv": bwd_plan(q, k, v).dkdv is not None, "dq": tree_dq_config(q, k, v) is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa4_2", "mqa4_1", "mha2"])
@pytest.mark.parametrize("name", list(NASTY_TREES))
def test_gluon_tree_backward_matches_triton_and_reference(name, heads, dtype, monkeypatch):
    tree = packattn.Tree.from_sequences(NASTY_TREES[name](), device="cuda")
    q, k, v, dout, dlse = _tree_inputs(tree, *heads, dtype)
    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    if not any(_gluon_tree_kernels(q, k, v).values()):  # (on sm_90 at d = 128 both run)
        pytest.skip(f"the Gluon tree backward does not run here: {_gluon_tree_kernels(q, k, v)}")
    gluon = _tree_grads(q, k, v, dout, dlse, tree)
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")  # before the forward: it builds the tables
    assert not any(_gluon_tree_kernels(q, k, v).values())
    triton_grads = _tree_grads(q, k, v, dout, dlse, tree)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = _tree_grads(*leaves, dout, dlse, tree, backend="reference")
    errors = {}
    for grad, g, t, r in zip(("dq", "dk", "dv"), gluon, triton_grads, ref):
        assert torch.isfinite(g).all(), grad
        errors[grad] = (rel_l2(g, t), rel_l2(g, r), rel_l2(t, r))  # gluon-triton, gluon-ref, triton-ref
    assert all(e < 1e-2 for errs in errors.values() for e in errs), errors


# ---------------------------------------------------------------- Gluon tree forward (Hopper, d = 64 / 128)
# `packattn.ops.tree.launch_sm90.gluon_tree_fwd` against the Triton tree forward (PACKATTN_PORTABLE=1) and the float32 reference backend, on NASTY_TREES and
# W6. Both kernels round P to 16 bits before the PV product, in different block orders: out within 2e-2
# absolute and lse within 1e-3 of the Triton forward (as benchmarks/ab_gluon_fwd.py for varlen), and
# relative L2 < 1e-2 (out) / 1e-3 absolute (lse) against the reference.
GLUON_TREE_OUT_TOL, GLUON_TREE_LSE_TOL = 2e-2, 1e-3


def _fwd_inputs(tree, heads_q: int, heads_kv: int, head_dim: int, dtype, seed: int = 0):
    """q, k, v of the tree's rows (no grad)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(tree.total, h, head_dim, device="cuda", generator=gen).to(dtype)
            for h in (heads_q, heads_kv, heads_kv)]


def _gluon_tree_forward(q, k, v, tree, config=None, max_programs=None):
    """``(out, lse)`` of `gluon_tree_fwd`, tables built with its block sizes (``config``'s when given)."""
    from packattn.ops.tree.configs import tree_fwd_config
    from packattn.ops.tree.launch_sm90 import gluon_tree_fwd
    from packattn.ops.tree.tables import build_query_tiles

    config = config or tree_fwd_config(q, k, v)
    key_end = tree.row_subtree_end().to(torch.int32).contiguous()
    tiles, intervals = build_query_tiles(key_end, tree.total, config.block_m, config.block_n)
    return gluon_tree_fwd(q, k, v, key_end, tiles, intervals, q.shape[-1] ** -0.5, config,
                          max_programs=max_programs)


def _check_gluon_tree_forward(q, k, v, tree, monkeypatch, **launch) -> dict:
    """`_gluon_tree_forward` vs the Triton tree forward and the float32 reference (skips off sm_90)."""
    from packattn.ops.tree.configs import tree_fwd_config

    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    if tree_fwd_config(q, k, v) is None:
        pytest.skip("the Gluon tree forward runs on sm_90 (H100 / H200) only")
    out, lse = _gluon_tree_forward(q, k, v, tree, **launch)
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert tree_fwd_config(q, k, v) is None
    triton_out, triton_lse = packattn.attention(q, k, v, tree, backend="triton_tree", return_lse=True)
    ref_out, ref_lse = packattn.attention(q.float(), k.float(), v.float(), tree, backend="reference",
                                          return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (q.shape[1], tree.total)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # every row sees at least its own key
    errors = {"out-triton": (out.float() - triton_out.float()).abs().max().item(),
              "lse-triton": (lse - triton_lse).abs().max().item(),
              "out-ref (rel L2)": rel_l2(out, ref_out),
              "lse-ref": (lse - ref_lse).abs().max().item()}
    assert errors["out-triton"] <= GLUON_TREE_OUT_TOL and errors["lse-triton"] <= GLUON_TREE_LSE_TOL, errors
    assert errors["out-ref (rel L2)"] < 1e-2 and errors["lse-ref"] <= GLUON_TREE_LSE_TOL, errors
    return errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa4_2", "mqa4_1"])
@pytest.mark.parametrize("name", list(NASTY_TREES))
def test_gluon_tree_forward_matches_triton_and_reference(name, heads, head_dim, dtype, monkeypatch):
    tree = packattn.Tree.from_sequences(NASTY_TREES[name](), device="cuda")
    _check_gluon_tree_forward(*_fwd_inputs(tree, *heads, head_dim, dtype), tree, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_tree_forward_w6(dtype, monkeypatch):
    w = tree_workloads()["W6"]
    tree, q, k, v = w.make_inputs("cuda", dtype, requires_grad=False)
    errors = _check_gluon_tree_forward(q, k, v, tree, monkeypatch)
    print(f"\nW6 {dtype}: {errors}")


# other configurations: one consumer warp group with 64-key blocks (twice the intervals / blocks), and
# persistent grids of 3 / 5 programs (many work items per program: ring and Q barrier phases carried across)
@pytest.mark.parametrize("config, max_programs", [((64, 64, 3, 4), None), ((128, 128, 3, 8), 3), ((128, 64, 4, 8), 5)])
@pytest.mark.parametrize("name", ["grpo_straddling_tiles", "random_sharing", "chain_of_1_token_nodes"])
def test_gluon_tree_forward_configurations(name, config, max_programs, monkeypatch):
    from packattn.ops.varlen.configs import GluonConfig

    tree = packattn.Tree.from_sequences(NASTY_TREES[name](), device="cuda")
    q, k, v = _fwd_inputs(tree, 4, 2, 128, torch.bfloat16, seed=1)
    _check_gluon_tree_forward(q, k, v, tree, monkeypatch, config=GluonConfig(*config), max_programs=max_programs)


def test_gluon_tree_forward_override(monkeypatch):
    from packattn.ops.tree import configs as tree_configs
    from packattn.ops.varlen.configs import GluonConfig

    tree = packattn.Tree.from_sequences(NASTY_TREES["deep_then_wide"](), device="cuda")
    q, k, v = _fwd_inputs(tree, 2, 2, 64, torch.float16)
    with tree_configs.override(TREE_FWD_CONFIGS={**tree_configs.TREE_FWD_CONFIGS, 64: GluonConfig(128, 64, 4, 8)}):
        if tree_configs.tree_fwd_config(q, k, v) is not None:
            assert tree_configs.fwd_blocks(q, k, v) == (128, 64)
        _check_gluon_tree_forward(q, k, v, tree, monkeypatch)


@pytest.mark.parametrize("name", ["fan_out_64_short_leaves", "random_sharing"])
def test_gluon_tree_backward_is_bitwise_deterministic(name, monkeypatch):
    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    tree = packattn.Tree.from_sequences(NASTY_TREES[name](), device="cuda")
    q, k, v, dout, dlse = _tree_inputs(tree, 4, 2, torch.bfloat16)
    if not any(_gluon_tree_kernels(q, k, v).values()):  # (on sm_90 at d = 128 both run)
        pytest.skip(f"the Gluon tree backward does not run here: {_gluon_tree_kernels(q, k, v)}")
    for a, b in zip(_tree_grads(q, k, v, dout, dlse, tree), _tree_grads(q, k, v, dout, dlse, tree)):
        assert torch.equal(a, b)


def test_gluon_tree_dq_matches_triton_tree_dq_on_the_same_tables():
    """The dQ kernels alone (same lse, delta and tables), so a dQ difference is not hidden by the rest."""
    from packattn.ops.runtime.launch import LOG2E, _launch, _precision, block_d
    from packattn.ops.tree.configs import tree_dq_config
    from packattn.ops.tree.kernels_triton import tree_dq_kernel
    from packattn.ops.tree.launch_sm90 import gluon_tree_dq
    from packattn.ops.tree.tables import tree_tables
    from packattn.ops.varlen.configs import launch_config
    from packattn.ops.varlen.launch_triton import bwd_delta

    tree = packattn.Tree.from_sequences(NASTY_TREES["deep_then_wide"](), device="cuda")
    q, k, v, dout, _ = _tree_inputs(tree, 4, 1, torch.bfloat16)
    q, k, v = (x.detach() for x in (q, k, v))
    cfg = tree_dq_config(q, k, v)
    if cfg is None:
        pytest.skip("the Gluon tree dQ does not run here")
    scale = 128 ** -0.5
    out, lse = packattn.attention(q, k, v, tree, backend="triton_tree", return_lse=True, scale=scale)
    delta = bwd_delta(out, dout, lse, None)
    key_end, _, _, dq_tiles, dq_intervals, _, _ = tree_tables(tree, q, k, v, True)
    gluon = torch.empty_like(q)
    gluon_tree_dq(q, k, v, dout, lse, delta, gluon, dq_tiles, dq_intervals, key_end, scale, cfg)
    expected = torch.empty_like(q)
    config = launch_config("dq", 128, q.dtype, q.device)
    args = (q, k, v, dout, lse, delta, expected, dq_tiles, dq_intervals, key_end, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), expected.stride(0),
            expected.stride(1), lse.stride(0), tree.total, 4, 4, scale * LOG2E, scale)
    _launch(tree_dq_kernel, (dq_tiles.shape[0] * 4,), args,
            dict(HEAD_DIM=128, BLOCK_D=block_d(128), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 INPUT_PRECISION=_precision(q.dtype)), config)
    assert torch.isfinite(gluon).all()
    assert rel_l2(gluon, expected) < 1e-2
