"""packattn.jax.small_seq_attention: reference vs "xla" vs "pallas" (Pallas' interpreter on CPU), each
held to a float64 brute-force PyTorch loop on the same numbers; gradients; jit / vmap / grad; empty
items; input validation; per-shard execution on 4 virtual CPU devices (subprocess)."""

import functools
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from packattn.jax import small_seq_attention, small_seq_attention_reference  # noqa: E402

IMPLS = ("xla", "pallas")
DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16)}

# (batch, heads_q, heads_kv, kv_len S, head_dim, lengths): lengths 0, 1 and S; MHA, GQA 4/2, MQA 4/1,
# a group of 3 and a head_dim of 80 (neither a power of two: padded inside the Pallas path).
CASES = [
    (3, 4, 4, 16, 64, [0, 1, 16]),
    (4, 4, 2, 16, 128, [16, 0, 7, 1]),
    (3, 4, 1, 5, 256, [5, 0, 2]),
    (2, 2, 1, 16, 512, [16, 9]),
    (2, 6, 2, 3, 80, [3, 1]),
]


def make_inputs(case, dtype=jnp.float32, seed=0):
    batch, heads_q, heads_kv, kv_len, head_dim, lengths = case
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, heads_q, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, kv_len, heads_kv, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, kv_len, heads_kv, head_dim)), dtype)
    return q, k, v, jnp.asarray(lengths, jnp.int32)


def to_f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def torch_oracle(q, k, v, lengths, scale=None, dtype=torch.float64):
    """Brute force, one (item, head) at a time, on the same numbers in `dtype` (float64: ground truth)."""
    q, k, v = (torch.tensor(to_f64(x), dtype=dtype) for x in (q, k, v))
    batch, heads_q, head_dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rows = []
    for b in range(batch):
        n = min(max(int(lengths[b]), 0), kv_len)
        for h in range(heads_q):
            kh = h // (heads_q // heads_kv)
            if n == 0:
                rows.append(torch.zeros(head_dim, dtype=dtype))
                continue
            probs = torch.softmax(scale * (k[b, :n, kh] @ q[b, h]), dim=0)
            rows.append(probs @ v[b, :n, kh])
    return torch.stack(rows).reshape(batch, heads_q, head_dim)


def check_close(result, q, k, v, lengths, scale=None):
    """flash-attn style: error vs float64 <= 2x a same-dtype PyTorch computation's error + small atol."""
    truth = torch_oracle(q, k, v, lengths, scale).numpy()
    if q.dtype == jnp.float32:
        np.testing.assert_allclose(to_f64(result), truth, atol=2e-5, rtol=1e-5)
        return
    same_dtype = torch_oracle(q, k, v, lengths, scale, dtype=torch.bfloat16).double().numpy()
    err, err_torch = np.abs(to_f64(result) - truth).max(), np.abs(same_dtype - truth).max()
    assert err <= 2 * err_torch + 1e-3, (err, err_torch)


def call(impl, q, k, v, lengths, scale=None):
    """Under jit (one compilation per shape instead of one per op: keeps the suite fast)."""
    return _jitted(impl, scale)(q, k, v, lengths)


@functools.lru_cache(maxsize=None)
def _jitted(impl, scale):
    if impl == "reference":
        return jax.jit(functools.partial(small_seq_attention_reference, scale=scale))
    return jax.jit(functools.partial(small_seq_attention, scale=scale, implementation=impl))


FORWARD = [(case, "float32") for case in CASES] + [(CASES[1], "bfloat16"), (CASES[3], "bfloat16")]


def case_id(x):
    return x if isinstance(x, str) else "B{}-H{}/{}-S{}-D{}".format(*x[:5])


@pytest.mark.parametrize("case, dtype", FORWARD, ids=case_id)
def test_forward_matches_torch_float64(case, dtype):
    q, k, v, lengths = make_inputs(case, DTYPES[dtype][0])
    results = {impl: call(impl, q, k, v, lengths) for impl in ("reference", *IMPLS)}
    for impl, out in results.items():
        assert out.dtype == q.dtype and out.shape == q.shape, impl
        check_close(out, q, k, v, lengths)
    # the two custom-VJP paths compute the same float32 math: they agree to rounding
    atol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(to_f64(results["pallas"]), to_f64(results["xla"]), atol=atol)


def test_scale_and_out_of_range_lengths():
    q, k, v, _ = make_inputs(CASES[1])
    lengths = jnp.asarray([20, -3, 16, 4], jnp.int32)  # clamped to 0..S
    for impl in ("reference", *IMPLS):
        check_close(call(impl, q, k, v, lengths, scale=0.3), q, k, v, np.asarray(lengths), scale=0.3)


def weighted_loss(fn, weights, lengths):
    return lambda q, k, v: jnp.sum(fn(q, k, v, lengths).astype(jnp.float32) * weights)


