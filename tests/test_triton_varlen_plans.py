"""What the triton backend plans before its kernels run: the tile tables (torch only), the backward's
passes (`op.bwd_plan`: checked between forward and backward, launched in order with the
kernels replaced by recorders) and where the fused dQ pass leaves delta at 0. Triton's interpreter on
CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) or a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import packattn
import packattn.ops.runtime.launch
from packattn import mask as masks
from packattn.ops.varlen import configs, op
from packattn.ops.varlen.configs import GluonBwdConfig
from packattn.ops.varlen.tiles import build_tile_table
from packattn.mask import Mask
from packattn.varlen import Varlen
from triton_varlen_harness import SELF_MASKS, make_inputs, requires_triton

pytestmark = requires_triton


# ---------------------------------------------------------------- tile tables (torch only, no kernel)
@pytest.mark.parametrize("by_keys", [False, True], ids=["query_tiles", "key_tiles"])
def test_tile_tables_cover_exactly_the_visible_pairs(by_keys):
    block, step = (16, 8) if by_keys else (8, 16)
    cases = [([0, 1, 17, 37, 40], None), ([17, 0, 37, 5, 30], [40, 9, 3, 0, 30])]
    mask_opts = [{}, {"causal": True}, {"causal": "top_left"}, {"window": (5, 3)}, {"causal": True, "chunk_size": 12},
                 {"causal": True, "window": (9, 0), "chunk_size": 20}, {"window": (-1, 2), "chunk_size": 7}]
    bands = 0
    for lengths_q, lengths_kv in cases:
        seqs = Varlen.from_lengths(lengths_q, lengths_kv, pad_to_multiple=8)
        for opts in mask_opts:
            mask = Mask.make(**opts)
            table = build_tile_table(seqs, mask, by_keys, block, step).tolist()
            own = seqs.lengths_kv if by_keys else seqs.lengths_q
            assert len(table) == -(-(seqs.total_kv if by_keys else seqs.total_q) // block) + seqs.num_seqs
            seen = set()
            for seq, start, lo, mid_lo, mid_hi, hi in table:
                if seq < 0:
                    continue
                seen.add((seq, start))
                vis = masks.dense_mask(mask, seqs.lengths_q[seq], seqs.lengths_kv[seq])
                vis = (vis.t() if by_keys else vis)[start:start + block]  # (own rows of the tile, other side)
                other = vis.any(0).nonzero().flatten().tolist()
                if other:
                    assert lo <= other[0] and other[-1] < hi, (opts, seq, start, lo, hi, other)
                if mid_lo < mid_hi:  # the unmasked band: whole blocks on the grid lo + i * step
                    assert lo <= mid_lo and mid_hi <= hi and (mid_lo - lo) % step == 0 and (mid_hi - mid_lo) % step == 0
                    assert vis[:, mid_lo:mid_hi].all(), (opts, seq, start, mid_lo, mid_hi)
                    bands += 1
                else:
                    assert mid_lo == mid_hi == hi
            assert seen == {(i, b) for i, n in enumerate(own) for b in range(0, n, block)}
    assert bands > 0


def test_tile_tables_put_the_longest_work_first():
    seqs = Varlen.from_lengths([5, 300, 40])
    table = build_tile_table(seqs, Mask.make(causal=True), False, 32, 32)
    work = [(hi - lo) if seq >= 0 else -1 for seq, _, lo, _, _, hi in table.tolist()]
    assert work == sorted(work, reverse=True)


# ---------------------------------------------------------------- the options lists
def test_options_lists_start_with_the_mask_fields():
    """`launch.MASK_FIELDS` names `mask_options` / `mask_from_options` (a round trip); `op.batch_options`,
    `op.bwd_options` and `op.read_options` build and read `FWD_OPTIONS` / `BWD_OPTIONS` by those names."""
    import inspect

    from packattn.ops.runtime import launch

    assert tuple(inspect.signature(launch.mask_from_options).parameters) == launch.MASK_FIELDS
    assert launch.MASK_OPTIONS == len(launch.MASK_FIELDS)
    for opts in SELF_MASKS + [{"causal": "top_left", "window": (5, 2), "chunk_size": 12}, {"window": (-1, 3)}]:
        mask = Mask.make(**opts)
        assert len(launch.mask_options(mask)) == launch.MASK_OPTIONS
        assert launch.mask_from_options(*launch.mask_options(mask)) == mask
    seqs = Varlen.from_lengths([5, 9], pad_to_multiple=8)
    mask = Mask.make(causal=True, window=(4, 0))
    fwd = op.batch_options(seqs, mask, 0, 1, 1)  # long_seqs, gluon, short_seqs
    assert len(fwd) == len(op.FWD_OPTIONS)
    named = dict(zip(op.FWD_OPTIONS, fwd))
    assert named["padded_q"] and named["padded_kv"] and named["gluon"] == 1 and named["short_seqs"] == 1
    bwd = op.bwd_options(fwd, True)
    assert dict(zip(op.BWD_OPTIONS, bwd)) == {name: named[name] for name in op.BWD_OPTIONS}
    assert bwd == op.batch_options(seqs, mask, True)
    read_mask, rest = op.read_options(bwd)
    assert read_mask == mask and rest == [True, True, True]


# ---------------------------------------------------------------- the backward's plan
@pytest.mark.parametrize("pass_name", ["dkdv_choice", "dq_choice"])
def test_backward_refuses_a_pass_changed_after_the_forward(monkeypatch, pass_name):
    """The forward builds dK/dV key tiles and dQ query tiles for one pass each (`dkdv_choice`,
    `dq_choice`); a backward that would run another (an override changed in between)
    stops with a clear error."""
    seqs, q, k, v, dout = make_inputs([37, 5], heads=(2, 1))
    out = packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    plan = op.bwd_plan(q, k, v)
    rows, cols, gluon = getattr(plan, pass_name)
    changed = dataclasses.replace(plan, **{pass_name: (2 * rows, cols, not gluon)})
    monkeypatch.setattr(op, "bwd_plan", lambda *a: changed)
    name = "dK/dV" if pass_name == "dkdv_choice" else "dQ"
    with pytest.raises(RuntimeError, match=f"the {name} pass changed between forward and backward"):
        torch.autograd.grad(out, (q, k, v), dout)
    monkeypatch.undo()
    out = packattn.attention(q, k, v, seqs, backend="triton", causal=True)
    assert all(g is not None for g in torch.autograd.grad(out, (q, k, v), dout))


# ---------------------------------------------------------------- delta from O in the one-consumer Gluon dQ pass
class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` appends ``(name, args, kwargs)`` to ``log``."""

    def __init__(self, log, name):
        self.log, self.name, self.__name__ = log, name, name  # (`_launch` keys retries by kernel name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, args, kwargs))


