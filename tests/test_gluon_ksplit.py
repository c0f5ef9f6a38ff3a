"""The key-split Gluon dK/dV kernel (`packattn.ops.varlen.bwd_dkdv_sm90_ksplit`, the tables' dK/dV at d = 192 / 256)
without a GPU: the tables select it there and nowhere else (the plan's key tile table follows its 64 x 64 blocks),
`configs.override` swaps in another key-split config, its config and head-dim checks (the head-dim split it replaced
is refused), the shared-memory formula, the column ownership, the launch (descriptors, arguments, constexprs: a
recording kernel), and (in a subprocess, for sm_90a) it compiles without spills with the overlap in place."""

from __future__ import annotations

import pytest
import torch
from sm90_compile import compile_check
from test_gluon_bwd_parts import (  # one launch stub and input maker for both
    _Recording,
    _tensors,
)

from packattn.mask import Mask
from packattn.ops.runtime import support
from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS
from packattn.ops.varlen import (
    configs,
    launch_sm90,
    launch_sm90_bwd_parts,
    launch_sm90_ksplit,
    op,
)

KS = configs.GluonBwdConfig(64, 64, 2, 8, key_split=True)
DIMS = [256, 192]


def _gluon_everywhere(monkeypatch):
    monkeypatch.setattr(op, "sm90_runs", lambda *args: True)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 4)], ids=["mha", "gqa4", "gqa8"])
def test_the_tables_select_it_at_192_and_256_only(heads, monkeypatch):
    _gluon_everywhere(monkeypatch)
    for d in DIMS:
        q, k = torch.zeros(8, heads[0], d), torch.zeros(8, heads[1], d)
        plan = op.bwd_plan(q, k, k)
        assert plan.dkdv is configs.DKDV_CONFIGS[d] and plan.dkdv.key_split
        assert plan.dkdv_choice == (64, 64, True)  # the key tile table: 64 keys a tile, 64 queries a step
        launch_sm90_ksplit.ksplit_resources(plan.dkdv, d, d)  # a config the launcher takes
    for table in (configs.DKDV_CONFIGS, configs.DKDV_GQA_CONFIGS):
        assert {key for key, cfg in table.items() if cfg.key_split} <= set(DIMS)
    assert not any(cfg.key_split for t in (configs.DQ_CONFIGS, configs.DQ_SHORT_CONFIGS) for cfg in t.values())


@pytest.mark.parametrize("how", ["force", "table"])
def test_override_swaps_in_another_and_the_key_tables_follow_its_blocks(how, monkeypatch):
    _gluon_everywhere(monkeypatch)
    q, k = torch.zeros(8, 8, 192), torch.zeros(8, 2, 192)
    assert configs.DKDV_CONFIGS[192] != KS
    kwargs = {"dkdv": KS} if how == "force" else {"DKDV_CONFIGS": {**configs.DKDV_CONFIGS, 192: KS}}
    with configs.override(**kwargs):
        plan = op.bwd_plan(q, k, k)
        assert plan.dkdv is KS and plan.dkdv_choice == (64, 64, True)
    assert op.bwd_plan(q, k, k).dkdv is configs.DKDV_CONFIGS[192]  # restored


@pytest.mark.parametrize("cfg", [configs.GluonBwdConfig(32, 64, 2, 8, key_split=True),
                                 configs.GluonBwdConfig(64, 128, 2, 8, key_split=True),
                                 configs.GluonBwdConfig(64, 64, 2, 4, key_split=True),
                                 configs.GluonBwdConfig(64, 64, 1, 8, key_split=True)])
def test_configs_it_does_not_take_are_refused(cfg):
    with pytest.raises(ValueError, match="key-split"):
        configs.check_dkdv_config(cfg)
    with pytest.raises(ValueError, match="key-split"):
        launch_sm90_ksplit.check_ksplit_config(cfg, 256)
    with pytest.raises(ValueError, match="key-split"), configs.override(dkdv=cfg):
        pass


@pytest.mark.parametrize("cfg", [configs.GluonBwdConfig(64, 64, 2, 8), configs.GluonBwdConfig(32, 64, 2, 8)])
def test_two_warp_groups_on_64_keys_without_key_split_are_refused(cfg):
    """The head-dim split of one 64-key tile (two warp groups, block_n 64) is gone: such a config is refused with a
    pointer to ``key_split``, by the config check and by every dK/dV launcher's resources."""
    with pytest.raises(ValueError, match="key_split=True"):
        configs.check_dkdv_config(cfg)
    with pytest.raises(ValueError, match="key_split=True"), configs.override(dkdv=cfg):
        pass
    with pytest.raises(ValueError, match="key-split dK/dV kernel takes key_split configs only"):
        launch_sm90_ksplit.check_ksplit_config(cfg)
    for resources in (lambda: launch_sm90.dkdv_resources(cfg, 256),
                      lambda: launch_sm90_bwd_parts.dkdv_parts_resources(cfg, 192, 192)):
        with pytest.raises(ValueError, match="key_split=True"):
            resources()