GRADIENTS = {
    "mha": (CASES[0], "float32"),
    "mqa": (CASES[2], "float32"),
    "group3": (CASES[4], "float32"),
    "gqa-bf16": (CASES[1], "bfloat16"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case, dtype", GRADIENTS.values(), ids=GRADIENTS)
def test_gradients_match_reference_autodiff(case, dtype, impl):
    q, k, v, lengths = make_inputs(case, DTYPES[dtype][0], seed=1)
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    ours = jax.jit(jax.grad(weighted_loss(lambda *a: call(impl, *a), weights, lengths), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(weighted_loss(small_seq_attention_reference, weights, lengths), argnums=(0, 1, 2)))(q, k, v)
    for name, x, g, w in zip("qkv", (q, k, v), ours, want):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        g, w = to_f64(g), to_f64(w)
        tol = 1e-4 if dtype == "float32" else 3e-2
        assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max()), name


def test_gradients_match_torch_float64():
    case = CASES[1]
    q, k, v, lengths = make_inputs(case, seed=3)
    weights = np.random.default_rng(4).standard_normal(q.shape)
    tq, tk, tv = (torch.tensor(to_f64(x), requires_grad=True) for x in (q, k, v))
    # the oracle on leaf tensors: rebuild it from the same loop so autograd reaches q, k, v
    loss = (torch_oracle_autograd(tq, tk, tv, np.asarray(lengths)) * torch.tensor(weights)).sum()
    loss.backward()
    for impl in IMPLS:
        loss = weighted_loss(lambda *a: call(impl, *a), jnp.asarray(weights, jnp.float32), lengths)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for g, t in zip(grads, (tq, tk, tv)):
            np.testing.assert_allclose(to_f64(g), t.grad.numpy(), atol=1e-4, rtol=1e-4)


def torch_oracle_autograd(q, k, v, lengths):
    batch, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    rows = []
    for b in range(batch):
        n = int(lengths[b])
        for h in range(heads_q):
            kh = h // (heads_q // heads_kv)
            if n == 0:
                rows.append(torch.zeros(head_dim, dtype=q.dtype))
            else:
                probs = torch.softmax((k[b, :n, kh] @ q[b, h]) / math.sqrt(head_dim), dim=0)
                rows.append(probs @ v[b, :n, kh])
    return torch.stack(rows).reshape(batch, heads_q, head_dim)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_grad(impl):
    case = CASES[1]
    q, k, v, lengths = make_inputs(case, seed=5)
    # (every call in this file runs under jax.jit: see `call`)
    # vmap over an extra leading axis, lengths batched too, then lengths shared
    stack = lambda x, n=3: jnp.stack([x * (1 + 0.2 * i) if x.dtype != jnp.int32 else (x + i) % 17 for i in range(n)])
    qs, ks, vs, ns = (stack(x) for x in (q, k, v, lengths))
    ours_fn = functools.partial(small_seq_attention, implementation=impl)
    batched = jax.jit(jax.vmap(ours_fn))(qs, ks, vs, ns)
    for i in range(3):
        np.testing.assert_allclose(batched[i], call("reference", qs[i], ks[i], vs[i], ns[i]), atol=1e-5)
    shared = jax.jit(jax.vmap(ours_fn, in_axes=(0, 0, 0, None)))(qs, ks, vs, lengths)
    np.testing.assert_allclose(shared[1], call("reference", qs[1], ks[1], vs[1], lengths), atol=1e-5)

    # grad under jit and vmap (per-example gradients)
    loss = lambda fn: (lambda q, k, v, n: jnp.sum(fn(q, k, v, n) ** 2))
    ours = jax.jit(jax.vmap(jax.grad(loss(ours_fn), argnums=(0, 1, 2))))(qs, ks, vs, ns)
    want = jax.jit(jax.vmap(jax.grad(loss(small_seq_attention_reference), argnums=(0, 1, 2))))(qs, ks, vs, ns)
    for g, w in zip(ours, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ("reference", *IMPLS))
def test_zero_length_items_give_zeros_and_zero_grads(impl, dtype):
    q, k, v, _ = make_inputs(CASES[2], DTYPES[dtype][0], seed=6)
    lengths = jnp.asarray([0, 3, 0], jnp.int32)
    out = call(impl, q, k, v, lengths)
    assert not np.isnan(to_f64(out)).any()
    assert (to_f64(out)[[0, 2]] == 0).all()
    loss = lambda q, k, v: jnp.sum(call(impl, q, k, v, lengths).astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
        g = to_f64(g)
        assert not np.isnan(g).any() and (g[[0, 2]] == 0).all()
    # keys past an item's length get no gradient either
    assert (to_f64(grads[1])[1, 3:] == 0).all() and (to_f64(grads[2])[1, 3:] == 0).all()


def test_default_implementation_and_scale():
    q, k, v, lengths = make_inputs(CASES[0])
    auto = "pallas" if jax.default_backend() == "gpu" else "xla"
    out = small_seq_attention(q, k, v, lengths)
    np.testing.assert_allclose(out, small_seq_attention(q, k, v, lengths, scale=1 / 8, implementation=auto), atol=0)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v, n: (q, k[:, :0], v[:, :0], n), ValueError, "kv length S"),
        (lambda q, k, v, n: (q, *[jnp.zeros((3, 17, 4, 64))] * 2, n), ValueError, r"1\.\.16, got 17"),
        (lambda q, k, v, n: (q, k[:, :, :3], v[:, :, :3], n), ValueError, r"heads_q \(4\) must be a multiple of heads_kv"),
        (lambda q, k, v, n: (q[..., :32], k, v, n), ValueError, "head_dim mismatch: q has 32"),
        (lambda q, k, v, n: (q, k, v[:, :8], n), ValueError, "v must have k's shape"),
        (lambda q, k, v, n: (q[0], k, v, n), ValueError, r"q must be \(batch, heads_q, head_dim\)"),
        (lambda q, k, v, n: (q, k, v, n[:2]), ValueError, r"kv_seq_lengths must have shape \(3,\)"),
        (lambda q, k, v, n: (q, k, v, n.astype(jnp.float32)), TypeError, "kv_seq_lengths must be an integer"),
        (lambda q, k, v, n: (q, k.astype(jnp.bfloat16), v, n), TypeError, "share one dtype"),
        (lambda q, k, v, n: (q.astype(jnp.int32), k, v, n), TypeError, "q must be a floating dtype"),
    ],
)
def test_validation_errors(change, error, match):
    args = change(*make_inputs(CASES[0]))
    for fn in (small_seq_attention, small_seq_attention_reference):
        with pytest.raises(error, match=match):
            fn(*args)


