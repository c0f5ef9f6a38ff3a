"""The optional fa4 backend (FlashAttention-4) against the float32 reference; skipped when
flash_attn.cute is not installed (it is an extra: see ../shared/tools/fa4-wheels)."""

from __future__ import annotations

import pytest
import torch

from packattn.backends import get as get_backend
from packattn.bench.workloads import doc_lengths
from packattn.varlen import Varlen

from .test_triton_varlen_gpu import check_against_reference, inputs

pytestmark = pytest.mark.skipif(get_backend("fa4").unavailable() is not None,
                                reason=f"fa4 unavailable: {get_backend('fa4').unavailable()}")

DOCS = doc_lengths(32768, seed=0)


@pytest.mark.parametrize("case", ["causal", "gqa", "padded", "window", "cross", "d192", "d256"])
def test_fa4_matches_reference(case):
    heads = (32, 8) if case == "gqa" else (16, 4) if case in ("d192", "d256") else (16, 16)
    head_dim = int(case[1:]) if case in ("d192", "d256") else 128
    opts = {"causal": True}
    if case == "padded":
        seqs = Varlen.from_lengths(DOCS, pad_to_multiple=64, device="cuda")
    elif case == "cross":
        seqs = Varlen.from_lengths([0, 1, 300, 77, 1024, 2000], [5, 0, 200, 77, 1500, 2000], device="cuda")
    else:
        seqs = Varlen.from_lengths(DOCS if head_dim == 128 else doc_lengths(16384, seed=0), device="cuda")
    if case == "window":
        opts["window"] = (1024, 0)
    q, k, v, dout = inputs(seqs, *heads, head_dim)
    out, lse, dq, dk, dv = check_against_reference(q, k, v, dout, seqs, backend="fa4", **opts)
    if seqs.pad_between_seqs:
        pad_q = seqs.row_map_q()[0] < 0
        pad_kv = seqs.row_map_kv()[0] < 0
        assert (out[pad_q] == 0).all() and (dq[pad_q] == 0).all()
        assert (dk[pad_kv] == 0).all() and (dv[pad_kv] == 0).all()
        assert torch.isneginf(lse[:, pad_q]).all()


def test_auto_follows_the_cost_table(caplog):
    """With FA4 installed, auto dispatch on Hopper runs the backend the committed cost table measured fastest for
    the call's row (`packattn.costs`); elsewhere the rule: FA4 leads where it supports the call."""
    import logging

    from packattn import attention, costs, dispatch

    def chosen(lengths, requires_grad):
        seqs = Varlen.from_lengths(lengths, device="cuda")
        q, k, v, _ = inputs(seqs, 16, 16)
        dispatch.clear_cache()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="packattn.dispatch"), torch.set_grad_enabled(requires_grad):
            attention(q.requires_grad_(requires_grad), k, v, seqs, causal=True)
        used = [r.getMessage() for r in caplog.records if "using backend" in r.getMessage()]
        assert len(used) == 1, used
        return used[0].split("using backend ")[1].split(" ")[0]

    def fastest(longest, requires_grad):
        if torch.cuda.get_device_capability()[0] != 9:
            return "fa4"
        regime = costs.regime(dispatch.Params.bucket(longest), dispatch.Params.bucket(longest))
        row = next(r for r in costs.table("sm90").rows
                   if r.key == costs.Key(128, 128, 1, regime, "causal", requires_grad))
        usable = {name: ms for name, ms in row.ms.items() if get_backend(name).unavailable() is None}
        return min(usable, key=usable.get)

    for lengths, grad in (([512] * 8, True), ([300, 1, 77, 512], True), ([512] * 8, False), ([513, 100], True),
                          ([128] * 16, True), ([128] * 16, False)):
        assert chosen(lengths, grad) == fastest(max(lengths), grad), (lengths, grad)
