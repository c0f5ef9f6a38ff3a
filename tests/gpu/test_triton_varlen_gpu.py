"""Full-size checks of the Triton varlen kernels on a GPU (skipped without CUDA by tests/gpu/conftest.py).

Workloads follow shared/workloads.md (W1 varlen MHA, W2 GQA, W3 padded, W4 chunked, W5 window);
each forward + backward is compared with the reference backend computed in float32 from the
upcast inputs, by relative L2 error (< 1e-2 for bf16/fp16).
"""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.lengths import SHORT_SEQLEN
from packattn.ops.varlen import configs, op
from packattn.bench.workloads import doc_lengths
from packattn.varlen import Varlen

TOTAL = 32768


def inputs(seqs: Varlen, heads_q: int, heads_kv: int, head_dim: int = 128, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(rows, heads):
        return torch.randn(rows, heads, head_dim, device="cuda", generator=gen).to(dtype).requires_grad_()

    q, k, v = rand(seqs.total_q, heads_q), rand(seqs.total_kv, heads_kv), rand(seqs.total_kv, heads_kv)
    dout = torch.randn(seqs.total_q, heads_q, head_dim, device="cuda", generator=gen).to(dtype)
    return q, k, v, dout


def forward_backward(q, k, v, dout, seqs, backend, **opts):
    out, lse = packattn.attention(q, k, v, seqs, backend=backend, return_lse=True, **opts)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def reference_fp32(q, k, v, dout, seqs, **opts):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    return forward_backward(*leaves, dout.float(), seqs, "reference", **opts)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_against_reference(q, k, v, dout, seqs, tol=1e-2, ref_seqs=None, ref_opts=None, backend="triton", **opts):
    """``backend`` (triton unless named) vs the float32 reference (on ``ref_seqs`` with ``ref_opts`` when given: an equivalent problem)."""
    got = forward_backward(q, k, v, dout, seqs, backend, **opts)
    ref = reference_fp32(q, k, v, dout, ref_seqs or seqs, **(opts if ref_opts is None else ref_opts))
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g in zip(names, got):
        assert not torch.isnan(g).any(), f"{name} has NaN"
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(ref[1])), "lse = -inf on the wrong rows"
    errors = {name: rel_l2(g[finite] if name == "lse" else g, r[finite] if name == "lse" else r)
              for name, g, r in zip(names, got, ref)}
    assert all(e < tol for e in errors.values()), errors
    return got


@pytest.fixture(scope="module")
def w1_lengths():
    lengths = doc_lengths(TOTAL, seed=0)
    assert sum(lengths) == TOTAL
    return lengths


def test_w1_varlen_mha(w1_lengths):
    seqs = Varlen.from_lengths(w1_lengths, device="cuda")
    check_against_reference(*inputs(seqs, 16, 16), seqs, causal=True)


def test_w2_varlen_gqa(w1_lengths):
    seqs = Varlen.from_lengths(w1_lengths, device="cuda")
    check_against_reference(*inputs(seqs, 32, 8), seqs, causal=True)


def test_w3_padded(w1_lengths):
    seqs = Varlen.from_lengths(w1_lengths, pad_to_multiple=64, device="cuda")
    assert seqs.total_q > TOTAL
    out, lse, dq, dk, dv = check_against_reference(*inputs(seqs, 16, 16), seqs, causal=True)
    padding = seqs.row_map_q()[0] < 0
    for t in (out, dq, dk, dv):
        assert torch.equal(t[padding], torch.zeros_like(t[padding]))
    assert torch.isneginf(lse[:, padding]).all()


def test_w4_chunked_one_document():
    # chunk 8192 of one 32768-token document == 4 causal documents of 8192 (checked on the reference)
    seqs = Varlen.from_lengths([TOTAL], device="cuda")
    ref_seqs = Varlen.from_lengths([8192] * 4, device="cuda")
    check_against_reference(*inputs(seqs, 16, 16), seqs, ref_seqs=ref_seqs, ref_opts={"causal": True},
                            causal=True, chunk_size=8192)


@pytest.mark.parametrize("lengths", [[512] * 64, [256] * 127 + [200, 56], [512, 0, 1, 511, 300] * 8],
                         ids=["w8", "256", "nasty"])
def test_w8_short_documents(lengths):
    """Batches with no sequence longer than SHORT_SEQLEN (512) take the short-sequence forward and dQ configs."""
    seqs = Varlen.from_lengths(lengths, device="cuda")
    assert seqs.max_seqlen_q <= SHORT_SEQLEN
    check_against_reference(*inputs(seqs, 16, 16), seqs, causal=True)
    q, k, v, dout = inputs(seqs, 16, 4)
    check_against_reference(q, k, v, dout, seqs, causal="top_left", window=(100, 0))