def test_bad_implementation_and_traced_scale():
    q, k, v, lengths = make_inputs(CASES[0])
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        small_seq_attention(q, k, v, lengths, implementation="cuda")
    with pytest.raises(TypeError, match="scale must be a Python float"):
        jax.jit(lambda s: small_seq_attention(q, k, v, lengths, scale=s))(0.5)


SUBPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import packattn

    report = {"packattn_imported_jax": "jax" in sys.modules}
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from packattn.jax import small_seq_attention, small_seq_attention_reference

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("b",))
    rng = np.random.default_rng(0)
    B, Hq, Hkv, S, D = 8, 4, 2, 16, 64
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    n = np.array([0, 1, 16, 5, 9, 16, 2, 0], np.int32)
    args = [jax.device_put(x, NamedSharding(mesh, P("b"))) for x in (q, k, v, n)]
    ref_loss = lambda q, k, v, n: jnp.sum(small_seq_attention_reference(q, k, v, n) ** 2)
    want = jax.jit(small_seq_attention_reference)(q, k, v, n)
    want_grads = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(q, k, v, n)
    collectives = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
    for impl in ("xla", "pallas"):
        loss = lambda q, k, v, n: jnp.sum(small_seq_attention(q, k, v, n, implementation=impl) ** 2)
        fwd = jax.jit(lambda *a: small_seq_attention(*a, implementation=impl)).lower(*args).compile()
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        out, grads = fwd(*args), bwd(*args)
        hlo = {"fwd": fwd.as_text(), "bwd": bwd.as_text()}
        report[impl] = {
            "err": float(jnp.abs(out - want).max()),
            "grad_err": max(float(jnp.abs(g - w).max()) for g, w in zip(grads, want_grads)),
            "out_spec": str(out.sharding.spec),
            "grad_specs": [str(g.sharding.spec) for g in grads],
            "collectives": {name: [c for c in collectives if c in text] for name, text in hlo.items()},
            "local_q_shape": "f32[2,4,64]" in hlo["fwd"],
        }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def subprocess_report():
    """One fresh interpreter with 4 virtual CPU devices: the import check and the sharding check."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_packattn_does_not_import_jax(subprocess_report):
    assert subprocess_report["packattn_imported_jax"] is False


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_sharded_jit_runs_per_shard_without_collectives(subprocess_report, impl):
    r = subprocess_report[impl]
    assert r["err"] < 1e-5 and r["grad_err"] < 1e-4, r
    assert r["out_spec"] == r["grad_specs"][0] == r["grad_specs"][1] == r["grad_specs"][2], r
    assert r["out_spec"] in ("P('b',)", "PartitionSpec('b',)"), r
    assert r["collectives"] == {"fwd": [], "bwd": []}, r
    assert r["local_q_shape"], "the compiled forward does not work on (2, 4, 64) shards"
