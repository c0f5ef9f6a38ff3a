"""Where the sm_90 Gluon kernels run, on CPU: the one rule `sm90.sm90_runs` (tensors that say they are on a
9.x CUDA device), the head dims each family declares against its tables, and the tree's dQ blocks (its own
decision, not the varlen Triton dQ's)."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.ops.runtime import sm90, support
from packattn.ops.runtime.launch import LaunchConfig
from packattn.ops.tree import configs as tree_configs
from packattn.ops.tree import tables as tree_tables
from packattn.ops.varlen import configs

VARLEN = (configs.GLUON_HEAD_DIMS, configs.GLUON_DTYPES)


class _Cuda:
    """A CPU tensor that says it lives on CUDA device 0: what `sm90_runs` and the configs read of a tensor."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor, data_ptr: int | None = None):
        self.t, self.dtype, self.shape = t, t.dtype, t.shape
        self._ptr = t.data_ptr() if data_ptr is None else data_ptr

    def dim(self):
        return self.t.dim()

    def stride(self, *dim):
        return self.t.stride(*dim)

    def element_size(self):
        return self.t.element_size()

    def data_ptr(self):
        return self._ptr


def _qkv(d=128, heads=(4, 2), dtype=torch.bfloat16, rows=8):
    """q, k, v at head dim ``d`` (an int, or an MLA key ``(d, d_v)`` of the tables)."""
    d, d_v = (d, d) if isinstance(d, int) else d
    q = _Cuda(torch.zeros(rows, heads[0], d, dtype=dtype))
    k = _Cuda(torch.zeros(rows, heads[1], d, dtype=dtype))
    return q, k, _Cuda(torch.zeros(rows, heads[1], d_v, dtype=dtype))


@pytest.fixture
def hopper(monkeypatch):
    """A 9.x CUDA device 0 with the sm_90 kernels on (not the interpreter, not PACKATTN_PORTABLE); set
    ``hopper[0]`` to change the capability."""
    capability = [(9, 0)]
    monkeypatch.setattr(sm90, "_capability", lambda index: capability[0])
    monkeypatch.setattr(support, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # launch_config's Hopper tables
    monkeypatch.setattr(configs, "_is_hopper", lambda index: capability[0][0] == 9)
    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    return capability


# ---------------------------------------------------------------- sm90_runs: the one rule
def test_sm90_runs_on_hopper_16_bit_declared_head_dims(hopper):
    for d in configs.GLUON_HEAD_DIMS:
        for dtype in configs.GLUON_DTYPES:
            assert sm90.sm90_runs(*_qkv(d, dtype=dtype), True, *VARLEN)
            assert sm90.sm90_runs(*_qkv(d, dtype=dtype), False, *VARLEN)


def test_sm90_runs_not_portable_interpreter_other_gpus_or_cpu(hopper, monkeypatch):
    qkv = _qkv()
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert not sm90.sm90_runs(*qkv, False, *VARLEN)
    monkeypatch.delenv("PACKATTN_PORTABLE")
    monkeypatch.setattr(support, "interpreting", lambda: True)
    assert not sm90.sm90_runs(*qkv, False, *VARLEN)
    monkeypatch.setattr(support, "interpreting", lambda: False)
    for capability in ((8, 0), (10, 0), (0, 0)):  # (0, 0): `_capability` where the Gluon kernels are off
        hopper[0] = capability
        assert not sm90.sm90_runs(*qkv, False, *VARLEN)
    hopper[0] = (9, 0)
    assert sm90.sm90_runs(*qkv, False, *VARLEN)
    cpu = [x.t for x in qkv]
    assert not sm90.sm90_runs(*cpu, False, *VARLEN)
    assert not sm90.sm90_runs(_Cuda(cpu[0][None]), qkv[1], qkv[2], False, *VARLEN)  # 4-D q


def test_sm90_runs_takes_dtypes_and_head_dims_from_the_caller(hopper):
    for dtype in (torch.float32, torch.float64):
        assert not sm90.sm90_runs(*_qkv(dtype=dtype), False, *VARLEN)
    q, k, v = _qkv(dtype=torch.bfloat16)
    assert not sm90.sm90_runs(q, _qkv(dtype=torch.float16)[1], v, False, *VARLEN)  # mixed dtypes
    assert not sm90.sm90_runs(*_qkv(32), False, *VARLEN)
    assert sm90.sm90_runs(*_qkv(96), False, (96,), configs.GLUON_DTYPES)  # the caller's head dims decide
    assert not sm90.sm90_runs(*_qkv(128), False, (96,), configs.GLUON_DTYPES)
    assert not sm90.sm90_runs(*_qkv(128), False, configs.GLUON_HEAD_DIMS, (torch.float16,))
    q64 = _qkv(64)[0]
    assert not sm90.sm90_runs(q64, k, v, False, *VARLEN)  # q and k / v head dims differ
    assert sm90.sm90_runs(q, k, _qkv(64, dtype=torch.bfloat16)[2], False, *VARLEN)  # MLA 128/64: a key (d, d_v)
    assert not sm90.sm90_runs(q, k, _qkv(96, dtype=torch.bfloat16)[2], False, *VARLEN)  # 128/96: Triton kernels


@pytest.mark.parametrize("heads,runs", [((4, 2), True), ((8, 1), True), ((4, 4), True), ((6, 4), False),
                                        ((3, 2), False)])
def test_sm90_runs_needs_whole_gqa_groups(hopper, heads, runs):
    assert sm90.sm90_runs(*_qkv(heads=heads), False, *VARLEN) is runs


def test_sm90_runs_with_tma_needs_tma_readable_strides(hopper):
    """With ``tma`` each tensor must be a TMA ``(rows, heads * d)`` matrix as it is (16-byte aligned base and row
    stride, heads and d packed); without, the answer ignores strides (the launchers copy)."""
    q, k, v = _qkv()
    wide = _Cuda(torch.zeros(8, 4, 256, dtype=torch.bfloat16)[..., :128])  # heads not packed
    misaligned = _Cuda(q.t, data_ptr=q.t.data_ptr() + 2)
    odd_rows = _Cuda(torch.zeros(8, 4 * 128 + 1, dtype=torch.bfloat16)[:, :512].view(8, 4, 128))  # row stride 513
    for bad in (wide, misaligned, odd_rows):
        assert not sm90.sm90_runs(bad, k, v, True, *VARLEN)
        assert sm90.sm90_runs(bad, k, v, False, *VARLEN)
    assert sm90.sm90_runs(q, k, v, True, *VARLEN)


def test_sm90_kernels_off_says_why(monkeypatch):
    """`support.sm90_kernels_off`: the part of the rule that holds for every call (what dispatch asks)."""
    monkeypatch.setattr(support, "interpreting", lambda: False)
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: None)
    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    assert support.sm90_kernels_off() is None
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert "PACKATTN_PORTABLE" in support.sm90_kernels_off()
    monkeypatch.delenv("PACKATTN_PORTABLE")
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: "Gluon kernels off: test reason")
    assert support.sm90_kernels_off() == "Gluon kernels off: test reason"
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: None)
    monkeypatch.setattr(support, "interpreting", lambda: True)
    assert "interpreter" in support.sm90_kernels_off()