def test_key_split_configs_are_refused_by_the_other_dkdv_kernels():
    for resources in (lambda: launch_sm90.dkdv_resources(KS, 256),
                      lambda: launch_sm90_bwd_parts.dkdv_parts_resources(KS, 192, 192)):
        with pytest.raises(ValueError, match="key-split dK/dV kernel"):
            resources()


def test_key_split_is_a_dkdv_option_only():
    with pytest.raises(ValueError, match="dK/dV"):
        configs.check_dq_config(KS)


@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (96, 96), (128, 64), (256, 128), (192, 128)])
def test_head_dims_it_does_not_take_are_refused(dims, monkeypatch):
    with pytest.raises(ValueError, match="head dims"):
        launch_sm90_ksplit.ksplit_resources(KS, *dims)
    if dims[0] != dims[1]:  # forced at MLA dims: refused before any kernel
        with pytest.raises(ValueError, match="head dims"):
            _launch(dims, KS, monkeypatch)


@pytest.mark.parametrize(("d", "stages", "fits"), [(256, 2, True), (256, 3, False), (192, 3, True), (192, 4, False)])
def test_shared_memory_formula_and_limit(d, stages, fits):
    cfg = configs.GluonBwdConfig(64, 64, stages, 8, key_split=True)
    tiles = (64 + stages * 64) * 2 * d * 2  # K, V of 64 keys; the (Q, dO) ring of 64-query slots
    exchange = 2 * 2 * 64 * 64 * 2  # P^T and dS^T, double buffered
    small = 4 * 2 * stages * 64 + 4 * 4 * 32 + 8 * (4 + 2 * stages)  # lse / delta, bounds, mbarriers
    assert launch_sm90_ksplit.ksplit_shared_bytes(cfg, d) == tiles + exchange + small
    if fits:
        res = launch_sm90_ksplit.ksplit_resources(cfg, d)
        assert res["ctas_per_sm"] == 1 and res["consumer_regs"] == 232 and res["maxnreg"] == 168
    else:
        with pytest.raises(ValueError, match="shared memory"):
            launch_sm90_ksplit.ksplit_resources(cfg, d)


def test_column_ownership_covers_each_head_dim_once():
    from packattn.ops.varlen import bwd_dkdv_sm90_ksplit as ks

    for dim in DIMS:
        cols = []
        for wg in (0, 1):
            first, width = ks.own_col(wg, dim), ks.own_width(wg, dim)
            part_start = 0 if ks.own_part(wg, dim) == 0 else 1 << (dim.bit_length() - 1)
            assert first == part_start + ks.own_offset(wg, dim) and width in (64, 128)
            cols += range(first, first + width)
        assert sorted(cols) == list(range(dim))


def _launch(dims, cfg, monkeypatch, tree=False, mask=None):
    """``gluon_dkdv`` at ``dims`` with ``cfg``, every dK/dV kernel a recording stub: ``({module: launches}, (dk, dv,
    key_end))``."""
    from packattn.ops.varlen import (
        bwd_dkdv_sm90,
        bwd_dkdv_sm90_ksplit,
        bwd_dkdv_sm90_parts,
    )

    kernels = {m: _Recording() for m in (bwd_dkdv_sm90, bwd_dkdv_sm90_ksplit, bwd_dkdv_sm90_parts)}
    monkeypatch.setattr(bwd_dkdv_sm90, "varlen_bwd_dkdv_gluon_ws_kernel", kernels[bwd_dkdv_sm90])
    monkeypatch.setattr(bwd_dkdv_sm90_ksplit, "varlen_bwd_dkdv_ksplit_kernel", kernels[bwd_dkdv_sm90_ksplit])
    monkeypatch.setattr(bwd_dkdv_sm90_parts, "varlen_bwd_dkdv_parts_kernel", kernels[bwd_dkdv_sm90_parts])
    q, k, v, dout, lse, delta = _tensors(dims)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    key_end = torch.zeros(512, dtype=torch.int32) if tree else None
    launch_sm90.gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, torch.zeros(10, 6, dtype=torch.int32), seq_args, 0.1,
                           mask or Mask.make(True), cfg, key_end=key_end)
    return {m.__name__.rsplit(".", 1)[1]: r.launches for m, r in kernels.items()}, (dk, dv, key_end)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("tree", [False, True], ids=["varlen", "tree"])