@pytest.mark.parametrize("opts", [{"causal": True}, {"causal": "top_left", "window": (100, 0)}, {"chunk_size": 100},
                                  {}], ids=["causal", "top_left_window", "chunk", "full"])
def test_short_batch_fused_delta(monkeypatch, opts):
    """Short padded cross batches (queries that see no key included) take the fused backward (the dQ pass
    computes delta, `op.fuses_delta`): against the reference, and close to the unfused backward."""
    seqs = Varlen.from_lengths([300, 1, 0, 64, 65, 500, 129, 37], [200, 5, 40, 64, 1, 500, 300, 0],
                               pad_to_multiple=16, device="cuda")
    assert seqs.max_seqlen_q <= SHORT_SEQLEN
    q, k, v, dout = inputs(seqs, 16, 4)
    assert op.fuses_delta(op.bwd_plan(q, k, v, short_seqs=True), None)
    fused = check_against_reference(q, k, v, dout, seqs, **opts)
    monkeypatch.setattr(op, "fuses_delta", lambda plan, dlse: False)
    unfused = forward_backward(q, k, v, dout, seqs, "triton", **opts)
    for name, a, b in zip(("dq", "dk", "dv"), fused[2:], unfused[2:]):
        assert rel_l2(a, b) < 5e-3, name


@pytest.mark.parametrize("opts", [{"causal": True}, {"causal": "top_left", "window": (100, 0)}, {"chunk_size": 100},
                                  {}], ids=["causal", "top_left_window", "chunk", "full"])
def test_long_batch_fused_delta_two_consumers(monkeypatch, opts):
    """The two-consumer WS dQ of long batches computes delta (no preprocess): against the reference, and close to
    the unfused backward, on padded cross batches with queries that see no key, GQA."""
    seqs = Varlen.from_lengths([1000, 1, 0, 517, 2048, 37, 300], [900, 5, 40, 517, 2000, 0, 301],
                               pad_to_multiple=16, device="cuda")
    q, k, v, dout = inputs(seqs, 16, 4)
    plan = op.bwd_plan(q, k, v, short_seqs=False)
    assert plan.dq.block_m == 128  # the two-consumer config
    assert op.fuses_delta(plan, None)
    fused = check_against_reference(q, k, v, dout, seqs, **opts)
    monkeypatch.setattr(op, "fuses_delta", lambda plan, dlse: False)
    unfused = forward_backward(q, k, v, dout, seqs, "triton", **opts)
    for name, a, b in zip(("dq", "dk", "dv"), fused[2:], unfused[2:]):
        assert rel_l2(a, b) < 5e-3, name


@pytest.mark.parametrize("opts", [{"causal": True}, {"causal": "top_left", "window": (100, 0)}, {"chunk_size": 100},
                                  {"window": (70, 30)}, {}],
                         ids=["causal", "top_left_window", "chunk", "window", "full"])
def test_trimmed_forward_is_bitwise_the_untrimmed_one(monkeypatch, opts):
    """The ``trim`` forward (each consumer warp group skips the key blocks none of its rows sees,
    `packattn.ops.varlen.fwd_sm90`) gives bitwise the output and lse of the same config without it, on padded cross
    batches with empty, length-1 and tail blocks; both against the reference."""
    seqs = Varlen.from_lengths([300, 1, 0, 64, 65, 500, 129, 37, 1000], [200, 5, 40, 64, 1, 500, 300, 0, 1100],
                               pad_to_multiple=16, device="cuda")
    q, k, v, dout = inputs(seqs, 16, 4)
    results = []
    for trim in (False, True):
        with configs.override(fwd=configs.GluonConfig(128, 64, 5, 8, trim=trim)):
            results.append(check_against_reference(q, k, v, dout, seqs, **opts))
    for name, a, b in zip(("out", "lse"), results[0][:2], results[1][:2]):
        assert torch.equal(a, b), name