# ---------------------------------------------------------------- each family's head dims against its tables
def test_every_varlen_gluon_table_covers_the_declared_head_dims():
    dims, fwd_dims = set(configs.GLUON_HEAD_DIMS), set(configs.GLUON_FWD_HEAD_DIMS)
    assert dims <= fwd_dims
    for table in (configs.CONFIGS, configs.LONG_CONFIGS):
        assert set(table) == fwd_dims
    assert set(configs.DQ_CONFIGS) == dims
    for table in configs.fwd_tables().values():
        assert set(table) <= fwd_dims
    for table in (configs.DKDV_CONFIGS, configs.DKDV_GQA_CONFIGS, configs.DQ_SHORT_CONFIGS):
        assert set(table) <= dims
    for key in configs.GLUON_FWD_HEAD_DIMS:  # every lookup the plans make answers
        for long_seqs, short_seqs in ((False, False), (True, False), (False, True)):
            for masked in (False, True):  # an entry of one of the forward tables at this key
                entries = [t[key] for t in configs.fwd_tables().values() if key in t]
                assert configs.config_for(key, long_seqs, short_seqs, masked=masked) in entries
    for d in configs.GLUON_HEAD_DIMS:
        assert configs.dq_config(d) is not None and configs.dq_config(d, short_seqs=True) is not None
    assert set(configs.GLUON_DTYPES) <= set(configs.DTYPES)
    assert {k if isinstance(k, int) else k[0] for k in fwd_dims} <= set(configs.HEAD_DIMS)


@pytest.mark.parametrize("d,d_v,fwd,bwd", [(192, 128, True, True), (128, 64, True, True), (96, 96, True, True),
                                           (192, 192, True, True), (256, 256, True, True), (256, 128, False, False),
                                           (32, 32, False, False), (128, 96, False, False)])
def test_forward_and_backward_gluon_head_dims(hopper, d, d_v, fwd, bwd):
    """The forward's Gluon head dims (`GLUON_FWD_HEAD_DIMS`, MLA pairs by `sm90.dims_key`) and the backward's
    (`GLUON_HEAD_DIMS`); other pairs run the Triton kernels."""
    q, k = (_Cuda(torch.zeros(8, 4, d, dtype=torch.bfloat16)) for _ in range(2))
    v = _Cuda(torch.zeros(8, 4, d_v, dtype=torch.bfloat16))
    assert sm90.sm90_runs(q, k, v, False, configs.GLUON_FWD_HEAD_DIMS, configs.GLUON_DTYPES) is fwd
    assert sm90.sm90_runs(q, k, v, False, configs.GLUON_HEAD_DIMS, configs.GLUON_DTYPES) is bwd
    assert sm90.dims_key(d, d_v) in configs.CONFIGS or not fwd  # the forward tables' key of these dims


