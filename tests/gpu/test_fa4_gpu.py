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


@pytest.mark.parametrize("case", ["causal", "gqa", "padded", "window", "cross"])
def test_fa4_matches_reference(case):
    heads = (32, 8) if case == "gqa" else (16, 16)
    opts = {"causal": True}
    if case == "padded":
        seqs = Varlen.from_lengths(DOCS, pad_to_multiple=64, device="cuda")
    elif case == "cross":
        seqs = Varlen.from_lengths([0, 1, 300, 77, 1024, 2000], [5, 0, 200, 77, 1500, 2000], device="cuda")
    else:
        seqs = Varlen.from_lengths(DOCS, device="cuda")
    if case == "window":
        opts["window"] = (1024, 0)
    q, k, v, dout = inputs(seqs, *heads)
    out, lse, dq, dk, dv = check_against_reference(q, k, v, dout, seqs, backend="fa4", **opts)
    if seqs.pad_between_seqs:
        pad_q = seqs.row_map_q()[0] < 0
        pad_kv = seqs.row_map_kv()[0] < 0
        assert (out[pad_q] == 0).all() and (dq[pad_q] == 0).all()
        assert (dk[pad_kv] == 0).all() and (dv[pad_kv] == 0).all()
        assert torch.isneginf(lse[:, pad_q]).all()


def test_auto_defers_short_batches_with_gradients_to_triton(caplog):
    """With FA4 installed, auto dispatch runs short batches (<= 512 rows) with gradients at d = 128 on the triton
    backend on Hopper (`Fa4Backend.defers_to`), on FA4 on other GPUs, and the rest that FA4 supports on FA4."""
    import logging

    from packattn import attention, dispatch

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

    short = "triton" if torch.cuda.get_device_capability()[0] == 9 else "fa4"  # (measured on Hopper only)
    assert chosen([512] * 8, True) == short
    assert chosen([300, 1, 77, 512], True) == short
    assert chosen([512] * 8, False) == "fa4"
    assert chosen([513, 100], True) == "fa4"
