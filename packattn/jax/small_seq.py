"""Small-seq attention in JAX: one query per item over at most 16 keys (tiny cross-attention).

    out[b, h] = softmax(scale * q[b, h] . k[b, :n_b, h // G]) @ v[b, :n_b, h // G],  n_b = kv_seq_lengths[b]

with G = Hq // Hkv (GQA / MQA). The softmax is in float32, `out` has q's dtype, and an item with
no keys gives zeros (and zero gradients), never NaN. Lengths outside 0..S are clamped to it.

Three ways to compute it, one set of semantics:
  * `small_seq_attention_reference`: plain jax.numpy, differentiated by JAX's autodiff;
  * implementation "xla": jax.numpy forward and backward inside a `jax.custom_vjp` that saves P;
  * implementation "pallas": the same custom_vjp with a Pallas kernel for the forward (writes out
    and P) and one for the backward. On GPU Pallas lowers to Triton; elsewhere it runs in Pallas'
    interpreter, so the kernels are tested on CPU.

Sharding: both paths are batch-parallel. The "xla" path is jax.numpy, which XLA's SPMD partitioner
keeps sharded on the batch axis. The Pallas calls are wrapped in `custom_partitioning`, which runs
the kernel on each device's batch shard (any other axis is replicated), and in `custom_vmap`, which
folds a vmapped axis into the batch axis (custom_partitioning has no batching rule of its own).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

MAX_KV_LEN = 16
IMPLEMENTATIONS = ("xla", "pallas")
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- public functions


def small_seq_attention_reference(q, k, v, kv_seq_lengths, *, scale=None):
    """Plain jax.numpy small-seq attention; differentiable by JAX autodiff. Same arguments as
    `small_seq_attention`."""
    q, k, v, lengths, scale = _validate(q, k, v, kv_seq_lengths, scale)
    group = q.shape[1] // k.shape[2]
    k_per_q_head = jnp.repeat(k.astype(_F32), group, axis=2)  # (B, S, Hq, D)
    v_per_q_head = jnp.repeat(v.astype(_F32), group, axis=2)
    scores = jnp.einsum("bhd,bshd->bhs", q.astype(_F32), k_per_q_head, precision=_HIGHEST) * scale
    valid = (jnp.arange(k.shape[1]) < lengths[:, None])[:, None, :]  # (B, 1, S)
    scores = jnp.where(valid, scores, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - row_max), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bhs,bshd->bhd", probs, v_per_q_head, precision=_HIGHEST)
    return out.astype(q.dtype)


def small_seq_attention(q, k, v, kv_seq_lengths, *, scale=None, implementation=None):
    """Attention of one query per item over its first `kv_seq_lengths[b]` keys.

    q: (B, Hq, D); k, v: (B, S, Hkv, D) with 1 <= S <= 16 and Hq % Hkv == 0; kv_seq_lengths: (B,)
    integer (int32). scale: a Python float, default 1/sqrt(D). implementation: None (auto: "pallas"
    on GPU, "xla" otherwise), "xla" or "pallas" (Pallas' interpreter when not on GPU).
    Returns (B, Hq, D) in q's dtype. Differentiable in q, k, v (a custom VJP that saves P);
    safe under jit, vmap and grad; runs per shard when the inputs are sharded on the batch axis.
    """
    q, k, v, lengths, scale = _validate(q, k, v, kv_seq_lengths, scale)
    mode = _select_mode(implementation)
    if q.shape[0] == 0:
        mode = "xla"
    return _attention(q, k, v, lengths, scale, mode)


# ----------------------------------------------------------------------------- validation


def _validate(q, k, v, kv_seq_lengths, scale):
    q, k, v, lengths = (jnp.asarray(x) for x in (q, k, v, kv_seq_lengths))
    if q.ndim != 3:
        raise ValueError(f"q must be (batch, heads_q, head_dim), got shape {q.shape}")
    if k.ndim != 4:
        raise ValueError(f"k must be (batch, kv_len, heads_kv, head_dim), got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
    batch, heads_q, head_dim = q.shape
    _, kv_len, heads_kv, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, k and v have {k.shape[3]}")
    if not 1 <= kv_len <= MAX_KV_LEN:
        raise ValueError(f"kv length S = k.shape[1] must be in 1..{MAX_KV_LEN}, got {kv_len}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"kv_seq_lengths must have shape ({batch},), got {lengths.shape}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"kv_seq_lengths must be an integer array (int32), got {lengths.dtype}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    try:
        scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"scale must be a Python float (static), got {scale!r}") from None
    return q, k, v, lengths.astype(jnp.int32), scale


def _select_mode(implementation):
    on_gpu = jax.default_backend() == "gpu"
    if implementation is None:
        implementation = "pallas" if on_gpu else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "pallas" and not on_gpu:
        return "pallas_interpret"
    return implementation


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, lengths, scale, mode):
    return _attention_fwd(q, k, v, lengths, scale, mode)[0]


def _attention_fwd(q, k, v, lengths, scale, mode):
    if mode == "xla":
        out, probs = _xla_forward(q, k, v, lengths, scale=scale)
    else:
        out, probs = _pallas_op("forward", scale, mode == "pallas_interpret")(q, k, v, lengths)
    return out, (q, k, v, probs)


def _attention_bwd(scale, mode, residuals, d_out):
    q, k, v, probs = residuals
    if mode == "xla":
        dq, dk, dv = _xla_backward(q, k, v, probs, d_out, scale=scale)
    else:
        dq, dk, dv = _pallas_op("backward", scale, mode == "pallas_interpret")(q, k, v, probs, d_out)
    return dq, dk, dv, None  # no cotangent for the integer lengths


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- "xla": jax.numpy


def _by_kv_head(x, heads_kv):
    """(B, Hq, X) -> (B, Hkv, G, X)."""
    return x.reshape(x.shape[0], heads_kv, x.shape[1] // heads_kv, x.shape[2])


def _xla_forward(q, k, v, lengths, *, scale):
    """-> out (B, Hq, D) in q's dtype, P (B, Hq, S) float32."""
    batch, heads_q, _ = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    q_by_kv_head = _by_kv_head(q, heads_kv).astype(_F32)
    scores = scale * jnp.einsum("bkgd,bskd->bkgs", q_by_kv_head, k.astype(_F32), precision=_HIGHEST)
    valid = (jnp.arange(kv_len) < lengths[:, None])[:, None, None, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(row_max == -jnp.inf, 0.0, row_max))  # masked -> exp(-inf) = 0
    probs = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1.0)  # the sum is 0 or >= 1
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v.astype(_F32), precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype), probs.reshape(batch, heads_q, kv_len)


