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
from packattn.lengths import SHORT_SEQLEN
from packattn.ops.runtime.launch import mask_options
from packattn.ops.varlen import configs, op
from packattn.ops.varlen.tiles import build_tile_table
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
    assert backend.unsupported(_params("cuda", head_dim_v=64)) is None  # MLA: the portable Triton kernels
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
    fwd, dkdv = (configs.launch_config(name, 32, q.dtype, q.device) for name in ("fwd", "dkdv"))
    q_tiles = build_tile_table(seqs, mask, False, fwd.block_m, fwd.block_n)
    key_tiles = build_tile_table(seqs, mask, True, dkdv.block_n, dkdv.block_m)
    tables = [seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.cu_seqlens_q, seqs.cu_seqlens_kv, q_tiles, q_tiles, key_tiles]
    args = (q, k, v, tables, None, None, 0.2, [*mask_options(mask), 0, 0, 0, 0, 0])
    torch.library.opcheck(torch.ops.packattn.varlen_fwd.default, args)
    out, lse = torch.ops.packattn.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.packattn.varlen_bwd.default,
                          (dout, None, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                           [*tables[:4], q_tiles, key_tiles], None, None, 0.2, [*mask_options(mask), 0, 0, 0]),
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
    captured = {}

    def fake_call(custom_op, eager, q, k, v, tables, pad_q, pad_kv, scale, options):
        captured.update(zip(op.FWD_OPTIONS, options))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(op.fast_op, "call", fake_call)
    seqs, q, k, v, _ = make_inputs([length, 7])
    packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    assert captured["short_seqs"] == short
    assert SHORT_SEQLEN == 512
    short_dq, dq = configs.dq_config(128, True), configs.dq_config(128)
    assert short_dq != dq and short_dq == configs.DQ_SHORT_CONFIGS[128]
    # the 64 x 64 short forward only on the GPUs it was measured faster on (SHORT_CONFIG_GPUS)
    monkeypatch.setattr(configs, "_short_config_gpu", lambda index: True)
    assert configs.config_for(128, short_seqs=True) == configs.SHORT_CONFIGS[128]
    # a head dim SHORT_CONFIGS lacks takes its SHORT_DEFAULT_CONFIGS entry on every GPU, else CONFIGS
    assert configs.config_for(256, short_seqs=True) == configs.SHORT_DEFAULT_CONFIGS[256] != configs.CONFIGS[256]
    assert configs.config_for(64, short_seqs=True) == configs.CONFIGS[64]  # no mask: in neither short table
    # under a mask, d = 64 / 96 take SHORT_MASKED_CONFIGS (short batches only)
    for d in (64, 96):
        masked_short = configs.config_for(d, short_seqs=True, masked=True)
        assert masked_short == configs.SHORT_MASKED_CONFIGS[d] != configs.CONFIGS[d]
        assert configs.config_for(d, masked=True) == configs.config_for(d, long_seqs=True, masked=True) \
            == configs.CONFIGS[d]
    assert configs.config_for(256, short_seqs=True, masked=True) == configs.SHORT_DEFAULT_CONFIGS[256]
    assert configs.config_for((192, 128), short_seqs=True) == configs.CONFIGS[(192, 128)]
    # elsewhere (the H100) 128-row tiles over 64-key blocks, trimmed; long batches keep CONFIGS
    monkeypatch.setattr(configs, "_short_config_gpu", lambda index: False)
    trimmed = configs.SHORT_DEFAULT_CONFIGS[128]
    assert trimmed.trim and (trimmed.block_m, trimmed.block_n) == (128, 64)
    assert configs.config_for(128, short_seqs=True) == trimmed
    assert configs.config_for(128, short_seqs=True, device=torch.device("cuda", 3)) == trimmed
    assert configs.config_for(128) == configs.CONFIGS[128]
    assert configs.config_for(192, short_seqs=True) == configs.SHORT_DEFAULT_CONFIGS[192]
    assert configs.config_for(192) == configs.CONFIGS[192]
    assert configs.config_for(64, short_seqs=True) == configs.CONFIGS[64]


def test_short_config_gpus_by_name(monkeypatch):
    configs._short_config_gpu.cache_clear()
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    try:
        assert configs._short_config_gpu(0) and not configs._short_config_gpu(1)
        assert not configs._short_config_gpu(-1)  # no CUDA device
    finally:
        configs._short_config_gpu.cache_clear()