def test_every_tree_gluon_table_covers_the_declared_head_dims():
    assert set(tree_configs.TREE_FWD_CONFIGS) == set(tree_configs.GLUON_HEAD_DIMS)
    assert set(tree_configs.TREE_DQ_CONFIGS) <= set(tree_configs.GLUON_HEAD_DIMS)
    assert set(tree_configs.GLUON_DTYPES) <= set(configs.DTYPES)


@pytest.mark.parametrize("values", [{"CONFIGS": {128: configs.CONFIGS[128]}},  # d = 64 lost: the plans would fail
                                    {"DQ_CONFIGS": {**configs.DQ_CONFIGS, 32: configs.DQ_CONFIGS[128]}},  # ignored
                                    {"GLUON_HEAD_DIMS": (32, 64, 128)},  # no configs for 32
                                    {"DKDV_CONFIGS": {32: configs.DKDV_CONFIGS[128]}},
                                    {"SHORT_MASKED_CONFIGS": {32: configs.CONFIGS[64]}},  # not a head dim
                                    {"SHORT_MASKED_CONFIGS": {128: configs.CONFIGS[128]}}])  # shadowed: ignored
def test_varlen_override_refuses_tables_off_the_declared_head_dims(values):
    with pytest.raises(ValueError, match="head dims"):
        with configs.override(**values):
            pass
    assert 96 in configs.GLUON_HEAD_DIMS and set(configs.CONFIGS) == set(configs.GLUON_FWD_HEAD_DIMS)  # restored


def test_tree_override_refuses_tables_off_the_declared_head_dims():
    with pytest.raises(ValueError, match="head dims"):
        with tree_configs.override(TREE_FWD_CONFIGS={128: tree_configs.TREE_FWD_CONFIGS[128]}):
            pass
    with pytest.raises(ValueError, match="head dims"):
        with tree_configs.override(TREE_DQ_CONFIGS={96: tree_configs.TREE_DQ_CONFIGS[128]}):
            pass
    assert set(tree_configs.TREE_FWD_CONFIGS) == {64, 128, 256}


# ---------------------------------------------------------------- the tree's dQ: its own kernel and blocks
@pytest.mark.parametrize("d,gluon", [(128, True), (64, False)])
def test_tree_dq_blocks_pinned(hopper, monkeypatch, d, gluon):
    """On Hopper the tree dQ runs the Gluon kernel at d = 128 and the Triton one at d = 64, both over 128 x 64
    tiles; PACKATTN_PORTABLE=1 gives the Triton one with the same blocks."""
    qkv = _qkv(d)
    cfg = tree_configs.tree_dq_config(*qkv)
    assert (cfg is not None) is gluon
    if gluon:
        assert cfg == configs.GluonBwdConfig(128, 64, 4, 8)
    assert tree_configs.dq_blocks(*qkv) == (128, 64)
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert tree_configs.tree_dq_config(*qkv) is None
    assert tree_configs.dq_blocks(*qkv) == (128, 64)


def test_tree_dq_does_not_follow_the_varlen_triton_dq_tile(hopper, monkeypatch):
    """A change of the Triton dQ tile (varlen's `HOPPER_CONFIGS`) leaves the Gluon tree dQ and its tables as
    they are; the Triton tree dQ (and its tables) take the new tile."""
    qkv = _qkv(128)
    table = {**configs.HOPPER_CONFIGS, ("dq", 128): LaunchConfig(64, 32, 4, 2)}
    with configs.override(HOPPER_CONFIGS=table):
        assert tree_configs.tree_dq_config(*qkv) == tree_configs.TREE_DQ_CONFIGS[128]
        assert tree_configs.dq_blocks(*qkv) == (128, 64)
        monkeypatch.setenv("PACKATTN_PORTABLE", "1")
        assert tree_configs.dq_blocks(*qkv) == (64, 32)


def test_tree_tables_build_the_dq_tables_with_dq_blocks(monkeypatch):
    """`tree_tables` builds the dQ query tables with `configs.dq_blocks` (the kernel that runs decides)."""
    built = []
    build = tree_tables.build_query_tiles

    def recording(key_end, total, block_m, block_n):
        built.append((block_m, block_n))
        return build(key_end, total, block_m, block_n)

    monkeypatch.setattr(tree_tables, "build_query_tiles", recording)
    monkeypatch.setattr(tree_configs, "fwd_blocks", lambda q, k, v: (16, 16))
    monkeypatch.setattr(tree_configs, "dq_blocks", lambda q, k, v: (32, 8))
    tree = packattn.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 9], [7]])
    q = torch.zeros(tree.total, 2, 32)
    tables = tree_tables.tree_tables(tree, q, q, q, need_grad=True)
    assert built == [(16, 16), (32, 8)]
    assert tables[3].shape[0] == -(-tree.total // 32)  # one dQ tile per 32 rows
