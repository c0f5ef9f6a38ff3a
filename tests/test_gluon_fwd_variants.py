"""The Gluon forward's variants without a GPU -- lazy rescaling (`configs.GluonConfig.rescale_threshold`), separate
K / V ring barriers (`split_kv`) and Q in registers (`q_in_regs`): the config's validation, the launcher's
constexprs, shared memory and refusals, and (in a subprocess, for sm_90a) kernels compiled with
`scripts/check_gluon_compile.py`'s checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sm90_compile import compile_check

from packattn.mask import Mask
from packattn.ops.runtime import sm90, support
from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS
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


def test_variant_flags_are_validated_and_split_kv_counts_its_barriers():
    for fields in ({"split_kv": 1}, {"q_in_regs": "yes"}, {"vec_store": None}):
        with pytest.raises(TypeError, match="split_kv, q_in_regs and vec_store must be bools"):
            GluonConfig(128, 64, 2, 8, **fields)
    one, split = GluonConfig(128, 64, 2, 8), GluonConfig(128, 64, 2, 8, split_kv=True)
    # Q + the ring + q_bar / q_empty and one ready / empty pair per slot, twice as many with split_kv
    assert launch_sm90.shared_bytes(one, 256) == (128 + 2 * 2 * 64) * 256 * 2 + 8 * (2 + 2 * 2)
    assert launch_sm90.shared_bytes(split, 256) == launch_sm90.shared_bytes(one, 256) + 8 * 2 * 2
    assert CONFIGS[256].split_kv and not any(CONFIGS[d].split_kv for d in (64, 96, 192))
    assert CONFIGS[128].split_kv == (support.triton_release(support.triton_version()) == "3.9")


@pytest.mark.parametrize("cfg,want,split", [(CONFIGS[64], None, False),
                                            (GluonConfig(128, 128, 4, 8, rescale_threshold=8), 8.0, False),
                                            (GluonConfig(128, 128, 2, 8, split_kv=True), None, True),
                                            (GluonConfig(128, 128, 2, 8, q_in_regs=True), None, False)])
def test_forward_launch_passes_the_variant_constexprs(cfg, want, split, monkeypatch):
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
    assert kwargs["RESCALE_THRESHOLD"] == want and kwargs["SPLIT_KV"] is split and kwargs["Q_REGS"] is cfg.q_in_regs
    # every constexpr the launcher passes is one the kernel takes (the rest are launch options)
    assert set(kwargs) - {"maxnreg", *COMPILE_OPTIONS} <= params
    assert want is None or isinstance(kwargs["RESCALE_THRESHOLD"], float)


def _main_loops(dims, config: str, timeout: int) -> list[str]:
    """Compile the forward at ``dims`` (causal) with ``config`` for sm_90a in a subprocess
    (`check_gluon_compile.check_variant`), assert no spills and the softmax overlapping PV, and return the two
    consumers' main-loop lines (their barrier counts)."""
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_compile as c\n"
              f"problem, text = c.check_variant('bf16', {dims!r}, 'R', {config!r})\n"
              "print(text, flush=True)\n"
              "sys.exit(1 if problem else 0)\n")
    stdout = compile_check(script, timeout=timeout)
    assert "overlap OK" in stdout and " 0 bytes spill stores" in stdout
    mains = [line for line in stdout.splitlines() if "kind=main" in line]
    assert len(mains) == 2
    return mains


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_lazy_rescaling_compiles_for_sm90a_without_spills():
    """Lazy rescaling at d = 64 (the causal mask): compiles, no spills, the softmax still overlaps the PV wgmma,
    and the rescale's warp-group reduction adds no CTA-wide barrier to the main loop
    (`check_gluon_compile.check_variant`)."""
    mains = _main_loops((64, 64), "128,128,4,8,lazy=8", timeout=120)
    assert all("cta_bar=0" in line for line in mains)
    # one ring barrier a slot: each main loop waits for its block once and releases it once
    assert all("mbar_wait=1 mbar_arrive=1" in line for line in mains)