def test_override_replaces_tables_and_restores_them():
    """`configs.override`: forced configs and replaced thresholds while the block runs, the tables after it;
    an unknown name or a config no kernel takes is refused (and leaves the tables as they were)."""
    forced = configs.GluonConfig(64, 64, 3, 4)
    before = (configs.config_for(128), configs.GLUON_MIN_SEQLEN, configs.heads_per_section(8, 1))
    with configs.override(fwd=forced, GLUON_MIN_SEQLEN=512, HEAD_SECTION=4):
        assert configs.config_for(128) == configs.config_for(64, long_seqs=True) == forced
        assert configs.GLUON_MIN_SEQLEN == 512 and configs.heads_per_section(8, 1) == 4
    assert (configs.config_for(128), configs.GLUON_MIN_SEQLEN, configs.heads_per_section(8, 1)) == before
    with configs.override(dq=configs.GluonBwdConfig(64, 64, 2, 4), DKDV_CONFIGS={}):
        assert configs.dq_config(128) == configs.GluonBwdConfig(64, 64, 2, 4)
        assert configs.dkdv_config(128) is None
    assert configs.dkdv_config(128) == configs.DKDV_CONFIGS[128]
    with pytest.raises(ValueError, match="no table or threshold"):
        with configs.override(GLUON_MIN_SEQ=1):
            pass
    with pytest.raises(ValueError, match="dK/dV kernel"):
        with configs.override(dkdv=configs.GluonBwdConfig(64, 96, 2, 4)):
            pass
    assert configs.FORCE_DKDV is None


def test_gluon_backward_at_head_dim_64(monkeypatch):
    """At d = 64 both backward passes are the Gluon ones: the one-consumer dK/dV (64 x 64, 2 stages, whatever the
    GQA group) and the two-consumer dQ over 128-key steps (short batches too), which computes delta (no
    preprocess)."""
    assert configs.dkdv_config(64) == configs.dkdv_config(64, group=8) == configs.GluonBwdConfig(64, 64, 2, 4)
    assert configs.dkdv_config(128, group=8) == configs.DKDV_GQA_CONFIGS[128] != configs.dkdv_config(128)
    assert configs.dq_config(64) == configs.dq_config(64, short_seqs=True) == configs.GluonBwdConfig(128, 128, 2, 8)
    monkeypatch.setattr(op, "sm90_runs", lambda q, k, v, tma, head_dims, dtypes: True)
    q = torch.zeros(8, 8, 64, dtype=torch.bfloat16)
    plan = op.bwd_plan(q, q[:, :1], q[:, :1])
    assert (plan.dkdv, plan.dq) == (configs.dkdv_config(64), configs.dq_config(64))
    assert op.fuses_delta(plan, None) and not op.fuses_delta(plan, torch.zeros(8, 8))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_forward_plan_takes_the_mask_into_the_gluon_config(monkeypatch, head_dim):
    """The forward's tile table is built with the blocks of the config its launch takes (`op.gluon_fwd_config`):
    short batches under a mask at d = 64 / 96 take `SHORT_MASKED_CONFIGS`, with no mask `CONFIGS` (the Gluon
    gating forced on, CPU tensors; nothing is launched)."""
    from packattn.varlen import Varlen

    monkeypatch.setattr(op, "sm90_runs", lambda *args: True)
    seqs = Varlen.from_lengths([300, 160, 384, 1])
    q = torch.zeros(seqs.total_q, 4, head_dim, dtype=torch.bfloat16)
    kv = torch.zeros(seqs.total_kv, 2, head_dim, dtype=torch.bfloat16)
    for mask, masked in ((Mask.make(causal=True), True), (Mask.make(window=(64, 0)), True), (Mask.make(), False)):
        tables, options = op.forward_plan(q, kv, kv, seqs, mask, False)
        assert options[op.FWD_OPTIONS.index("gluon")] and options[op.FWD_OPTIONS.index("short_seqs")]
        cfg = op.gluon_fwd_config(q, kv, mask, False, True)
        if head_dim in configs.SHORT_DEFAULT_CONFIGS:
            want = configs.SHORT_DEFAULT_CONFIGS[head_dim]
        else:
            want = configs.SHORT_MASKED_CONFIGS[head_dim] if masked else configs.CONFIGS[head_dim]
        assert cfg == want
        assert torch.equal(tables[4], build_tile_table(seqs, mask, False, cfg.block_m, cfg.block_n))
    assert configs.SHORT_MASKED_CONFIGS[64].block_m != configs.CONFIGS[64].block_m  # the tables differ there
