"""Host-side rules of the Gluon launchers that need no GPU: the head-section work order, the config
strings of the forward / backward kernels, and the TMA descriptors built without re-validation."""

from __future__ import annotations

import pytest
import torch

from packattn.backends import triton_bwd_gluon as tb
from packattn.backends import triton_fwd_gluon as tg


@pytest.mark.parametrize("heads_kv", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 7])
@pytest.mark.parametrize("env", ["", "0", "1", "2", "3", "5", "64"])
def test_head_sections_tile_the_heads(heads_kv, group, env, monkeypatch):
    monkeypatch.setenv(tg.ENV_HEAD_SECTION, env)
    heads_q = heads_kv * group
    per = tg.heads_per_section(heads_q, group)
    # whole kv-head groups, and sections that tile the heads exactly (the kernels' decode relies on it)
    assert per % group == 0 and heads_q % per == 0 and group <= per <= heads_q
    wanted = tg.HEAD_SECTION if env == "" else int(env)
    if wanted <= 0 or wanted >= heads_kv:
        assert per == heads_q
    else:
        assert per // group <= wanted  # rounded down to a divisor of the kv heads, never up


def test_head_section_env_must_be_a_number(monkeypatch):
    monkeypatch.setenv(tg.ENV_HEAD_SECTION, "two")
    with pytest.raises(ValueError, match="PACKATTN_GLUON_HEAD_SECTION"):
        tg.heads_per_section(16, 1)


def test_forward_config_strings_round_trip_and_pingpong_rules():
    for text in ("128,128,3,8", "128,128,3,8,ws,persistent,direct", "128,128,3,8,ws,persistent,direct,pingpong"):
        assert tg.parse_config(text).label() == text
    with pytest.raises(ValueError, match="need warp_specialize"):
        tg.GluonConfig(128, 128, 3, 8, pingpong=True)
    with pytest.raises(ValueError, match="two consumer warp groups"):
        tg.GluonConfig(64, 64, 3, 4, warp_specialize=True, pingpong=True)
    with pytest.raises(ValueError, match="unknown flag"):
        tg.parse_config("128,128,3,8,ws,ping")


def test_backward_config_strings_round_trip_and_persistent_needs_ws():
    for text in ("32,128,4,8", "64,128,2,8,ws", "64,128,2,8,ws,persistent"):
        assert tb.parse_config(text).label() == text
    for bad in ("64,128,2,8,persistent", "64,128,2,8,ws,fast", "64,128,2"):
        with pytest.raises(ValueError, match="expected block_m,block_n,stages,num_warps"):
            tb.parse_config(bad)


def _fields(desc) -> dict:
    return {name: getattr(desc, name) for name in tg._DESCRIPTOR_FIELDS}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,d,block", [(300, 4, 128, 128), (17, 1, 64, 64), (1, 2, 128, 64)])
def test_fast_descriptor_equals_the_validated_one(rows, heads, d, block, dtype):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x = torch.randn(rows, heads, d).to(dtype)
    fast = tg._descriptor(x, block)
    slow = TensorDescriptor(x, [rows, heads * d], [heads * d, 1], [block, d], tg.smem_layout([block, d], dtype))
    assert type(fast) is TensorDescriptor
    assert _fields(fast) == _fields(slow)


def test_descriptor_copies_what_tma_cannot_read():
    x = torch.randn(40, 8, 64, dtype=torch.float16)[:, ::2]  # heads not packed: not a 2-D TMA view
    desc = tg._descriptor(x, 64)
    assert desc.base.is_contiguous() and torch.equal(desc.base, x)
    assert desc.shape == [40, 4 * 64] and desc.strides == [4 * 64, 1]