def test_vec_store_counts_its_scratch_and_is_refused_where_it_does_not_fit():
    """The 16-byte output stores convert the output inside each warp through a small shared-memory scratch:
    `shared_bytes` counts it (the same at every head dim), the launch passes ``VEC_STORE``, and a config whose shared
    memory it pushes over a CTA's (d = 128 with 3 stages of 128-key blocks) is refused before a kernel compiles."""
    plain, vec = GluonConfig(128, 128, 4, 8), GluonConfig(128, 128, 4, 8, vec_store=True)
    scratch = launch_sm90.VEC_STORE_SCRATCH
    assert launch_sm90.shared_bytes(vec, 64) == launch_sm90.shared_bytes(plain, 64) + scratch
    for dims, cfg in ((96, GluonConfig(128, 128, 3, 8)), (256, GluonConfig(128, 64, 2, 8, split_kv=True))):
        with_vec = dataclasses.replace(cfg, vec_store=True)
        assert launch_sm90.shared_bytes(with_vec, dims) == launch_sm90.shared_bytes(cfg, dims) + scratch
    assert launch_sm90.fwd_variant_constexprs(vec)["VEC_STORE"] is True
    assert launch_sm90.fwd_variant_constexprs(plain)["VEC_STORE"] is False
    assert launch_sm90.fwd_resources(vec, 64)["ctas_per_sm"] == 1
    with pytest.raises(ValueError, match="bytes of shared memory at head dims 128 / 128"):
        launch_sm90.fwd_resources(GluonConfig(128, 128, 3, 8, vec_store=True), 128)


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_vec_store_compiles_to_16_byte_stores():
    """``vec_store`` at d = 64: no spills, the softmax still overlaps PV, and the output leaves in 16-byte vector
    stores (``st.global.v4.b32``, 4 a thread of each consumer) where the default stores 4-byte column pairs."""
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_compile as c\n"
              "for cfg in ('128,128,4,8,vec', '128,128,4,8'):\n"
              "    problem, text = c.check_variant('bf16', (64, 64), 'R', cfg)\n"
              "    print(text, flush=True)\n"
              "    if problem: sys.exit(1)\n"
              "    _, compiled = c.compile_variant('bf16', (64, 64), 'R', c.parse_config(cfg))\n"
              "    print(cfg, 'v4 stores', compiled.asm['ptx'].count('st.global.v4.b32'), flush=True)\n")
    stdout = compile_check(script, timeout=240)
    assert "128,128,4,8,vec v4 stores 8" in stdout and "128,128,4,8 v4 stores 0" in stdout


def test_q_in_registers_is_refused_at_256_only():
    """Q's registers beside d = 256's output accumulator spill: the launcher's resources refuse Q in registers
    wherever a head dim is 256 before a kernel compiles (and the kernel asserts it); a value head dim of its own
    takes it (MLA's table config does, since the proxy fence of v40)."""
    for dims in ((256, 256), (192, 256), (256, 128)):
        with pytest.raises(ValueError, match="q_in_regs needs head dims below 256"):
            launch_sm90.fwd_resources(GluonConfig(128, 64, 2, 8, q_in_regs=True), *dims)
    assert launch_sm90.fwd_resources(GluonConfig(128, 64, 3, 8, q_in_regs=True), 192)["consumer_regs"] >= 232
    for dims in ((192, 128), (128, 64)):
        assert launch_sm90.fwd_resources(GluonConfig(128, 64, 4, 8, q_in_regs=True), *dims)["ctas_per_sm"] >= 1


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
@pytest.mark.parametrize("dims,config", [((256, 256), "128,64,2,8,lazy=8,split"),
                                         ((192, 128), "128,64,4,8,trim,split")])
