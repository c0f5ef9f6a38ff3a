"""The Gluon forward's lazy rescaling (`configs.GluonConfig.rescale_threshold`), without a GPU: the config's
validation, the launcher's constexpr, and (in a subprocess, for sm_90a) one lazy kernel compiled with
`scripts/check_gluon_compile.py`'s checks."""

from __future__ import annotations

import pytest
import torch

from sm90_compile import compile_check

from packattn.mask import Mask
from packattn.ops.runtime import sm90, support
from packattn.ops.varlen import launch_sm90
from packattn.ops.varlen.configs import CONFIGS, GluonConfig


@pytest.mark.parametrize("fields", [{"rescale_threshold": -1.0}, {"rescale_threshold": 16}, {"rescale_threshold": True},
                                    {"rescale_threshold": "8"}])
def test_bad_rescale_thresholds_are_refused(fields):
    with pytest.raises(ValueError, match="rescale_threshold"):
        GluonConfig(128, 128, 4, 8, **fields)


def test_rescale_threshold_defaults_off_and_keeps_configs_hashable():
    cfg = GluonConfig(128, 32, 3, 8)
    assert cfg.rescale_threshold is None
    lazy = GluonConfig(128, 32, 3, 8, rescale_threshold=8)
    assert len({cfg, lazy, GluonConfig(128, 32, 3, 8)}) == 2


class _Recording:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("cfg,want", [(CONFIGS[64], None), (GluonConfig(128, 128, 4, 8, rescale_threshold=8), 8.0)])
def test_forward_launch_passes_the_rescale_threshold(cfg, want, monkeypatch):
    from packattn.ops.varlen import fwd_sm90

    params = set(fwd_sm90.varlen_fwd_gluon_ws_kernel.arg_names)
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
    assert kwargs["RESCALE_THRESHOLD"] == want
    assert set(kwargs) - {"maxnreg"} <= params  # every constexpr the launcher passes is one the kernel takes
    assert want is None or isinstance(kwargs["RESCALE_THRESHOLD"], float)


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_lazy_rescaling_compiles_for_sm90a_without_spills():
    """Lazy rescaling at d = 64 (the causal mask): compiles, no spills, the softmax still overlaps the PV wgmma,
    and the rescale's warp-group reduction adds no CTA-wide barrier to the main loop
    (`check_gluon_compile.check_variant`)."""
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_compile as c\n"
              "problem, text = c.check_variant('bf16', (64, 64), 'R', '128,128,4,8,lazy=8')\n"
              "print(text, flush=True)\n"
              "sys.exit(1 if problem else 0)\n")
    stdout = compile_check(script, timeout=120)
    assert "overlap OK" in stdout and " 0 bytes spill stores" in stdout
    mains = [line for line in stdout.splitlines() if "kind=main" in line]
    assert len(mains) == 2 and all("cta_bar=0" in line for line in mains)
