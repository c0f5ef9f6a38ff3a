"""The Gluon forward at head dims in two column parts (96, 192) and with a value head dim of its own (MLA 192/128,
128/64), without a GPU: the launcher's descriptors and arguments (a recording kernel), its shared memory and
register split, and (in a subprocess, for sm_90a) the compiled kernels: no spills, shared memory that fits, the
softmax overlapping a wgmma in flight (`scripts/check_gluon_compile.py`)."""

from __future__ import annotations


import pytest
import torch

from sm90_compile import compile_check

from packattn.mask import Mask
from packattn.ops.runtime import sm90, support
from packattn.ops.varlen import configs, launch_sm90, launch_sm90_bwd_parts
from packattn.ops.varlen.configs import GluonConfig

# (q/k, v) head dims -> the config proposed for them (the tables' own entry once `configs` has one)
PROPOSED = {(96, 96): GluonConfig(128, 128, 4, 8), (192, 192): GluonConfig(128, 64, 3, 8),
            (192, 128): GluonConfig(128, 64, 4, 8), (128, 64): GluonConfig(128, 128, 4, 8)}


def _config(dims: tuple[int, int]) -> GluonConfig:
    key = dims[0] if dims[0] == dims[1] else dims
    return configs.CONFIGS.get(key, PROPOSED[dims])


def _fields(desc) -> dict:
    return {name: getattr(desc, name) for name in sm90._DESCRIPTOR_FIELDS}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,hi", [(96, 64), (192, 128), (80, 64)])
def test_part_descriptors_read_two_column_parts_of_one_view(d, hi, dtype):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x = torch.randn(300, 3, d).to(dtype)
    first, second = launch_sm90.part_descriptors(x, 64)
    for desc, width in ((first, hi), (second, d - hi)):
        assert desc.base is x and desc.shape == [300, 3 * d] and desc.strides == [3 * d, 1]
        assert desc.block_shape == [64, width]
        checked = TensorDescriptor(x, [300, 3 * d], [3 * d, 1], [64, width], sm90._smem_layout((64, width), dtype))
        assert _fields(desc) == _fields(checked)


def test_part_descriptors_share_one_copy_and_leave_powers_of_two_alone():
    x = torch.randn(50, 4, 2 * 192).to(torch.bfloat16)[:, :, :192]  # heads not packed: TMA cannot read it
    first, second = launch_sm90.part_descriptors(x, 128)
    assert first.base is second.base and first.base.is_contiguous() and torch.equal(first.base, x)
    y = torch.randn(50, 4, 128).to(torch.bfloat16)
    desc, none = launch_sm90.part_descriptors(y, 128)
    assert none is None and _fields(desc) == _fields(sm90._descriptor(y, 128))


class _Recording:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("dims", list(PROPOSED))
def test_forward_launch_passes_the_parts_and_the_value_head_dim(dims, monkeypatch):
    from packattn.ops.varlen import fwd_sm90

    kernel = _Recording()
    monkeypatch.setattr(fwd_sm90, "varlen_fwd_gluon_ws_kernel", kernel)
    monkeypatch.setattr(sm90, "_num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    (d, dv), cfg = dims, _config(dims)
    q, k = torch.zeros(512, 8, d, dtype=torch.bfloat16), torch.zeros(512, 2, d, dtype=torch.bfloat16)
    v = torch.zeros(512, 2, dv, dtype=torch.bfloat16)
    out, lse = torch.empty(512, 8, dv, dtype=torch.bfloat16), torch.empty(8, 512)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    launch_sm90.gluon_fwd(q, k, v, out, lse, seq_args, torch.zeros(10, 6, dtype=torch.int32), 0.1, Mask.make(True),
                          cfg)
    ((_grid, args, kwargs),) = kernel.launches
    descs = args[:6]  # q, k, v, then their second column parts (None for a power-of-two dim)
    for name, desc, rows, dim in zip("qkv", descs[:3], (cfg.block_m, cfg.block_n, cfg.block_n), (d, d, dv)):
        hi = 1 << (dim.bit_length() - 1)
        lo = descs[3 + "qkv".index(name)]
        assert desc.block_shape == [rows, hi]
        assert (lo is None) == (hi == dim) and (lo is None or lo.block_shape == [rows, dim - hi])
    res = launch_sm90.fwd_resources(cfg, d, dv)
    assert kwargs["HEAD_DIM"] == d and kwargs["HEAD_DIM_V"] == dv and args[6] is out
    assert kwargs["PRODUCER_REGS"] == res["producer_regs"] == launch_sm90_bwd_parts.PARTS_PRODUCER_REGS
    assert kwargs["CONSUMER_REGS"] == res["consumer_regs"] >= 232


def test_shared_memory_counts_q_k_and_v_at_their_own_head_dims():
    cfg = GluonConfig(128, 128, 3, 8)
    assert launch_sm90.shared_bytes(cfg, 128) == launch_sm90.shared_bytes(cfg, 128, head_dim_v=128)
    assert launch_sm90.shared_bytes(cfg, 128) == (128 + 2 * 3 * 128) * 128 * 2 + 8 * 8
    assert launch_sm90.shared_bytes(cfg, 192, head_dim_v=128) == (128 * 192 + 3 * 128 * 320) * 2 + 8 * 8
    for dims in PROPOSED:
        assert launch_sm90.shared_bytes(_config(dims), dims[0], head_dim_v=dims[1]) <= 227 * 1024
    # one power-of-two head dim: the split of before (24 registers for the producer)
    assert launch_sm90.fwd_resources(cfg, 128)["producer_regs"] == sm90.PRODUCER_REGS


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_new_head_dims_compile_for_sm90a_without_spills():
    """One subprocess (Triton's interpreter is on in this one) compiles each dims' config (every field of it)
    under the causal mask and applies `check_gluon_compile.check_variant`'s checks; on Triton 3.9 d = 96's table
    config keeps a few spill accesses in its loop (`configs.RELEASE_FWD_CONFIGS`' comment), so there it need only
    compile and overlap."""
    spills_ok = [(96, 96)] if support.triton_release(support.triton_version()) == "3.9" else []
    jobs = [(dims, repr(_config(dims)), dims in spills_ok) for dims in PROPOSED]
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_compile as c\n"
              "from packattn.ops.varlen.configs import GluonConfig\n"
              f"jobs = {jobs!r}\n"
              "bad = 0\n"
              "for dims, cfg, spills_ok in jobs:\n"
              "    problem, text = c.check_variant('bf16', dims, 'R', c.label_of(eval(cfg)))\n"
              "    bad += problem and not (spills_ok and 'spill accesses' in text)\n"
              "    print(text, flush=True)\n"
              "sys.exit(1 if bad else 0)\n")
    stdout = compile_check(script)
    assert stdout.count("overlap OK") == len(jobs)


def test_a_head_dim_with_no_usable_second_part_is_refused_before_any_kernel():
    with pytest.raises(ValueError, match="112 in no column parts"):
        launch_sm90.part_descriptors(torch.zeros(4, 2, 112, dtype=torch.bfloat16), 64)
