"""Host work of a small-seq call (`packattn.ops.small_seq.eager`): the aten ops and kernel launches per
forward and forward+backward (launches stubbed out: counted, not run), and the cached launch plans
against the path that builds every launch (same kernels, same arguments, bitwise the same results).
The plan cache's key, the fallbacks of torch internals, torch.func and double backward: test_small_seq_plans.py."""

import collections

import pytest
import torch
from test_small_seq import make_inputs
from torch.utils._python_dispatch import TorchDispatchMode

import packattn
from packattn.ops.runtime import fast_launch
from packattn.ops.small_seq import configs, eager, op


@pytest.fixture(autouse=True)
def no_plans(monkeypatch):
    """Each test starts with no cached plan: test order does not matter."""
    monkeypatch.setattr(eager, "_plans", {})


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """Launches recorded as ``(how, kernel name, grid, args, kwargs)`` instead of run."""
    seen = []

    def plain(kernel, grid, args, kwargs):
        seen.append(("launch", kernel.__name__, grid, args, kwargs))

    def keyed(kernel, grid, args, kwargs, key):
        seen.append(("keyed", kernel.__name__, grid, args, kwargs))

    monkeypatch.setattr(fast_launch, "launch", plain)
    monkeypatch.setattr(fast_launch, "launch_keyed", keyed)
    return seen


def attend(q, k, v, seqs, **opts):
    return packattn.attention(q, k, v, seqs, backend="small_seq", **opts)


@pytest.mark.parametrize("pad", [None, 2])
def test_ops_and_launches_per_call(launches, pad):
    """A repeated call allocates its outputs and launches one kernel per pass, nothing else: forward 2 aten
    ops (out, lse), forward+backward 5 (+ dq, dk, dv); padded batches the same ops as zero-filled ones."""
    seqs, q, k, v, dout = make_inputs([16, 3, 1, 7, 0], heads=(8, 2), dtype=torch.bfloat16, pad=pad)
    for _ in range(2):  # the first call builds the plan
        torch.autograd.grad(attend(q, k, v, seqs), (q, k, v), dout)
    launches.clear()
    with CountOps() as fwd:
        attend(q, k, v, seqs)
    assert [x[0] for x in launches] == ["keyed"]
    launches.clear()
    with CountOps() as fb:
        torch.autograd.grad(attend(q, k, v, seqs), (q, k, v), dout)
    assert [x[0] for x in launches] == ["keyed", "keyed"]
    if pad is None:
        assert dict(fwd.ops) == {"aten.new_empty.default": 2}
        assert dict(fb.ops) == {"aten.new_empty.default": 5}
    else:  # zeros for the padding rows of out / dq, dk, dv and -inf in lse
        assert dict(fwd.ops) == {"aten.new_zeros.default": 1, "aten.new_full.default": 1}
        assert dict(fb.ops) == {"aten.new_zeros.default": 4, "aten.new_full.default": 1}


def run_fb(q, k, v, seqs, dout, dlse_scale):
    """Forward and backward; ``dlse_scale`` None: lse unused (its backward gets no dlse)."""
    out, lse = attend(q, k, v, seqs, return_lse=True)
    return (out, lse, *torch.autograd.grad(loss_of(out, lse, dout, dlse_scale), (q, k, v)))


def loss_of(out, lse, dout, dlse_scale):
    loss = (out.float() * dout.float()).sum()
    return loss if dlse_scale is None else loss + dlse_scale * torch.nan_to_num(lse, neginf=0.0).sum()


@pytest.mark.parametrize("heads,pad,dlse", [((8, 2), None, 0.0), ((4, 4), 2, 0.5), ((8, 1), None, 0.25)])
def test_plan_matches_the_built_launch(launches, heads, pad, dlse):
    """The plan's launches (second call on) carry the arguments the first call built: the same kernel, grid,
    keyword arguments and scalars, the tensors in the same roles."""
    seqs, q, k, v, dout = make_inputs([16, 3, 1, 7, 0, 2], heads=heads, dtype=torch.float16, pad=pad)
    run_fb(q, k, v, seqs, dout, dlse)
    built = list(launches)
    launches.clear()
    run_fb(q, k, v, seqs, dout, dlse)
    assert [x[0] for x in built] == ["launch", "launch"] and [x[0] for x in launches] == ["keyed", "keyed"]
    for a, b in zip(built, launches):
        assert a[1:3] == b[1:3] and a[4] == b[4]
        assert len(a[3]) == len(b[3])
        for x, y in zip(a[3], b[3]):
            if isinstance(x, torch.Tensor):
                assert x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
            else:
                assert type(x) is type(y) and x == y


@pytest.mark.parametrize("heads,pad,dlse", [((4, 2), None, 0.0), ((2, 2), 2, 0.5), ((4, 1), 2, None)])
def test_plan_results_equal_the_regular_path(heads, pad, dlse):
    """Kernels run (interpreter): the cached-plan path gives bitwise the results of the regular eager path
    (the autograd function over the custom op's implementation), forward and backward, lse gradient included
    (dlse None: the gradient flows through out alone)."""
    seqs, q, k, v, dout = make_inputs([16, 3, 1, 7, 0], heads=heads, pad=pad)
    first, fast = run_fb(q, k, v, seqs, dout, dlse), run_fb(q, k, v, seqs, dout, dlse)
    items = op.item_table(seqs)
    padded = (seqs.cu_seqlens_q_padded is not None, seqs.cu_seqlens_kv_padded is not None)
    out, lse = op._SmallSeqFwdEager.apply(q, k, v, items, q.shape[-1] ** -0.5, *padded, 0)
    regular = (out, lse, *torch.autograd.grad(loss_of(out, lse, dout, dlse), (q, k, v)))
    for a, b, c in zip(first, fast, regular):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_override_and_misalignment(launches):
    """A config swapped by `configs.override` rebuilds the plan (the new config launches); a q that is not
    16-byte aligned launches with per-argument keys (`fast_launch.launch`)."""
    seqs, q, k, v, _ = make_inputs([16, 3, 1, 7], heads=(4, 2), dtype=torch.bfloat16)
    attend(q, k, v, seqs)
    attend(q, k, v, seqs)
    assert launches[-1][0] == "keyed" and launches[-1][4]["num_warps"] != 8
    launches.clear()
    with configs.override(fwd=configs.SmallSeqConfig(block_h=1, num_warps=8)):
        attend(q, k, v, seqs)
        attend(q, k, v, seqs)
    assert [(x[0], x[4]["num_warps"]) for x in launches] == [("launch", 8), ("keyed", 8)]
    launches.clear()
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:]
    q2 = flat.view(q.shape).copy_(q)
    attend(q2, k, v, seqs)
    attend(q2, k, v, seqs)
    assert [x[0] for x in launches] == ["launch", "launch"]


def test_plans_are_bounded(launches, monkeypatch):
    monkeypatch.setattr(eager, "_PLANS_MAX", 3)
    for n in range(1, 6):
        seqs, q, k, v, _ = make_inputs([4] * n, heads=(2, 1), dtype=torch.bfloat16)
        attend(q, k, v, seqs)
    assert 1 <= len(eager._plans) <= 3