def _xla_backward(q, k, v, probs, d_out, *, scale):
    heads_kv = k.shape[2]
    probs = _by_kv_head(probs, heads_kv)
    d_out32 = _by_kv_head(d_out, heads_kv).astype(_F32)
    dv = jnp.einsum("bkgs,bkgd->bskd", probs, d_out32, precision=_HIGHEST)
    dp = jnp.einsum("bkgd,bskd->bkgs", d_out32, v.astype(_F32), precision=_HIGHEST)
    ds = probs * (dp - jnp.sum(probs * dp, axis=-1, keepdims=True))
    dq = scale * jnp.einsum("bkgs,bskd->bkgd", ds, k.astype(_F32), precision=_HIGHEST)
    dk = scale * jnp.einsum("bkgs,bkgd->bskd", ds, _by_kv_head(q, heads_kv).astype(_F32), precision=_HIGHEST)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- "pallas": kernels
# One program per (item, kv head): it loads that head's K and V once and loops over the G query
# heads of its group, so dK and dV need no cross-program reduction. Triton wants power-of-two
# blocks: G, S and D are padded to powers of two outside the kernel (only when they are not).


def _fwd_kernel(q_ref, k_ref, v_ref, valid_ref, o_ref, p_ref, *, scale, group):
    k = k_ref[...].astype(_F32)  # (Sp, Dp)
    v = v_ref[...].astype(_F32)
    valid = valid_ref[...] > 0  # (Sp,)

    def one_query_head(g, carry):
        q = q_ref[g, :].astype(_F32)  # (Dp,)
        scores = jnp.where(valid, scale * jnp.sum(k * q[None, :], axis=1), -jnp.inf)
        row_max = jnp.max(scores)
        weights = jnp.where(valid, jnp.exp(scores - jnp.where(row_max == -jnp.inf, 0.0, row_max)), 0.0)
        probs = weights / jnp.maximum(jnp.sum(weights), 1.0)  # the sum is 0 (no keys) or >= 1
        o_ref[g, :] = jnp.sum(probs[:, None] * v, axis=0).astype(o_ref.dtype)
        p_ref[g, :] = probs
        return carry

    jax.lax.fori_loop(0, group, one_query_head, 0)


