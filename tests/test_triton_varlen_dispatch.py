"""The triton backend's dispatch rules, its ``torch.library`` custom ops (opcheck, torch.compile, the
eager fast path of `packattn.ops.runtime.fast_op`) and its choice of short-sequence configs; on CPU in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) or on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn import dispatch
from packattn.backends import triton_varlen
from packattn.mask import Mask
from triton_varlen_harness import DEVICE, make_inputs, requires_triton

pytestmark = requires_triton


def _params(device_type="cpu", **overrides):
    fields = dict(device_type=device_type, dtype=torch.float16, heads_q=4, heads_kv=2, head_dim=128, head_dim_v=128,
                  kind="varlen", pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=17,
                  max_seqlen_kv=17, mask=Mask.make(causal=True), return_lse=False, deterministic=True,
                  requires_grad=True)
    fields.update(overrides)
    return dispatch.Params(**fields)


def test_supported_and_unsupported_params():
    backend = triton_varlen.TritonVarlenBackend()
    assert backend.unsupported(_params("cuda")) is None
    for head_dim in (32, 64, 96, 128, 192, 256):
        assert backend.unsupported(_params("cuda", head_dim=head_dim, head_dim_v=head_dim)) is None
    assert "head_dim" in backend.unsupported(_params("cuda", head_dim=80, head_dim_v=80))
    assert "equal" in backend.unsupported(_params("cuda", head_dim_v=64))
    assert "dtype" in backend.unsupported(_params("cuda", dtype=torch.float64))
    assert "tree" in backend.unsupported(_params("cuda", kind="tree"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch rule")
def test_cpu_auto_dispatch_skips_triton_but_explicit_request_runs_it():
    reasons = dict(dispatch.reasons(_params("cpu")))
    assert reasons["triton"] is not None and "backend='triton'" in reasons["triton"]
    assert dict(dispatch.reasons(_params("cpu"), "triton"))["triton"] is None
    seqs, q, k, v, _ = make_inputs([9, 4])
    assert dispatch.select(_params("cpu", dtype=torch.float32, head_dim=32, head_dim_v=32)).name != "triton"
    packattn.attention(q, k, v, seqs, backend="triton")


def test_custom_ops_opcheck():
    seqs, q, k, v, dout = make_inputs([9, 0, 20], [12, 3, 20], heads=(2, 1))
    mask = Mask.make(causal=True)
    fwd, dkdv = (triton_varlen.launch_config(name, 32, q.dtype, q.device) for name in ("fwd", "dkdv"))
    q_tiles = triton_varlen.build_tile_table(seqs, mask, False, fwd.block_m, fwd.block_n)
    key_tiles = triton_varlen.build_tile_table(seqs, mask, True, dkdv.block_n, dkdv.block_m)
    tables = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.cu_seqlens_q, seqs.cu_seqlens_kv, q_tiles, q_tiles, key_tiles]
    args = (q, k, v, tables, None, None, 0.2, [-1, 0, 0, 0, 0, 0, 0, 0, 0])
    torch.library.opcheck(torch.ops.packattn.varlen_fwd.default, args)
    out, lse = torch.ops.packattn.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.packattn.varlen_bwd.default,
                          (dout, None, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *tables[:4],
                           q_tiles, key_tiles, 0.2, -1, 0, 0, False, False, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_keeps_one_graph():
    seqs, q, k, v, dout = make_inputs([17, 30])

    def step(q, k, v):
        return packattn.attention(q, k, v, seqs, causal=True, backend="triton")

    eager = step(q, k, v)  # also fills the dispatch cache (a miss logs, which dynamo cannot trace)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    out = compiled(q, k, v)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for got, want in zip(grads, torch.autograd.grad(step(q, k, v), (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_eager_fast_path_equals_custom_op(monkeypatch):
    # eager calls skip the custom-op machinery (packattn.ops.runtime.fast_op); with the op forced the
    # kernels and their arguments are the same, so out, lse and every gradient are bitwise equal
    from packattn.ops.runtime import fast_op

    seqs, q, k, v, dout = make_inputs([9, 0, 20, 1], heads=(4, 2), pad=8)
    dlse = torch.randn(4, seqs.total_q, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    used = []

    def record(path):
        def call(op, eager, *args):
            used.append(path)
            return op(*args) if path == "op" else eager(*args)
        return call

    results = {}
    for path in ("eager", "op"):
        monkeypatch.setattr(fast_op, "call", record(path))
        out, lse = packattn.attention(q, k, v, seqs, causal=True, window=(5, 0), backend="triton", return_lse=True)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
        results[path] = (out, lse, *grads)
    assert used == ["eager", "op"]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["eager"], results["op"]):
        assert torch.equal(a, b), name


def test_fast_op_uses_the_op_for_tensor_subclasses_and_under_compile(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from packattn.ops.runtime import fast_op

    def op(*args):
        return "op"

    def eager(*args):
        return "eager"

    plain = torch.ones(2)
    assert fast_op.call(op, eager, plain, [plain], 1.0) == "eager"
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(plain)
        assert fast_op.call(op, eager, plain, [fake], 1.0) == "op"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fast_op.call(op, eager, plain) == "op"


@pytest.mark.parametrize("length,short", [(512, True), (513, False)])
def test_short_sequences_select_the_short_configs(monkeypatch, length, short):
    """No sequence longer than SHORT_SEQLEN: the forward op is told ``short_seqs`` (which picks the
    short-sequence Gluon forward and dQ configs on a GPU; the forward builds the dQ tile table for the
    config `dq_choice` names with ``short_seqs``)."""
    from packattn.ops.varlen import launch_sm90_bwd as triton_bwd_gluon
    from packattn.ops.varlen import launch_sm90_fwd as triton_fwd_gluon

    captured = {}

    def fake_call(op, eager, q, k, v, tables, pad_q, pad_kv, scale, options):
        captured.update(zip(triton_varlen.FWD_OPTIONS, options))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(triton_varlen.fast_op, "call", fake_call)
    seqs, q, k, v, _ = make_inputs([length, 7])
    packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    assert captured["short_seqs"] == short
    assert triton_varlen.SHORT_SEQLEN == 512
    short_dq, dq = triton_bwd_gluon.dq_config(128, True), triton_bwd_gluon.dq_config(128)
    assert short_dq != dq and short_dq == triton_bwd_gluon.DQ_SHORT_CONFIGS[128]
    # the 64 x 64 short forward only on the GPUs it was measured faster on (SHORT_CONFIG_GPUS)
    monkeypatch.setattr(triton_fwd_gluon, "_short_config_gpu", lambda index: True)
    assert triton_fwd_gluon.config_for(128, short_seqs=True) == triton_fwd_gluon.SHORT_CONFIGS[128]
    assert triton_fwd_gluon.config_for(64, short_seqs=True) == triton_fwd_gluon.CONFIGS[64]
    # elsewhere (the H100) 128-row tiles over 64-key blocks, trimmed; long batches keep CONFIGS
    monkeypatch.setattr(triton_fwd_gluon, "_short_config_gpu", lambda index: False)
    trimmed = triton_fwd_gluon.SHORT_TRIM_CONFIGS[128]
    assert trimmed.trim and (trimmed.block_m, trimmed.block_n) == (128, 64)
    assert triton_fwd_gluon.config_for(128, short_seqs=True) == trimmed
    assert triton_fwd_gluon.config_for(128, short_seqs=True, device=torch.device("cuda", 3)) == trimmed
    assert triton_fwd_gluon.config_for(128) == triton_fwd_gluon.CONFIGS[128]
    assert triton_fwd_gluon.config_for(64, short_seqs=True) == triton_fwd_gluon.CONFIGS[64]


def test_short_config_gpus_by_name(monkeypatch):
    from packattn.ops.varlen import launch_sm90_fwd as triton_fwd_gluon

    triton_fwd_gluon._short_config_gpu.cache_clear()
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    try:
        assert triton_fwd_gluon._short_config_gpu(0) and not triton_fwd_gluon._short_config_gpu(1)
        assert not triton_fwd_gluon._short_config_gpu(-1)  # no CUDA device
    finally:
        triton_fwd_gluon._short_config_gpu.cache_clear()