def test_launch_passes_the_parts_and_constexprs(d, tree, monkeypatch):
    from packattn.ops.varlen.bwd_dkdv_sm90_ksplit import (
        varlen_bwd_dkdv_ksplit_kernel as kernel,
    )

    dims = (d, d)
    launches, (dk, dv, key_end) = _launch(dims, KS, monkeypatch, tree)
    assert launches["bwd_dkdv_sm90"] == [] and launches["bwd_dkdv_sm90_parts"] == []
    ((grid, args, kwargs),) = launches["bwd_dkdv_sm90_ksplit"]
    assert grid == (10 * 2,)
    for i, (rows, dim) in enumerate([(64, dims[0]), (64, dims[0]), (64, dims[1]), (64, dims[1])]):
        hi = 1 << (dim.bit_length() - 1)
        assert args[i].block_shape == [rows, hi]
        assert (args[4 + i] is None) == (hi == dim) and (hi == dim or args[4 + i].block_shape == [rows, dim - hi])
    assert args[10] is dk and args[11] is dv and (args[17] is key_end if tree else args[17] is args[12])
    assert args[18:23] == (*dk.stride()[:2], *dv.stride()[:2], 512) and args[23:25] == (2, 4)
    assert args[25] == pytest.approx(0.1 * 1.4426950408889634) and args[26] == 0.1
    res = launch_sm90_ksplit.ksplit_resources(KS, d)
    assert kwargs == {"HEAD_DIM": d, "BLOCK_M": 64, "BLOCK_N": 64, "STAGES": 2, "HAS_LEFT": False,
                      "HAS_RIGHT": not tree, "HAS_CHUNK": False, "TOP_LEFT": False, "TREE": tree,
                      "CONSUMER_REGS": res["consumer_regs"], "PRODUCER_REGS": res["producer_regs"], "num_warps": 4,
                      "maxnreg": res["maxnreg"], **COMPILE_OPTIONS}
    # every argument and constexpr is one the kernel takes, each once
    constexprs = set(kwargs) - {"maxnreg", *COMPILE_OPTIONS}  # (launch options)
    assert len(args) + len(constexprs) == len(kernel.arg_names) and constexprs <= set(kernel.arg_names)


def test_launch_passes_the_window_and_chunk(monkeypatch):
    mask = Mask.make(causal="top_left", window=(100, 0), chunk_size=256)
    launches, _ = _launch((256, 256), KS, monkeypatch, mask=mask)
    ((_grid, args, kwargs),) = launches["bwd_dkdv_sm90_ksplit"]
    assert kwargs["HAS_LEFT"] and kwargs["HAS_RIGHT"] and kwargs["HAS_CHUNK"] and kwargs["TOP_LEFT"]
    assert args[27:30] == (100, 0, 256)


@pytest.mark.parametrize("dims", [(256, 256), (192, 192), (192, 128)])
def test_the_tables_configs_launch_their_kernels(dims, monkeypatch):
    """192 / 256: the key-split kernel, with the table's stages; MLA 192/128: the part kernel."""
    cfg = configs.dkdv_config(dims[0] if dims[0] == dims[1] else dims)
    launches, _ = _launch(dims, cfg, monkeypatch)
    assert launches["bwd_dkdv_sm90"] == []
    if dims[0] == dims[1]:
        assert launches["bwd_dkdv_sm90_parts"] == []
        ((_grid, _args, kwargs),) = launches["bwd_dkdv_sm90_ksplit"]
        assert kwargs["STAGES"] == cfg.stages and kwargs["HEAD_DIM"] == dims[0]
    else:
        assert launches["bwd_dkdv_sm90_ksplit"] == [] and len(launches["bwd_dkdv_sm90_parts"]) == 1


def test_empty_inputs_launch_nothing(monkeypatch):
    from packattn.ops.varlen import bwd_dkdv_sm90_ksplit

    kernel = _Recording()
    monkeypatch.setattr(bwd_dkdv_sm90_ksplit, "varlen_bwd_dkdv_ksplit_kernel", kernel)
    q, k, v, dout, lse, delta = _tensors((256, 256))
    dk, dv = torch.full_like(k, 3.0), torch.full_like(v, 3.0)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    launch_sm90.gluon_dkdv(q[:0], k, v, dout[:0], lse[:, :0], delta[:, :0], dk, dv,
                           torch.zeros(10, 6, dtype=torch.int32), seq_args, 0.1, Mask.make(True), KS)
    assert kernel.launches == [] and not dk.any() and not dv.any()  # no queries: zero gradients


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_kernel_compiles_for_sm90a_without_spills():
    """One subprocess compiles three variants with `check_gluon_ksplit_compile.check`'s checks (spills, overlap,
    partition budgets, shared memory against the formula)."""
    jobs = [("bf16", 256, "LCR", 2), ("fp16", 192, "tree", 3), ("bf16", 192, "RT", 2)]
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_ksplit_compile as c\n"
              f"bad = 0\nfor dtype, d, mask, stages in {jobs}:\n"
              "    ok, text, row = c.check(dtype, d, mask, stages, mask == 'tree')\n"
              "    bad += not ok\n"
              "    print(text, flush=True)\n"
              "sys.exit(1 if bad else 0)\n")
    stdout = compile_check(script)
    assert stdout.count("overlap OK") == len(jobs) and stdout.count(" 0 bytes spill stores") == len(jobs)