def test_split_kv_compiles_for_sm90a_without_spills(dims, config):
    """Separate K / V barriers (the d = 256 table config; trimmed in column parts with a value dim of its own, so
    the skip path too): no spills (at d = 256 Q's descriptors are built per S), the softmax overlaps PV, and each
    consumer's main loop waits on two ring barriers (K for S, V for PV) and releases two (one barrier a slot
    waits and releases one: `test_lazy_rescaling_compiles_for_sm90a_without_spills`)."""
    assert all("mbar_wait=2 mbar_arrive=2" in line for line in _main_loops(dims, config, timeout=240))


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
def test_q_in_registers_compiles_for_sm90a_without_spills():
    """Q in registers at d = 192 (two column parts): the table config where it has Q in registers (Triton 3.6),
    else that config with Q in registers (3.9's table keeps Q in shared memory: its ptxas spills the 3.6 one in the
    loop), and the same without: the check's criteria (no spill inside the key-block loop, the softmax overlaps
    PV), and every S product of the SASS takes Q from registers (``HGMMA ... R<a>, gdesc``: only K from shared
    memory) where the shared-memory config's take both operands from descriptors."""
    script = ("import sys; sys.path.insert(0, 'scripts'); import check_gluon_compile as c\n"
              "import dataclasses, tempfile, nvidia_tools\n"
              "t = c.configs.CONFIGS[192]\n"
              "regs = t if t.q_in_regs else dataclasses.replace(t, q_in_regs=True)\n"
              "for cfg in (c.label_of(regs), c.label_of(dataclasses.replace(regs, q_in_regs=False))):\n"
              "    problem, text = c.check_variant('bf16', (192, 192), 'R', cfg)\n"
              "    print(text, flush=True)\n"
              "    if problem: sys.exit(1)\n"
              "    _, compiled = c.compile_variant('bf16', (192, 192), 'R', c.parse_config(cfg))\n"
              "    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:\n"
              "        f.write(compiled.asm['cubin']); f.flush()\n"
              "        sass = nvidia_tools.disassemble(f.name)\n"
              "    s_products = [l for l in sass.splitlines() if 'HGMMA.64x64x16' in l and 'tnspB' not in l]\n"
              "    print(cfg, 'S products', len(s_products), 'with Q in registers',\n"
              "          sum(', R' in l.split('HGMMA')[1].split('gdesc')[0] for l in s_products), flush=True)\n")
    stdout = compile_check(script, timeout=240)
    assert stdout.count("overlap OK") == 2
    counts = [line.split() for line in stdout.splitlines() if " S products " in line]
    (regs_cfg, _, _, n_regs, *_, in_regs), (smem_cfg, _, _, n_smem, *_, smem_in_regs) = counts
    assert "qregs" in regs_cfg and int(n_regs) > 0 and int(in_regs) == int(n_regs)
    assert "qregs" not in smem_cfg and int(n_smem) > 0 and int(smem_in_regs) == 0


@pytest.mark.skipif(support.installed_gluon_unsupported() is not None, reason="the installed Triton has no Gluon")
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_quad_vec_layout_keeps_each_warps_rows_and_gives_each_thread_16_bytes(head_dim):
    """`vec_store`'s layout: every element of a consumer's 64 x d output once; warp w holds rows 16 w ... 16 w + 15
    (the accumulator's), lane 4 i + j rows i and i + 8; each thread's first 8 elements are 8 adjacent columns."""
    from packattn.ops.varlen.common_sm90 import quad_vec_layout

    layout = quad_vec_layout(head_dim)

    def place(bases, index):  # the (row, col) an index of one level adds: XOR of its set bits' bases
        row = col = 0
        for bit, (r, c) in enumerate(bases):
            if index >> bit & 1:
                row, col = row ^ r, col ^ c
        return row, col

    seen = set()
    for warp in range(4):
        for lane in range(32):
            wr, _ = place(layout.warp_bases, warp)
            lr, lc = place(layout.lane_bases, lane)
            regs = [place(layout.reg_bases, reg) for reg in range(1 << len(layout.reg_bases))]
            cells = [(wr ^ lr ^ r, lc ^ c) for r, c in regs]
            assert {row // 16 for row, _ in cells} == {warp}
            assert {row % 16 for row, _ in cells} == {lane // 4, lane // 4 + 8}
            first = cells[:8]
            assert len({row for row, _ in first}) == 1 and sorted(c for _, c in first) == list(range(first[0][1],
                                                                                                  first[0][1] + 8))
            seen.update(cells)
    assert seen == {(r, c) for r in range(64) for c in range(head_dim)}
    for bad in (16, 48, 96):
        with pytest.raises(ValueError, match="not a power of 2 >= 32"):
            quad_vec_layout(bad)
