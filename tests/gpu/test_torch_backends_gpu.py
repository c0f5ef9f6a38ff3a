"""GPU: the PyTorch backends (sdpa, flex, torch_varlen) against a float64 oracle on W1-sized data,
and no host sync inside attention() for a Varlen built by from_lengths."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.backends import get as get_backend
from packattn.bench.workloads import Workload, doc_lengths

DOCS = doc_lengths(32768, seed=0)


def _visible(n_q, n_k, causal, window, chunk, device):
    """Mask of one sequence, written out from the documented rules (independent of packattn.mask)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    a = i if causal == "top_left" else i + (n_k - n_q)
    ok = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= a
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= a - left
        if right >= 0:
            ok &= j <= a + right
    if chunk is not None:
        ok &= torch.div(j, chunk, rounding_mode="floor") == torch.div(a, chunk, rounding_mode="floor")
    return ok


def _per_sequence(q, k, v, dout, seqs, opts, dtype):
    """out and grads computed one sequence at a time with plain torch ops in `dtype`."""
    qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], device=q.device, dtype=dtype)
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    for sq, sk, n_q, n_k in zip(seqs.host_starts_q, seqs.host_starts_kv, seqs.lengths_q, seqs.lengths_kv):
        if n_q == 0 or n_k == 0:
            continue
        qi = qs[sq : sq + n_q].transpose(0, 1)
        ki = ks[sk : sk + n_k].repeat_interleave(group, dim=1).transpose(0, 1)
        vi = vs[sk : sk + n_k].repeat_interleave(group, dim=1).transpose(0, 1)
        s = (qi @ ki.transpose(1, 2)) * scale
        vis = _visible(n_q, n_k, opts.get("causal", False), opts.get("window"), opts.get("chunk_size"), q.device)
        s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(dtype)
        out = out.index_copy(0, torch.arange(sq, sq + n_q, device=q.device), (p @ vi).transpose(0, 1))
    grads = torch.autograd.grad(out, (qs, ks, vs), dout.to(dtype))
    return out.detach(), grads


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


CASES = {
    "W1 causal": (Workload("W1", DOCS, options={"causal": True}), ("sdpa", "flex", "torch_varlen")),
    "W2 gqa": (Workload("W2", DOCS, heads_q=32, heads_kv=8, options={"causal": True}), ("flex", "torch_varlen")),
    "W3 padded": (Workload("W3", DOCS, options={"causal": True}, pad_to_multiple=64), ("sdpa", "flex")),
    "W5 window": (Workload("W5", DOCS, options={"causal": True, "window": (1024, 0)}), ("flex", "torch_varlen")),
    "chunk": (Workload("W4", DOCS, options={"causal": True, "chunk_size": 1000}), ("sdpa", "flex")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_backends_match_oracle_at_w1_size(case):
    workload, backends = CASES[case]
    seqs, q, k, v = workload.make_inputs("cuda", torch.bfloat16, seed=1)
    dout = torch.randn_like(q)
    ref_out, ref_grads = _per_sequence(q, k, v, dout, seqs, workload.options, torch.float64)
    low_out, low_grads = _per_sequence(q, k, v, dout, seqs, workload.options, torch.bfloat16)
    tol_out = 2 * _max_err(low_out, ref_out) + 1e-3
    tol_grads = [2 * _max_err(g, r) + 1e-3 for g, r in zip(low_grads, ref_grads)]
    valid = seqs.row_map_q()[0] >= 0
    for name in backends:
        assert get_backend(name).unavailable() is None, name
        out = packattn.attention(q, k, v, seqs, backend=name, **workload.options)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert _max_err(out, ref_out) <= tol_out, (name, _max_err(out, ref_out), tol_out)
        for label, g, r, tol in zip("qkv", grads, ref_grads, tol_grads):
            assert torch.isfinite(g).all(), (name, label)
            assert _max_err(g, r) <= tol, (name, "d" + label, _max_err(g, r), tol)
        if seqs.pad_between_seqs:
            assert (out[~valid] == 0).all() and (grads[0][~valid] == 0).all(), name


@pytest.mark.parametrize("name", ["flex", "torch_varlen"])
def test_lse_matches_reference(name):
    workload = Workload("small", [0, 1, 300, 77, 1024], [5, 0, 200, 77, 1500], options={"causal": True})
    seqs, q, k, v = workload.make_inputs("cuda", torch.bfloat16, seed=2, requires_grad=False)
    out, lse = packattn.attention(q, k, v, seqs, backend=name, return_lse=True, causal=True)
    ref_out, ref_lse = packattn.attention(q.float(), k.float(), v.float(), seqs, backend="reference", return_lse=True, causal=True)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-2
    assert (out.float() - ref_out).abs().max() < 2e-2


@pytest.mark.parametrize("name", ["flex", "torch_varlen", "reference"])
def test_attention_does_not_sync(name):
    workload = Workload("sync", DOCS[:8], heads_q=8, heads_kv=2, options={"causal": True})
    seqs, q, k, v = workload.make_inputs("cuda", torch.bfloat16)
    out = packattn.attention(q, k, v, seqs, backend=name, causal=True)  # warm-up (compiles)
    out.sum().backward()
    fresh = workload.varlen("cuda")  # a new batch: per-batch metadata is rebuilt inside the checked region
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = packattn.attention(q, k, v, fresh, backend=name, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