def _bwd_kernel(q_ref, k_ref, v_ref, p_ref, do_ref, dq_ref, dk_ref, dv_ref, *, scale, group):
    k = k_ref[...].astype(_F32)  # (Sp, Dp)
    v = v_ref[...].astype(_F32)

    def one_query_head(g, carry):
        dk, dv = carry
        q = q_ref[g, :].astype(_F32)  # (Dp,)
        d_out = do_ref[g, :].astype(_F32)
        probs = p_ref[g, :]  # (Sp,)
        dv = dv + probs[:, None] * d_out[None, :]
        dp = jnp.sum(v * d_out[None, :], axis=1)
        ds = probs * (dp - jnp.sum(probs * dp))
        dq_ref[g, :] = (scale * jnp.sum(ds[:, None] * k, axis=0)).astype(dq_ref.dtype)
        return dk + ds[:, None] * q[None, :], dv

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = jax.lax.fori_loop(0, group, one_query_head, (zeros, zeros))
    dk_ref[...] = (scale * dk).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _pad_to(x, sizes):
    """Zero-pad x at the end of the axes in `sizes` ({axis: size}); no copy when nothing to pad."""
    pads = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, pads) if any(hi for _, hi in pads) else x


def _call_kernel(kernel, args, in_blocks, out_shapes, out_blocks, heads_kv, interpret):
    def block_elements(block):
        return math.prod(n for n in block[0] if n is not None)

    def spec(block):
        shape, index_map = block
        return pl.BlockSpec(shape, index_map)

    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        tile = block_elements(in_blocks[1])  # one K tile: (Sp, Dp)
        params["compiler_params"] = pltriton.CompilerParams(num_warps=4 if tile <= 4096 else 8)
    return pl.pallas_call(
        kernel,
        grid=(args[0].shape[0], heads_kv),
        in_specs=[spec(b) for b in in_blocks],
        out_specs=[spec(b) for b in out_blocks],
        out_shape=out_shapes,
        interpret=interpret,
        **params,
    )(*args)


def _blocks(g_pad, s_pad, d_pad):
    """Block (shape, index map) per layout, for grid (item b, kv head h); None squeezes an axis."""
    return {
        "by_group": ((None, None, g_pad, d_pad), lambda b, h: (b, h, 0, 0)),  # (B, Hkv, Gp, Dp)
        "probs": ((None, None, g_pad, s_pad), lambda b, h: (b, h, 0, 0)),  # (B, Hkv, Gp, Sp)
        "kv": ((None, s_pad, None, d_pad), lambda b, h: (b, 0, h, 0)),  # (B, Sp, Hkv, Dp)
        "valid": ((None, s_pad), lambda b, h: (b, 0)),  # (B, Sp)
    }


def _pallas_forward(q, k, v, lengths, *, scale, interpret):
    batch, heads_q, head_dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    g_pad, s_pad, d_pad = _pow2(group), _pow2(kv_len), _pow2(head_dim)
    q4 = _pad_to(_by_kv_head(q, heads_kv), {2: g_pad, 3: d_pad})
    k_pad, v_pad = (_pad_to(x, {1: s_pad, 3: d_pad}) for x in (k, v))
    valid = (jnp.arange(s_pad) < jnp.minimum(lengths, kv_len)[:, None]).astype(jnp.int32)
    blocks = _blocks(g_pad, s_pad, d_pad)
    out4, probs4 = _call_kernel(
        functools.partial(_fwd_kernel, scale=scale, group=group),
        (q4, k_pad, v_pad, valid),
        [blocks["by_group"], blocks["kv"], blocks["kv"], blocks["valid"]],
        [jax.ShapeDtypeStruct(q4.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads_kv, g_pad, s_pad), _F32)],
        [blocks["by_group"], blocks["probs"]],
        heads_kv,
        interpret,
    )
    out = out4[:, :, :group, :head_dim].reshape(q.shape)
    probs = probs4[:, :, :group, :kv_len].reshape(batch, heads_q, kv_len)
    return out, probs