def _cfg(text):
    """``"block_m,block_n,stages,num_warps"`` as a GluonBwdConfig (None for None: the Triton pass)."""
    if text is None:
        return None
    return GluonBwdConfig(*(int(x) for x in text.split(",")))


def _planned_launches(monkeypatch, dkdv_text, dq_text, with_dlse, short_seqs=False):
    """`_varlen_bwd_planned` with a plan of these Gluon configs (None: the Triton pass) on CPU tensors,
    every kernel replaced by a recorder: ``(plan, out, launches)``, launches in order."""
    from packattn.ops.varlen import bwd_dkdv_sm90, bwd_dq_sm90, bwd_triton

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    log = []
    for module, name, label in ((bwd_dq_sm90, "varlen_bwd_dq_gluon_ws_kernel", "dq"),
                                (bwd_dkdv_sm90, "varlen_bwd_dkdv_gluon_ws_kernel", "dkdv"),
                                (bwd_triton, "bwd_dq_kernel", "dq"), (bwd_triton, "bwd_dkdv_kernel", "dkdv"),
                                (bwd_triton, "bwd_preprocess_kernel", "preprocess")):
        monkeypatch.setattr(module, name, _Recorder(log, label))
    dkdv, dq = _cfg(dkdv_text), _cfg(dq_text)
    plan = op.BwdPlan(dkdv, dq, (64, 64, dkdv is not None), (64, 64, dq is not None), short_seqs)
    rows, heads, d = 256, 4, 128
    gen = torch.Generator().manual_seed(0)
    q, k, v, out, dout = (torch.randn(rows, heads, d, generator=gen).to(torch.bfloat16) for _ in range(5))
    lse = torch.randn(heads, rows, generator=gen)
    dlse = torch.randn(heads, rows, generator=gen) if with_dlse else None
    cu = torch.tensor([0, rows], dtype=torch.int32)
    tiles = torch.zeros(rows // 64 + 1, 6, dtype=torch.int32)
    options = [*packattn.ops.runtime.launch.mask_options(Mask.make(True)), False, False, short_seqs]
    op._varlen_bwd_planned(plan, dout, dlse, q, k, v, out, lse, [cu, cu, cu[:1] * 0, cu[:1] * 0, tiles, tiles],
                           None, None, 0.1, options)
    return plan, out, lse, log


@pytest.mark.parametrize("fused", [False, True])
def test_short_batches_run_the_backward_in_their_head_sections(monkeypatch, fused):
    """A plan for a batch of short sequences hands both warp-specialised passes the short work order
    (`configs.SHORT_HEAD_SECTION` kv-head groups per section), others the default one."""
    dq = "64,64,2,4" if fused else "128,64,4,8"
    for short, groups in ((False, configs.HEAD_SECTION), (True, configs.SHORT_HEAD_SECTION)):
        _, _, _, log = _planned_launches(monkeypatch, "64,64,2,4", dq, False, short_seqs=short)
        sections = {name: args[-2] for name, args, _ in log if name in ("dq", "dkdv")}
        assert sections == {"dq": groups, "dkdv": groups}  # MHA: kv-head groups == heads


def test_fused_delta_runs_dq_first_without_the_preprocess(monkeypatch):
    """One-consumer WS dQ (the d = 128 short-sequence config), Gluon dK/dV, no dlse: no preprocess; the dQ
    pass (DELTA_FROM_O, an O descriptor) writes a zero-initialised delta that the dK/dV pass then reads."""
    assert configs.DQ_SHORT_CONFIGS[128] == _cfg("64,64,2,4")
    plan, out, lse, log = _planned_launches(monkeypatch, "64,64,2,4", "64,64,2,4", False)
    assert op.fuses_delta(plan, None)
    assert [name for name, _, _ in log] == ["dq", "dkdv"]
    (_, dq_args, dq_kwargs), (_, dkdv_args, _) = log
    assert dq_kwargs["DELTA_FROM_O"] is True and dq_kwargs["BLOCK_M"] == 64
    assert dq_args[4].base is out and list(dq_args[4].block_shape) == [64, 128]
    delta = dq_args[6]  # (q, k, v, dO, O descriptors, Lse, Delta, ...)
    assert dkdv_args[5] is delta  # (q, k, v, dO descriptors, Lse, Delta, ...): the same tensor
    assert delta.dtype == torch.float32 and delta.shape == lse.shape and delta.is_contiguous()
    assert torch.equal(delta, torch.zeros_like(lse))  # zeros: rows no dQ tile writes are read with P = 0


@pytest.mark.parametrize("dq", ["128,64,4,8", "128,128,2,8"])  # the long-batch defaults at d = 128 and d = 64
def test_two_consumer_dq_fuses_delta(monkeypatch, dq):
    """The two-consumer WS dQ computes delta too: the backward runs as the one-consumer fused one: dQ first with
    DELTA_FROM_O and an O descriptor of its 128-row tiles, no preprocess."""
    plan, out, lse, log = _planned_launches(monkeypatch, "64,64,2,4", dq, False)
    assert op.fuses_delta(plan, None)
    assert [name for name, _, _ in log] == ["dq", "dkdv"]
    (_, dq_args, dq_kwargs), (_, dkdv_args, _) = log
    assert dq_kwargs["DELTA_FROM_O"] is True and dq_kwargs["BLOCK_M"] == 128 and "PERSISTENT" not in dq_kwargs
    assert dq_kwargs["BLOCK_N"] == _cfg(dq).block_n
    assert dq_args[4].base is out and list(dq_args[4].block_shape) == [128, 128]
    assert dkdv_args[5] is dq_args[6] and torch.equal(dq_args[6], torch.zeros_like(lse))
    # a dlse term cannot be folded in
    plan, _, lse, _ = _planned_launches(monkeypatch, "64,64,2,4", dq, True)
    assert not op.fuses_delta(plan, lse)


@pytest.mark.parametrize("dkdv,dq,with_dlse", [
    ("64,64,2,4", "64,64,2,4", True),      # dlse: its term stays in the preprocess
    ("64,128,2,8", "128,64,4,8", True),
    ("64,64,2,4", "128,128,2,8", True),
    (None, "64,64,2,4", False),            # Triton dK/dV pass
    ("64,64,2,4", None, False),            # Triton dQ pass
])
def test_other_plans_keep_preprocess_dkdv_dq(monkeypatch, dkdv, dq, with_dlse):
    plan, _, lse, log = _planned_launches(monkeypatch, dkdv, dq, with_dlse)
    assert not op.fuses_delta(plan, lse if with_dlse else None)
    assert [name for name, _, _ in log] == ["preprocess", "dkdv", "dq"]
    (_, pre_args, pre_kwargs), (_, dkdv_args, _), (_, dq_args, dq_kwargs) = log
    assert pre_kwargs["HAS_DLSE"] is with_dlse
    delta = pre_args[4]  # (Out, dOut, Lse, dLse, Delta, ...)
    assert any(a is delta for a in dkdv_args) and any(a is delta for a in dq_args)
    assert dq_kwargs.get("DELTA_FROM_O", False) is False
    if dq is not None:  # the Gluon dQ kernel (two consumers or one) without DELTA_FROM_O: no O descriptor
        assert "DELTA_FROM_O" in dq_kwargs and dq_args[4] is None
    else:  # the Triton dQ pass
        assert "DELTA_FROM_O" not in dq_kwargs


@pytest.mark.parametrize("opts", SELF_MASKS, ids=lambda o: Mask.make(**o).describe())
@pytest.mark.parametrize("lengths", [([17, 0, 1, 37, 100, 129], None), ([70, 65, 130], [0, 3, 200])])
def test_fused_delta_rows_left_zero_see_no_key(opts, lengths):
    """What the dK/dV pass reads after the fused dQ pass: delta = rowsum(dO O) on the rows of 64-query tiles
    with key blocks (the tile table the one-consumer dQ runs), 0 elsewhere. Every query row whose delta is
    left 0 sees no key (P = 0 there in the dK/dV pass), so the 0 is never used."""
    mask = Mask.make(**opts)
    seqs = Varlen.from_lengths(*lengths)
    table = build_tile_table(seqs, mask, False, 64, 64)
    written = torch.zeros(seqs.total_q, dtype=torch.bool)
    for seq, start, lo, _, _, hi in table.tolist():
        if seq >= 0 and hi > lo:  # num_blocks > 0: the tile computes and stores delta for its rows < len_q
            first = seqs.host_starts_q[seq] + start
            written[first:min(first + 64, seqs.host_starts_q[seq] + seqs.lengths_q[seq])] = True
    for i, (lq, lk) in enumerate(zip(seqs.lengths_q, seqs.lengths_kv)):
        if lq == 0:
            continue
        sees = masks.dense_mask(mask, lq, lk).any(dim=1) if lk else torch.zeros(lq, dtype=torch.bool)
        rows = written[seqs.host_starts_q[i]:seqs.host_starts_q[i] + lq]
        assert not (sees & ~rows).any(), f"sequence {i}: a row that sees a key has no delta"
