"""The cached launch plans of the small-seq eager path (`packattn.ops.small_seq.eager`): every part of the
plan key matters (a call that differs from a cached plan's call in one part alone, shapes equal, gives
bitwise the regular path's results), the fallback where torch lacks the internals the fast path uses, the
argument-layout check of a plan, and the limits: torch.func transforms and double backward raise."""

import pytest
import torch
from test_small_seq import make_inputs
from torch.utils._python_dispatch import TorchDispatchMode
from triton_varlen_harness import DEVICE

import packattn
from packattn.ops.runtime import fast_launch
from packattn.ops.small_seq import eager, op

_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default}


@pytest.fixture(autouse=True)
def no_plans(monkeypatch):
    """Each test starts with no cached plan: test order does not matter."""
    monkeypatch.setattr(eager, "_plans", {})


class Poison(TorchDispatchMode):
    """Uninitialised floating-point memory (empty, new_empty, empty_like) is NaN: rows a launch should have
    written (or a plan should have zero-filled) and did not show up in the results."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and out.is_floating_point():
            out.fill_(float("nan"))
        return out


@pytest.fixture
def keyed_contract(monkeypatch):
    """Kernels run; `fast_launch.launch_keyed`'s contract is checked: one key, one specialisation (the same
    keyword arguments and `fast_launch.arg_key` of every argument: on a GPU, the compiled kernel is reused)."""
    seen = {}

    def keyed(kernel, grid, args, kwargs, key):
        spec = (tuple(kwargs.items()), tuple(fast_launch.arg_key(a) for a in args))
        assert seen.setdefault((kernel, key), spec) == spec, "one launch_keyed key, two specialisations"
        kernel[grid](*args, **kwargs)

    monkeypatch.setattr(fast_launch, "launch_keyed", keyed)
    return seen


def packed(x):
    """``x``'s values as a strided view (rows twice as far apart, as q of a packed qkv tensor)."""
    return torch.cat([x, torch.zeros_like(x)], 1)[:, : x.shape[1]]


# call shape: q (4, 4, 64), k = v (16, 2, 64); the base call is a dense batch of 4 items x 4 keys
_BASE_ITEMS = [[0, 1, 2, 3], [0, 4, 8, 12], [4, 4, 4, 4]]
VARIANTS = {  # one part of the plan key changed, shapes equal
    "q_strided": {"q": packed},
    "k_strided": {"k": packed},
    "v_strided": {"v": packed},
    "bf16": {"dtype": torch.bfloat16},
    "scale": {"scale": 0.3},
    "num_items": {"items": [[0, 1, 2, 3, -1], [0, 4, 8, 12, 14], [4, 4, 4, 2, 2]]},
    "padded_q": {"items": [[0, -1, 2, 3], [0, 4, 8, 12], [4, 4, 4, 4]], "padded_q": True},
    "padded_kv": {"items": [[0, 1, 2, 3], [0, 4, 8, 12], [4, 3, 4, 2]], "padded_kv": True},
    "kv_fill": {"items": [[0, 1, 2, 3], [0, 4, 8, 12], [4, 3, 4, 2]], "kv_fill": 4},
}


def call_args(variant=None) -> tuple:
    """``((q, k, v, items, scale, padded_q, padded_kv, kv_fill), dout)`` of the base call or a variant."""
    change = VARIANTS[variant] if variant else {}
    gen = torch.Generator().manual_seed(1)
    dtype = change.get("dtype", torch.float16)
    q, k, v, dout = (torch.randn(*shape, generator=gen).to(DEVICE, dtype) for shape in
                     ((4, 4, 64), (16, 2, 64), (16, 2, 64), (4, 4, 64)))
    q, k, v = (change.get(name, lambda x: x)(x).requires_grad_() for name, x in (("q", q), ("k", k), ("v", v)))
    items = torch.tensor(change.get("items", _BASE_ITEMS), dtype=torch.int32, device=DEVICE)
    opts = (change.get("scale", 0.125), change.get("padded_q", False), change.get("padded_kv", False),
            change.get("kv_fill", 0))
    return (q, k, v, items, *opts), dout