def _pallas_backward(q, k, v, probs, d_out, *, scale, interpret):
    heads_q, head_dim = q.shape[1], q.shape[2]
    kv_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    g_pad, s_pad, d_pad = _pow2(group), _pow2(kv_len), _pow2(head_dim)
    q4, do4 = (_pad_to(_by_kv_head(x, heads_kv), {2: g_pad, 3: d_pad}) for x in (q, d_out))
    probs4 = _pad_to(_by_kv_head(probs, heads_kv), {2: g_pad, 3: s_pad})
    k_pad, v_pad = (_pad_to(x, {1: s_pad, 3: d_pad}) for x in (k, v))
    blocks = _blocks(g_pad, s_pad, d_pad)
    dq4, dk, dv = _call_kernel(
        functools.partial(_bwd_kernel, scale=scale, group=group),
        (q4, k_pad, v_pad, probs4, do4),
        [blocks["by_group"], blocks["kv"], blocks["kv"], blocks["probs"], blocks["by_group"]],
        [jax.ShapeDtypeStruct(x.shape, y.dtype) for x, y in ((q4, q), (k_pad, k), (v_pad, v))],
        [blocks["by_group"], blocks["kv"], blocks["kv"]],
        heads_kv,
        interpret,
    )
    dq = dq4[:, :, :group, :head_dim].reshape(q.shape)
    return dq, dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim]


# ----------------------------------------------------------------------------- batch parallelism
# Shardy sharding rules: only the batch factor b may stay sharded; every other factor is replicated.
_RULES = {
    "forward": (_pallas_forward, "b h d, b s k d, b s k d, b -> b h d, b h s"),
    "backward": (_pallas_backward, "b h d, b s k d, b s k d, b h s, b h d -> b h d, b s k d, b s k d"),
}


def _non_batch_factors(rule):
    """Every factor but b, in order of first appearance (Shardy wants them sorted so)."""
    names = rule.replace(",", " ").replace("->", " ").split()
    return tuple(n for n in dict.fromkeys(names) if n != "b")


def _batch_spec(arg_shapes):
    """The mesh axes of the first argument's batch dimension (None when not sharded)."""
    spec = arg_shapes[0].sharding.spec
    return spec[0] if len(spec) else None


def _batch_sharded(mesh, batch_axes, ndim):
    return NamedSharding(mesh, PartitionSpec(batch_axes, *([None] * (ndim - 1))))


def _infer_sharding(mesh, arg_shapes, result_shape):
    batch_axes = _batch_spec(arg_shapes)
    return tuple(_batch_sharded(mesh, batch_axes, len(r.shape)) for r in result_shape)


@functools.lru_cache(maxsize=None)
def _pallas_op(kind, scale, interpret):
    """The Pallas forward or backward as a batch-parallel op: per-shard under SPMD, vmap-able."""
    fn, rule = _RULES[kind]

    def local(*args):  # positional only: custom_partitioning cannot resolve a partial's keywords
        return fn(*args, scale=scale, interpret=interpret)

    def partition(mesh, arg_shapes, result_shape):
        batch_axes = _batch_spec(arg_shapes)
        arg_shardings = tuple(_batch_sharded(mesh, batch_axes, len(a.shape)) for a in arg_shapes)
        return mesh, local, _infer_sharding(mesh, arg_shapes, result_shape), arg_shardings

    partitioned = custom_partitioning(local)
    partitioned.def_partition(
        partition,
        infer_sharding_from_operands=_infer_sharding,
        sharding_rule=rule,
        need_replication_factors=_non_batch_factors(rule),
    )
    op = custom_vmap(lambda *args: partitioned(*args))

    @op.def_vmap
    def fold_vmapped_axis_into_batch(axis_size, in_batched, *args):
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(args, in_batched)]
        outs = op(*(x.reshape(-1, *x.shape[2:]) for x in args))
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return op
