"""The Gluon backward at head dims in two column parts (96, 192) and with a value head dim of its own (MLA 192/128,
128/64), without a GPU: the tables run them on the part kernels (dK/dV at 192: the key-split kernel,
tests/test_gluon_ksplit.py; scripts/gluon_bwd_dims_gpu.py's baseline tables take them off again), the plan names MLA configs by ``(d, d_v)``, the launchers hand these dims to
the part kernels with the right descriptors and constexprs (a recording kernel), shared memory fits, and (in a
subprocess, for sm_90a) the part kernels compile without spills with the overlap in place."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sm90_compile import compile_check

from packattn.mask import Mask
from packattn.ops.runtime import sm90, support
from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS
from packattn.ops.varlen import configs, launch_sm90, launch_sm90_bwd_parts, launch_sm90_ksplit, op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from gluon_bwd_dims_gpu import DKDV, DQ, triton_bwd_tables  # noqa: E402

DIMS = [(96, 96), (192, 192), (192, 128), (128, 64)]
PART_DKDV_DIMS = [dims for dims in DIMS if not DKDV[dims[0] if dims[0] == dims[1] else dims].key_split]


def _key(dims):
    return dims[0] if dims[0] == dims[1] else dims


@pytest.mark.parametrize("dims", DIMS)
def test_new_dims_take_the_gluon_backward_and_the_baseline_tables_validate(dims, monkeypatch):
    monkeypatch.setattr(op, "sm90_runs", lambda q, k, v, backward, head_dims, dtypes:
                        sm90.dims_key(q.shape[-1], v.shape[-1]) in head_dims)
    q, k, v = torch.zeros(8, 4, dims[0]), torch.zeros(8, 1, dims[0]), torch.zeros(8, 1, dims[1])
    plan = op.bwd_plan(q, k, v)
    assert (plan.dkdv, plan.dq) == (configs.dkdv_config(_key(dims), 4), DQ[_key(dims)])
    assert op.fuses_delta(plan, None) == DQ[_key(dims)].fused_delta == (dims != (192, 192))
    with configs.override(**triton_bwd_tables()):  # the GPU script's baseline: the Triton passes at these dims
        plan = op.bwd_plan(q, k, v)
        assert plan.dkdv is None and plan.dq is None
        assert configs.GLUON_HEAD_DIMS == (64, 128, 256)
    assert _key(dims) in configs.GLUON_HEAD_DIMS  # restored


def test_bwd_plan_names_mla_configs_by_both_head_dims(monkeypatch):
    monkeypatch.setattr(op, "sm90_runs", lambda *args: True)
    q, k, v = torch.zeros(8, 4, 192), torch.zeros(8, 1, 192), torch.zeros(8, 1, 128)
    plan = op.bwd_plan(q, k, v)
    assert (plan.dkdv, plan.dq) == (DKDV[(192, 128)], DQ[(192, 128)]) and op.fuses_delta(plan, None)


@pytest.mark.parametrize("dims", DIMS)
def test_shared_memory_fits_and_the_counts_add_up(dims):
    d, dv = dims
    dkdv, dq = DKDV[_key(dims)], DQ[_key(dims)]
    assert launch_sm90_bwd_parts.dq_parts_shared_bytes(dq, d, dv, delta_from_o=True) == (
        (dq.block_m * (d + 2 * dv) + dq.stages * dq.block_n * (d + dv)) * 2 + 8 * (dq.block_m // 64 + 2 * dq.stages))
    # O's tile is in shared memory only where the dQ pass computes delta (`op.fuses_delta`)
    assert launch_sm90_bwd_parts.dq_parts_shared_bytes(dq, d, dv, delta_from_o=dq.fused_delta) <= 227 * 1024
    if dkdv.key_split:  # its formula and limit: tests/test_gluon_ksplit.py
        assert launch_sm90_ksplit.ksplit_resources(dkdv, d, dv)["ctas_per_sm"] == 1
        return
    consumers = dkdv.block_n // 64
    assert launch_sm90_bwd_parts.dkdv_parts_shared_bytes(dkdv, d, dv) == (
        (dkdv.block_n + dkdv.stages * dkdv.block_m) * (d + dv) * 2
        + 4 * (2 * dkdv.stages * dkdv.block_m + consumers * dkdv.block_m) + 8 * (consumers + 2 * dkdv.stages))
    assert launch_sm90_bwd_parts.dkdv_parts_shared_bytes(dkdv, d, dv) <= 227 * 1024
    res = launch_sm90_bwd_parts.dkdv_parts_resources(dkdv, d, dv)
    assert res["producer_regs"] == launch_sm90_bwd_parts.PARTS_PRODUCER_REGS and res["consumer_regs"] >= 232


def test_only_the_new_dims_take_the_part_kernels():
    assert not any(launch_sm90_bwd_parts.in_parts(d, d) for d in (64, 128, 256))
    assert all(launch_sm90_bwd_parts.in_parts(*dims) for dims in DIMS)


class _Recording:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _tensors(dims, heads=(8, 2), rows=512):
    (d, dv), (hq, hkv) = dims, heads
    z = torch.zeros
    return (z(rows, hq, d, dtype=torch.bfloat16), z(rows, hkv, d, dtype=torch.bfloat16),
            z(rows, hkv, dv, dtype=torch.bfloat16), z(rows, hq, dv, dtype=torch.bfloat16), z(hq, rows), z(hq, rows))


def _check_parts(descs, names_rows_dims):
    for i, (rows, dim) in enumerate(names_rows_dims):
        hi = 1 << (dim.bit_length() - 1)
        lo = descs[len(names_rows_dims) + i]
        assert descs[i].block_shape == [rows, hi]
        assert (lo is None) == (hi == dim) and (lo is None or lo.block_shape == [rows, dim - hi])


@pytest.mark.parametrize("dims", PART_DKDV_DIMS)
@pytest.mark.parametrize("tree", [False, True], ids=["varlen", "tree"])
def test_dkdv_launch_passes_the_parts(dims, tree, monkeypatch):
    from packattn.ops.varlen import bwd_dkdv_sm90_parts

    arg_names = bwd_dkdv_sm90_parts.varlen_bwd_dkdv_parts_kernel.arg_names
    kernel = _Recording()
    monkeypatch.setattr(bwd_dkdv_sm90_parts, "varlen_bwd_dkdv_parts_kernel", kernel)
    cfg = DKDV[_key(dims)]
    q, k, v, dout, lse, delta = _tensors(dims)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    key_end = torch.zeros(512, dtype=torch.int32) if tree else None
    launch_sm90.gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, torch.zeros(10, 6, dtype=torch.int32), seq_args, 0.1,
                           Mask.make(True), cfg, key_end=key_end)
    ((grid, args, kwargs),) = kernel.launches
    assert grid == (10 * 2,)
    _check_parts(args[:8], [(cfg.block_m, dims[0]), (cfg.block_n, dims[0]), (cfg.block_n, dims[1]),
                            (cfg.block_m, dims[1])])
    assert args[10] is dk and args[11] is dv and (args[17] is key_end if tree else True)
    assert kwargs["HEAD_DIM"] == dims[0] and kwargs["HEAD_DIM_V"] == dims[1] and kwargs["TREE"] == tree
    # every argument and constexpr is one the kernel takes, each once
    constexprs = set(kwargs) - {"maxnreg", *COMPILE_OPTIONS}  # (launch options)
    assert len(args) + len(constexprs) == len(arg_names) and constexprs <= set(arg_names)


@pytest.mark.parametrize("dims", DIMS)
def test_dq_launch_passes_the_parts_and_o(dims, monkeypatch):
    from packattn.ops.varlen import bwd_dq_sm90_parts

    kernel = _Recording()
    monkeypatch.setattr(bwd_dq_sm90_parts, "varlen_bwd_dq_parts_kernel", kernel)
    cfg = DQ[_key(dims)]
    q, k, v, dout, lse, delta = _tensors(dims)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    dq, out = torch.empty_like(q), torch.zeros_like(dout)
    launch_sm90.gluon_dq(q, k, v, dout, lse, delta, dq, torch.zeros(10, 6, dtype=torch.int32), seq_args, 0.1,
                         Mask.make(True), cfg, out=out)
    ((grid, args, kwargs),) = kernel.launches
    assert grid == (10 * 8,) and kwargs["DELTA_FROM_O"] and args[12] is dq and args[11] is delta
    _check_parts(args[:10], [(cfg.block_m, dims[0]), (cfg.block_n, dims[0]), (cfg.block_n, dims[1]),
                             (cfg.block_m, dims[1]), (cfg.block_m, dims[1])])
    assert kwargs["HEAD_DIM"] == dims[0] and kwargs["HEAD_DIM_V"] == dims[1]


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_part_kernels_compile_for_sm90a_without_spills():
    """One subprocess compiles a few proposed variants (the 96 dK/dV, the MLA dK/dV under the tree mask, two dQ
    computing delta) with `check_gluon_bwd_parts_compile.check`'s checks."""
    jobs = [("dkdv", (96, 96), "R", False), ("dkdv", (192, 128), "tree", True), ("dq", (96, 96), "LR", False),
            ("dq", (128, 64), "C", False)]
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_bwd_parts_compile as c\n"
              f"bad = 0\nfor kernel, dims, mask, tree in {jobs}:\n"
              "    ok, text = c.check(kernel, 'bf16', dims, mask, c.PROPOSED[dims][kernel == 'dq'], tree, True)\n"
              "    bad += not ok\n"
              "    print(text, flush=True)\n"
              "sys.exit(1 if bad else 0)\n")
    stdout = compile_check(script)
    assert stdout.count("overlap OK") == len(jobs) and " 0 bytes spill stores" in stdout


def test_fused_delta_is_a_dq_option():
    """``fused_delta`` (the dQ pass computes delta from O) is refused on a dK/dV config and must be a bool; a dQ
    config without it leaves delta to the preprocess (`op.fuses_delta`), so the ring may use O's shared memory."""
    with pytest.raises(ValueError, match="fused_delta is a dQ option"):
        configs.check_dkdv_config(configs.GluonBwdConfig(64, 64, 2, 4, fused_delta=False))
    for fields in ({"fused_delta": 0}, {"fused_delta": "no"}, {"key_split": 1}):
        with pytest.raises(TypeError, match="key_split and fused_delta must be bools"):
            configs.GluonBwdConfig(128, 64, 2, 8, **fields)
    unfused = configs.GluonBwdConfig(128, 64, 2, 8, fused_delta=False)
    plan = op.BwdPlan(configs.DKDV_CONFIGS[192], unfused, (64, 64, True), (128, 64, True))
    assert not op.fuses_delta(plan, None)
    assert op.fuses_delta(op.BwdPlan(configs.DKDV_CONFIGS[192], configs.DQ_CONFIGS[96], (64, 64, True),
                                     (128, 64, True)), None)