def test_w5_sliding_window(w1_lengths):
    seqs = Varlen.from_lengths(w1_lengths, device="cuda")
    check_against_reference(*inputs(seqs, 16, 16), seqs, causal=True, window=(1024, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_head_dims_and_dtypes(head_dim, dtype):
    seqs = Varlen.from_lengths([1000, 1, 0, 517, 2048, 300], [900, 5, 40, 517, 2000, 301], pad_to_multiple=16,
                               device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32 dots are IEEE (no TF32)
    check_against_reference(*inputs(seqs, 8, 2, head_dim, dtype), seqs, tol=tol, causal=True, window=(700, 0))


@pytest.mark.parametrize("opts", [{"causal": "top_left"}, {"chunk_size": 300}, {"window": (200, 64)}, {}],
                         ids=["top_left", "chunk", "window_both_sides", "full"])
def test_cross_attention_masks(opts):
    seqs = Varlen.from_lengths([1000, 1, 0, 517, 2048], [700, 5, 40, 1500, 2048], device="cuda")
    check_against_reference(*inputs(seqs, 8, 4), seqs, **opts)


def test_backward_is_bitwise_deterministic(w1_lengths):
    seqs = Varlen.from_lengths(w1_lengths, pad_to_multiple=64, device="cuda")
    q, k, v, dout = inputs(seqs, 32, 8)
    first = forward_backward(q, k, v, dout, seqs, "triton", causal=True, deterministic=True)
    second = forward_backward(q, k, v, dout, seqs, "triton", causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lengths", [[512] * 16, [1000, 1, 0, 517, 2048, 37]], ids=["short", "mixed"])
def test_fast_launches_equal_triton_launches(monkeypatch, lengths):
    """`fast_launch` (the compiled launcher called directly on a cache hit) gives the bitwise results of
    Triton's own launch path, for the forward, the preprocess and both backward passes; the inputs
    are offset views too (pointers not 16-byte aligned must not reuse an aligned specialisation)."""
    from packattn.ops.runtime import fast_launch

    seqs = Varlen.from_lengths(lengths, device="cuda")
    q, k, v, dout = inputs(seqs, 8, 2)
    runs = {}
    fast = fast_launch.enabled
    for mode in ("0", "1"):
        monkeypatch.setattr(fast_launch, "enabled", fast if mode == "1" else lambda: False)
        runs[mode] = [forward_backward(q, k, v, dout, seqs, "triton", causal=True) for _ in range(3)]
    assert fast_launch._caches, "no launch went through the fast path's cache"
    for got in runs["1"]:
        for a, b in zip(got, runs["0"][0]):
            assert torch.equal(a, b)
    # the same tensors shifted by one element: Triton drops the alignment specialisation of the raw pointers
    shifted = [torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x).copy_(x) for x in (q, k, v)]
    shifted = [x.detach().requires_grad_() for x in shifted]
    for mode in ("0", "1"):
        monkeypatch.setattr(fast_launch, "enabled", fast if mode == "1" else lambda: False)
        runs[mode] = forward_backward(*shifted, dout, seqs, "triton", causal=True)
    for a, b in zip(runs["1"], runs["0"]):
        assert torch.equal(a, b)


def test_no_host_sync_in_forward_and_backward(w1_lengths):
    warm = Varlen.from_lengths([300, 200], device="cuda")  # compile the kernels outside the check
    forward_backward(*inputs(warm, 16, 4), warm, "triton", causal=True)
    seqs = Varlen.from_lengths(w1_lengths, pad_to_multiple=64, device="cuda")
    q, k, v, dout = inputs(seqs, 16, 4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward(q, k, v, dout, seqs, "triton", causal=True, window=(1024, 0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_auto_dispatch_picks_triton_on_cuda(w1_lengths):
    from packattn import dispatch

    seqs = Varlen.from_lengths(w1_lengths[:4], device="cuda")
    q, k, v, _ = inputs(seqs, 16, 16)
    reasons = dict(dispatch.reasons(dispatch.Params(
        device_type="cuda", dtype=q.dtype, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128, kind="varlen",
        pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=17, max_seqlen_kv=17,
        mask=packattn.Mask.make(causal=True), return_lse=False, deterministic=False, requires_grad=True)))
    assert reasons["triton"] is None, reasons


def test_forward_captures_in_a_cuda_graph(w1_lengths):
    """The triton forward does no host sync and allocates through the caching allocator, so it can
    be captured once and replayed; replays equal eager calls on the new inputs (forward and backward
    together: the next test)."""
    seqs = Varlen.from_lengths(w1_lengths[:6], pad_to_multiple=64, device="cuda")
    q, k, v, _ = inputs(seqs, 16, 4)
    opts = {"causal": True, "window": (512, 0)}
    with torch.no_grad():
        packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)  # builds the tile tables
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream
            packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        fresh = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
    for got, want in zip(captured, fresh):
        assert torch.equal(got, want)


def test_forward_backward_captures_in_a_cuda_graph(w1_lengths):
    """Forward and backward in one CUDA graph (warm-up on a side stream first, as PyTorch's graph
    recipe asks); replayed gradients equal eager ones on the new inputs."""
    seqs = Varlen.from_lengths(w1_lengths[:6], pad_to_multiple=64, device="cuda")
    q, k, v, dout = inputs(seqs, 16, 4)
    opts = {"causal": True}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward_backward(q, k, v, dout, seqs, "triton", **opts)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_backward(q, k, v, dout, seqs, "triton", **opts)
    with torch.no_grad():
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = forward_backward(q, k, v, dout, seqs, "triton", **opts)
    for got, want in zip(captured, fresh):
        assert torch.equal(got, want)