def forward_backward(fn, args, dout) -> tuple:
    out, lse = fn(*args)
    loss = (out.float() * dout.float()).sum() + 0.5 * torch.nan_to_num(lse, neginf=0.0).sum()
    return (out, lse, *torch.autograd.grad(loss, args[:3]))


def assert_equal(got: tuple, want: tuple) -> None:
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_key_part_gets_its_own_plan(keyed_contract, variant):
    """After the base call's plan is cached (and used), a call differing in one part of the key alone gets
    bitwise the regular path's results, from its first call on: a key without that part would reuse the
    base plan (its strides, scale, item count, zero-filling or kv_fill; for the dtype, the compiled kernel of
    the other dtype, which `keyed_contract` catches). Fresh buffers are NaN (`Poison`), so rows a plan
    fails to write or zero show. (The device is a part too: one device here.)"""
    with Poison():
        args, dout = call_args()
        for _ in range(2):
            forward_backward(eager.small_seq_fwd_call, args, dout)
        args, dout = call_args(variant)
        got = [forward_backward(eager.small_seq_fwd_call, args, dout) for _ in range(2)]
        want = forward_backward(op._SmallSeqFwdEager.apply, args, dout)
    assert not any(torch.isnan(x).any() for x in want)  # the regular path writes or zeroes every row
    for g in got:
        assert_equal(g, want)
    assert len(eager._plans) == 2


def test_without_torch_internals(monkeypatch):
    """Where torch lacks the private functions of the fast apply, `eager._internals` falls back and calls go
    through the public ``_Eager.apply``, with the same results."""
    monkeypatch.delattr(torch._C._functorch, "unwrap_if_dead")
    apply_raw, unwrap, functorch_active = eager._internals()
    assert apply_raw is None and unwrap is None and functorch_active() is False
    args, dout = call_args("padded_kv")
    want = forward_backward(op._SmallSeqFwdEager.apply, args, dout)
    calls = []
    public = eager._Eager.apply
    monkeypatch.setattr(eager, "_eager_apply", None)
    monkeypatch.setattr(eager, "_unwrap_if_dead", None)
    monkeypatch.setattr(eager, "_functorch_active", functorch_active)
    monkeypatch.setattr(eager._Eager, "apply", lambda *a: calls.append(1) or public(*a))
    for _ in range(2):
        assert_equal(forward_backward(eager.small_seq_fwd_call, args, dout), want)
    assert len(calls) == 2 and len(eager._plans) == 1


def test_plan_rejects_a_tensor_after_its_tensor_arguments():
    """A launch whose arguments hold a tensor past the first ``tensors`` (a new tensor argument the plan's
    layout does not know) cannot become a plan: it would be frozen into every later launch."""
    t = torch.zeros(2)

    def kernel():
        pass

    eager._Launch((kernel, (1,), (t, t, 3, 0.5), {}), 2, {})
    with pytest.raises(RuntimeError, match="other than its first 2 arguments"):
        eager._Launch((kernel, (1,), (t, t, t, 0.5), {}), 2, {})
    with pytest.raises(RuntimeError, match="other than its first 3 arguments"):
        eager._Launch((kernel, (1,), (t, t, 3, 0.5), {}), 3, {})


def test_torch_func_transforms_raise():
    seqs, q, k, v, _ = make_inputs([4, 3, 1], heads=(2, 1))
    k, v = k.detach(), v.detach()

    def f(q):
        return packattn.attention(q, k, v, seqs, backend="small_seq").sum()

    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(f)(q.detach())


@pytest.mark.parametrize("path", ["plan", "regular"])
def test_double_backward_raises(path):
    """The kernels' gradients are not differentiable: a backward through gradients taken with
    create_graph=True raises (rather than silently dropping the second-order terms)."""
    seqs, q, k, v, _ = make_inputs([4, 3, 1], heads=(2, 1))
    if path == "plan":
        out = packattn.attention(q, k, v, seqs, backend="small_seq")
    else:
        out, _ = op._SmallSeqFwdEager.apply(q, k, v, op.item_table(seqs), q.shape[-1] ** -0.5, False, False, 0)
    (dq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    assert len(eager._plans) == (path == "plan")
    with pytest.raises(RuntimeError, match="once_differentiable"):
        ((dq**2).sum() + (out**2).sum()).backward()
