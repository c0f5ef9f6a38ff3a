"""`packattn.nn.PackedAttention`: the torchtitan-style inner attention. Layouts, descriptors, errors,
and DTensor (tensor-parallel) inputs on CPU (gloo, world size 1; a fake process group of world
size 2 for real head shards). Reference backend, float32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import packattn
from packattn import Tree, Varlen
from packattn.nn import PackedAttention
from packattn.nn import attention as nn_attention

HEADS_Q, HEADS_KV, DIM = 4, 2, 8


def qkv(*lead, seed=0, heads=(HEADS_Q, HEADS_KV), grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(*lead, heads[0], DIM), (*lead, heads[1], DIM), (*lead, heads[1], DIM)]
    return [torch.randn(s, generator=g).requires_grad_(grad) for s in shapes]


def build(**config):
    return PackedAttention.Config(backend="reference", **config).build()


def test_config_builds_the_module_with_its_options():
    cfg = PackedAttention.Config(backend="reference", causal="top_left", window=(3, 0), chunk_size=4,
                                 deterministic=True)
    module = cfg.build()
    assert isinstance(module, PackedAttention) and module.config is cfg
    assert "backend=reference" in repr(module) and "deterministic" in repr(module)
    assert PackedAttention().config == PackedAttention.Config()  # defaults: auto, causal
    with pytest.raises(ValueError, match="causal"):
        PackedAttention.Config(causal="upside_down").build()


@pytest.mark.parametrize("options", [dict(), dict(causal=False), dict(causal="top_left", window=(2, 0)),
                                     dict(chunk_size=3)])
def test_dense_bshd_equals_attention(options):
    q, k, v = qkv(2, 7)
    got = build(**options)(q, k, v, enable_gqa=True, scale=0.3)
    want = packattn.attention(q, k, v, layout="bshd", backend="reference", scale=0.3,
                              **{"causal": True, **options})
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_packed_thd_and_torchtitan_shaped_with_varlen():
    seqs = Varlen.from_lengths([3, 0, 9, 4])
    q, k, v = qkv(16)
    module = build()
    got = module(q, k, v, attention_masks=seqs, enable_gqa=True)
    torch.testing.assert_close(got, packattn.attention(q, k, v, seqs, causal=True, backend="reference"))
    # (batch, seq, heads, dim) with a descriptor of batch * seq rows: flattened, then shaped back
    q4, k4, v4 = (t.view(2, 8, t.shape[1], DIM) for t in (q, k, v))
    got4 = module(q4, k4, v4, attention_masks=seqs, enable_gqa=True)
    assert got4.shape == q4.shape
    torch.testing.assert_close(got4.reshape(16, HEADS_Q, DIM), got, rtol=0, atol=0)


def test_tree_descriptor_matches_each_sequence_alone():
    tree = Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5], [7]])
    q, k, v = qkv(tree.total, grad=True)
    out = build()(q, k, v, attention_masks=tree, enable_gqa=True)
    expanded = packattn.attention(*(tree.gather(t) for t in (q, k, v)), tree.unpacked, causal=True,
                                  backend="reference")
    torch.testing.assert_close(tree.gather(out), expanded)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_errors_name_the_problem():
    module = build()
    seqs = Varlen.from_lengths([3, 5])
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match="needs its descriptor as attention_masks"):
        module(q, k, v, enable_gqa=True)
    with pytest.raises(TypeError, match="attention_masks must be a packattn.Varlen"):
        module(q, k, v, attention_masks=torch.ones(8, 8, dtype=torch.bool), enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        module(q, k, v, attention_masks=seqs)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['dropout_p'\\]"):
        module(q, k, v, attention_masks=seqs, enable_gqa=True, dropout_p=0.1)
    module(q, k, v, attention_masks=seqs, enable_gqa=True, block_mask=None)  # None extras are fine
    with pytest.raises(ValueError, match="total_q=8"):
        module(q[:7], k[:7], v[:7], attention_masks=seqs, enable_gqa=True)
    # torchtitan-shaped but transposed the SDPA way: (batch, heads, seq, dim)
    q4, k4, v4 = qkv(1, 8, heads=(4, 4))
    with pytest.raises(ValueError, match=r"looks like \(batch, heads, seq, dim\)"):
        module(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), attention_masks=seqs)
    with pytest.raises(ValueError, match="with a Varlen descriptor"):
        module(q4[0, 0], k4[0, 0], v4[0, 0], attention_masks=seqs)  # 2-D


# ------------------------------------------------------------------------------ tensor parallelism
@pytest.fixture
def mesh_world_1():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["local_map", "to_local"])
@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_dtensor_heads_sharded_world_1(mesh_world_1, monkeypatch, path, layout):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if path == "to_local":
        monkeypatch.setattr(nn_attention, "_local_map", lambda: None)  # a torch without local_map
    seqs = Varlen.from_lengths([5, 3]) if layout == "thd" else None
    q, k, v = qkv(8) if layout == "thd" else qkv(2, 4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    module = build()
    want = module(q, k, v, attention_masks=seqs, enable_gqa=True)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for placement in (Shard(q.dim() - 2), Replicate()):
        dq, dk, dv = (DTensor.from_local(t, mesh_world_1, [placement]) for t in (q, k, v))
        out = module(dq, dk, dv, attention_masks=seqs, enable_gqa=True)
        assert isinstance(out, DTensor) and tuple(out.placements) == (placement,)
        torch.testing.assert_close(out.to_local(), want, rtol=0, atol=0)
        grads = torch.autograd.grad(out.to_local().sum(), (q, k, v))
        for got, ref in zip(grads, want_grads):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_dtensor_bad_placements_are_refused(mesh_world_1):
    from torch.distributed.tensor import DTensor, Shard

    seqs = Varlen.from_lengths([5, 3])
    q, k, v = qkv(8)
    module = build()
    by_rows = [DTensor.from_local(t, mesh_world_1, [Shard(0)]) for t in (q, k, v)]
    with pytest.raises(ValueError, match="context parallelism"):
        module(*by_rows, attention_masks=seqs, enable_gqa=True)
    by_heads = DTensor.from_local(q, mesh_world_1, [Shard(1)])
    with pytest.raises(TypeError, match="q is a DTensor but k is a Tensor"):
        module(by_heads, k, v, attention_masks=seqs, enable_gqa=True)


@pytest.mark.timeout(60)
def test_dtensor_two_head_shards_with_a_fake_process_group():
    """World size 2 in one process (torch's fake process group, no collectives run): rank 0 holds
    the first half of the q and kv heads and must get the first half of the full result."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        seqs = Varlen.from_lengths([6, 1, 4])
        q, k, v = qkv(11, heads=(8, 2))
        module = build()
        want = module(q, k, v, attention_masks=seqs, enable_gqa=True)
        shards = [DTensor.from_local(t[:, : t.shape[1] // 2], mesh, [Shard(1)]) for t in (q, k, v)]
        out = module(*shards, attention_masks=seqs, enable_gqa=True)
        assert out.shape == want.shape and out.to_local().shape == (11, 4, DIM)
        torch.testing.assert_close(out.to_local(), want[:, :4])  # fewer heads per einsum: rounding
        odd = [DTensor.from_local(t, mesh, [Shard(1)], shape=(11, 5, DIM), stride=(5 * DIM, DIM, 1))
               for t in qkv(11, heads=(3, 3))]
        with pytest.raises(ValueError, match="multiples of the 2 head shards"):
            module(*odd, attention_masks=seqs)
    finally:
        dist.destroy_process_group()
