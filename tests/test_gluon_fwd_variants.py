"""The Gluon forward's opt-in softmax variants (`configs.GluonConfig.rescale_threshold`: lazy rescaling;
``poly_exp2``: part of the exp2 on the FMA pipe), without a GPU: the config's validation, the polynomial exp2's
accuracy (the shipped PTX constants, evaluated in float32 as the GPU does), the launcher's constexprs, and (in a
subprocess, for sm_90a) one opt-in kernel compiled with `scripts/check_gluon_compile.py`'s checks."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sm90_compile import compile_check

from packattn.mask import Mask
from packattn.ops.runtime import sm90, support
from packattn.ops.varlen import launch_sm90
from packattn.ops.varlen.common_sm90 import _exp2_asm
from packattn.ops.varlen.configs import CONFIGS, GluonConfig



@pytest.mark.parametrize("fields", [{"rescale_threshold": -1.0}, {"rescale_threshold": 16}, {"rescale_threshold": True},
                                    {"rescale_threshold": "8"}, {"poly_exp2": 5}, {"poly_exp2": True},
                                    {"poly_exp2": 1.5}])
def test_bad_opt_in_fields_are_refused(fields):
    with pytest.raises(ValueError, match="rescale_threshold|poly_exp2"):
        GluonConfig(128, 128, 4, 8, **fields)


def test_opt_in_fields_default_off_and_keep_configs_hashable():
    cfg = GluonConfig(128, 32, 3, 8)
    assert cfg.rescale_threshold is None and cfg.poly_exp2 == 0
    lazy = GluonConfig(128, 32, 3, 8, rescale_threshold=8, poly_exp2=2)
    assert len({cfg, lazy, GluonConfig(128, 32, 3, 8)}) == 2


def _poly_exp2(x: np.ndarray, asm: str) -> np.ndarray:
    """The first (FMA-pipe) element of `_exp2_asm`'s PTX, step by step in float32 (its hex constants parsed)."""
    block = asm.splitlines()[0]
    consts = [np.uint32(int(h, 16)).view(np.float32) for h in re.findall(r"0f([0-9A-F]{8})", block)]
    low, magic, magic2, c3, c2, c1, c0 = consts
    assert magic == magic2 and c0 == 1.0 and low == -127.0
    t = np.maximum(x.astype(np.float32), low)
    j = (t + magic).astype(np.float32)
    f = (t - (j - magic).astype(np.float32)).astype(np.float32)
    p = (f.astype(np.float64) * c3 + c2).astype(np.float32)  # fma: exact product, one rounding
    p = (p.astype(np.float64) * f + c1).astype(np.float32)
    p = (p.astype(np.float64) * f + c0).astype(np.float32)
    bits = p.view(np.uint32) + (j.view(np.uint32) << np.uint32(23))
    return bits.view(np.float32)


def test_polynomial_exp2_is_accurate_far_below_bf16_rounding():
    asm = _exp2_asm(2)
    lines = asm.splitlines()
    assert len(lines) == 4 and lines[0].startswith("{") and lines[1].startswith("{")
    assert lines[2] == "ex2.approx.ftz.f32 $2, $6;" and lines[3] == "ex2.approx.ftz.f32 $3, $7;"
    x = np.concatenate([np.linspace(-126.0, 15.0, 400001), np.arange(-126, 16) + 0.5,
                        np.arange(-126, 16, dtype=np.float64)]).astype(np.float32)
    got = _poly_exp2(x, asm).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 2.0 ** -13  # bf16 keeps 8 bits: P's own rounding is 2^-9 relative
    ints = np.arange(-126, 16, dtype=np.float32)
    assert np.array_equal(_poly_exp2(ints, asm), np.exp2(ints))  # p(0) = 1: exact powers of two
    # a row that sees no key: S = -inf gives P = 0 exactly (and so does anything at or below -127)
    assert np.all(_poly_exp2(np.array([-np.inf, -127.0, -200.0, -3e38], dtype=np.float32), asm) == 0.0)
    assert np.all(np.diff(_poly_exp2(np.linspace(-20, 10, 100001).astype(np.float32), asm)) >= 0)  # monotone


class _Recording:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("cfg,want", [(CONFIGS[64], (None, 0)),
                                      (GluonConfig(128, 128, 4, 8, rescale_threshold=8, poly_exp2=1), (8.0, 1))])
def test_forward_launch_passes_the_opt_in_constexprs(cfg, want, monkeypatch):
    from packattn.ops.varlen import fwd_sm90

    kernel = _Recording()
    monkeypatch.setattr(fwd_sm90, "varlen_fwd_gluon_ws_kernel", kernel)
    monkeypatch.setattr(sm90, "_num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q, k = torch.zeros(512, 8, 64, dtype=torch.bfloat16), torch.zeros(512, 2, 64, dtype=torch.bfloat16)
    out, lse = torch.empty(512, 8, 64, dtype=torch.bfloat16), torch.empty(8, 512)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    launch_sm90.gluon_fwd(q, k, k, out, lse, seq_args, torch.zeros(10, 6, dtype=torch.int32), 0.1, Mask.make(True),
                          cfg)
    ((_grid, _args, kwargs),) = kernel.launches
    assert (kwargs["RESCALE_THRESHOLD"], kwargs["POLY_EXP2"]) == want
    assert want[0] is None or isinstance(kwargs["RESCALE_THRESHOLD"], float)


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_an_opt_in_variant_compiles_for_sm90a_without_spills():
    """Lazy rescaling and one exp2 of 4 on the FMA pipe at d = 64 (the causal mask): compiles, no spills, the
    softmax still overlaps the PV wgmma, and the rescale's warp-group reduction adds no CTA-wide barrier to the
    main loop (`check_gluon_compile.check_variant`)."""
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_compile as c\n"
              "problem, text = c.check_variant('bf16', (64, 64), 'R', '128,128,4,8,lazy=8,poly=1')\n"
              "print(text, flush=True)\n"
              "sys.exit(1 if problem else 0)\n")
    stdout = compile_check(script, timeout=120)
    assert "overlap OK" in stdout and " 0 bytes spill stores" in stdout
    mains = [line for line in stdout.splitlines() if "kind=main" in line]
    assert len(mains) == 2 and all("cta_bar=0" in line for line in mains)
