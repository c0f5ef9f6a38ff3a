"""MLA in the portable Triton varlen kernels: a value head dim different from the q/k head dim (V, out, dO,
dV have v's), against the float64 oracle in Triton's interpreter on CPU (tests/conftest.py) or on a GPU.
Head dims come from `configs.HEAD_DIMS`, like the other tests of this family (the interpreter's tiles are
small at every dim); the dispatch rule (triton capable, the tree backend not) is checked by Params."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn import dispatch
from packattn.backends import triton_tree, triton_varlen
from packattn.mask import Mask
from packattn.ops.varlen import op, traced
from packattn.varlen import Varlen
from oracle import oracle_grads, same_dtype_grads
from triton_varlen_harness import DEVICE, requires_triton

pytestmark = requires_triton

# q/k and v head dims: v narrower, v wider, q/k not a power of two (its tile is masked, v's is not)
DIMS = [(64, 32), (32, 64), (96, 32)]
MASKS = {"causal": {"causal": True}, "top_left+chunk": {"causal": "top_left", "chunk_size": 24},
         "window": {"causal": True, "window": (20, 0)}}


def make_mla(lengths_q, lengths_kv, heads, dims, dtype, pad=None, seed=0):
    seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=pad, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)

    def rand(rows, h, d):
        return torch.randn(rows, h, d, generator=gen).to(DEVICE, dtype)

    q, k = rand(seqs.total_q, heads[0], dims[0]), rand(seqs.total_kv, heads[1], dims[0])
    v, dout = rand(seqs.total_kv, heads[1], dims[1]), rand(seqs.total_q, heads[0], dims[1])
    return seqs, q, k, v, dout


def run_both(seqs, q, k, v, dout, opts):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = packattn.attention(*leaves, seqs, backend="triton", return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    layout = (seqs.lengths_q, seqs.lengths_kv, seqs.host_starts_q, seqs.host_starts_kv, seqs.total_q)
    cpu = [x.detach().cpu() for x in (q, k, v, dout)]
    ref = oracle_grads(*cpu, *layout, **opts)
    return (out, lse, grads), ref, (cpu, layout)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dims", DIMS, ids=[f"{a}-{b}" for a, b in DIMS])
def test_mla_fp32_matches_oracle(dims, mask):
    """GQA, padding between sequences, an empty sequence, length 1, cross lengths (bottom-right alignment)."""
    opts = MASKS[mask]
    seqs, q, k, v, dout = make_mla([37, 0, 1, 50], [40, 3, 1, 50], (4, 2), dims, torch.float32, pad=16)
    (out, lse, grads), (ref_out, ref_lse, ref_grads), _ = run_both(seqs, q, k, v, dout, opts)
    assert out.shape == (seqs.total_q, 4, dims[1]) and lse.shape == (4, seqs.total_q)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    valid = seqs.row_map_q()[0].cpu() >= 0
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=1e-4, rtol=0)
    torch.testing.assert_close(lse.double().cpu()[:, valid], ref_lse[:, valid], atol=1e-4, rtol=0)
    assert torch.isneginf(lse.cpu()[:, ~valid]).all()
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("dims", DIMS[:2], ids=[f"{a}-{b}" for a, b in DIMS[:2]])
def test_mla_fp16_within_twice_torch_fp16_error(dims):
    opts = {"causal": True, "window": (40, 0)}
    seqs, q, k, v, dout = make_mla([37, 0, 70], None, (4, 2), dims, torch.float16)
    (out, _lse, grads), (ref_out, _ref_lse, ref_grads), (cpu, layout) = run_both(seqs, q, k, v, dout, opts)
    low_out, low_grads = same_dtype_grads(*cpu, *layout, **opts)  # plain fp16 torch
    assert out.dtype == torch.float16 and out.shape[-1] == dims[1]
    for name, got, truth, low in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads),
                                     (low_out, *low_grads)):
        err = (got.double().cpu() - truth).abs().max().item()
        torch_err = (low.double() - truth).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3g} vs fp16 torch {torch_err:.3g}"


def test_mla_fakes_give_the_value_head_dim():
    q, k, v = torch.empty(5, 4, 64), torch.empty(7, 2, 64), torch.empty(7, 2, 32)
    for out, lse in (op._varlen_fwd_fake(q, k, v, [], None, None, 1.0, []),
                     traced._varlen_fwd_fake(q, k, v, [], 1.0, [])):
        assert out.shape == (5, 4, 32) and lse.shape == (4, 5)


def _params(device_type="cuda", **overrides):
    fields = dict(device_type=device_type, dtype=torch.bfloat16, heads_q=16, heads_kv=4, head_dim=192, head_dim_v=128,
                  kind="varlen", pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=4096,
                  max_seqlen_kv=4096, mask=Mask.make(causal=True), return_lse=False, deterministic=False,
                  requires_grad=True)
    fields.update(overrides)
    return dispatch.Params(**fields)


@pytest.mark.parametrize("dims", [(192, 128), (128, 64)])
def test_mla_dispatch_triton_capable_tree_not(dims):
    """On CUDA the triton backend takes MLA (its Gluon kernels refuse unequal dims: `sm90.sm90_runs`, so the
    portable kernels run); the tree backend refuses it with a reason."""
    params = _params(head_dim=dims[0], head_dim_v=dims[1])
    assert dict(dispatch.reasons(params))["triton"] is None
    assert triton_varlen.TritonVarlenBackend().unsupported(params) is None
    why = triton_tree.TritonTreeBackend().unsupported(_params(head_dim=dims[0], head_dim_v=dims[1], kind="tree"))
    assert why is not None and "tree kernels need equal" in why
    assert "value head_dim 80" in triton_varlen.TritonVarlenBackend().unsupported(_params(head_dim_v=80))
