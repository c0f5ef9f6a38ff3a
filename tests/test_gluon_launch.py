"""Host-side rules of the Gluon launchers that need no GPU: the head-section work order, the backward
configs the kernels take, the launches' grids and arguments (recording kernels), and the TMA descriptors
built without re-validation."""

from __future__ import annotations

import functools

import pytest
import torch

from packattn.mask import Mask
from packattn.ops.runtime import sm90
from packattn.ops.varlen import configs, launch_sm90, launch_sm90_bwd_parts, op
from packattn.ops.varlen.configs import GluonBwdConfig, GluonConfig


def _cfg(text: str) -> GluonBwdConfig:
    """``"block_m,block_n,stages,num_warps"`` as a GluonBwdConfig."""
    return GluonBwdConfig(*(int(x) for x in text.split(",")))


@pytest.mark.parametrize("heads_kv", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 7])
@pytest.mark.parametrize("section", [None, 0, 1, 2, 3, 5, 64])
@pytest.mark.parametrize("short", [False, True])
def test_head_sections_tile_the_heads(heads_kv, group, section, short):
    heads_q = heads_kv * group
    values = {} if section is None else {"HEAD_SECTION": section, "SHORT_HEAD_SECTION": section}
    with configs.override(**values):
        per = configs.heads_per_section(heads_q, group, short)
        wanted = configs.SHORT_HEAD_SECTION if short else configs.HEAD_SECTION
    # whole kv-head groups, and sections that tile the heads exactly (the kernels' decode relies on it)
    assert per % group == 0 and heads_q % per == 0 and group <= per <= heads_q
    if wanted <= 0 or wanted >= heads_kv:
        assert per == heads_q
    else:
        assert per // group <= wanted  # rounded down to a divisor of the kv heads, never up


def test_short_batches_take_their_own_head_section():
    assert configs.SHORT_HEAD_SECTION != configs.HEAD_SECTION
    assert configs.heads_per_section(16, 1, short_seqs=True) == configs.SHORT_HEAD_SECTION
    assert configs.heads_per_section(16, 1) == configs.HEAD_SECTION


def test_forward_configs_keep_one_consumer_warp_group_per_64_rows():
    assert configs.SHORT_DEFAULT_CONFIGS[128] == GluonConfig(128, 64, 4, 8, trim=True)
    # (every table entry is a GluonConfig, whose constructor refuses the others)
    with pytest.raises(ValueError, match="16 \\* num_warps"):
        GluonConfig(128, 128, 3, 4)
    with pytest.raises(ValueError, match="stages"):
        GluonConfig(128, 128, 1, 8)


def test_every_table_config_passes_the_launchers_resource_checks():
    """Each forward table config at each head dim it serves gets its resources without a ValueError (Q in registers
    where `fwd_sm90_ring.q_regs_ok` allows it, shared memory within a CTA's), one CTA per SM at least."""
    for table in configs.fwd_tables().values():
        for dims, cfg in table.items():
            head_dim, head_dim_v = dims if isinstance(dims, tuple) else (dims, dims)
            assert launch_sm90.fwd_resources(cfg, head_dim, head_dim_v)["ctas_per_sm"] >= 1


class _RecordingKernel:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _recording(monkeypatch, kind: str) -> _RecordingKernel:
    from packattn.ops.varlen import bwd_dkdv_sm90, bwd_dq_sm90, fwd_sm90

    module, name = {"dq": (bwd_dq_sm90, "varlen_bwd_dq_gluon_ws_kernel"),
                    "dkdv": (bwd_dkdv_sm90, "varlen_bwd_dkdv_gluon_ws_kernel"),
                    "fwd": (fwd_sm90, "varlen_fwd_gluon_ws_kernel")}[kind]
    kernel = _RecordingKernel()
    monkeypatch.setattr(module, name, kernel)
    monkeypatch.setattr(sm90, "_num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return kernel


def _launch_ws(kind: str, text: str, tiles: int, heads_q: int, heads_kv: int, d: int, monkeypatch, out=None):
    """Launch the dQ or dK/dV pass with config ``text`` on CPU tensors (tile table of ``tiles`` rows) against a
    recording kernel: ``(grid, args, kwargs)``. ``out``: the forward's O (the dQ pass computes delta)."""
    cfg = _cfg(text)
    kernel = _recording(monkeypatch, kind)
    rows = 256
    q, dout = (torch.zeros(rows, heads_q, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.zeros(rows, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
    lse, delta = (torch.zeros(heads_q, rows) for _ in range(2))
    table = torch.zeros(tiles, 6, dtype=torch.int32)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    mask = Mask.make(True)
    if kind == "dq":
        launch_sm90.gluon_dq(q, k, v, dout, lse, delta, torch.empty_like(q), table, seq_args, 0.1, mask, cfg, out=out)
    else:
        launch_sm90.gluon_dkdv(q, k, v, dout, lse, delta, torch.empty_like(k), torch.empty_like(v), table, seq_args,
                               0.1, mask, cfg)
    assert len(kernel.launches) == 1
    return kernel.launches[0]


@pytest.mark.parametrize("kind,text", [("dq", "128,64,4,8"), ("dkdv", "64,128,2,8"), ("dkdv", "64,64,2,4")])
@pytest.mark.parametrize("tiles", [1, 3, 256])
@pytest.mark.parametrize("d", [64, 128])
def test_ws_backward_grid_is_one_program_per_item(kind, text, tiles, d, monkeypatch):
    heads_q, heads_kv = 32, 8
    grid, args, kwargs = _launch_ws(kind, text, tiles, heads_q, heads_kv, d, monkeypatch)
    # work items: (query tile, query head) for dQ, (key tile, kv head) for dK/dV; passed as num_work
    num_work = tiles * (heads_q if kind == "dq" else heads_kv)
    assert args[-1] == num_work and grid == (num_work,) and "PERSISTENT" not in kwargs
    assert kwargs["HAS_RIGHT"] and not kwargs["HAS_LEFT"] and not kwargs["HAS_CHUNK"] and not kwargs["TOP_LEFT"]


def test_forward_launch_is_persistent_and_stores_directly(monkeypatch):
    """Every selected forward config runs the warp-specialised kernel on a persistent grid (ctas_per_sm x SMs
    programs at most; the kernel has no other variant to select), trimmed and storing as the config says."""
    vec = configs.GluonConfig(128, 64, 2, 8, vec_store=True)
    for cfg in (configs.CONFIGS[128], configs.SHORT_DEFAULT_CONFIGS[128], configs.SHORT_CONFIGS[128], vec):
        kernel = _recording(monkeypatch, "fwd")
        q = torch.zeros(4096, 8, 128, dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(8, 4096)
        tiles = torch.zeros(40, 6, dtype=torch.int32)
        seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
        launch_sm90.gluon_fwd(q, q, q, out, lse, seq_args, tiles, 0.1, Mask.make(True), cfg)
        ((grid, args, kwargs),) = kernel.launches
        res = launch_sm90.fwd_resources(cfg, 128)
        assert grid == (min(40 * 8, res["ctas_per_sm"] * 132),) and args[-2] == 40 * 8
        assert kwargs["TRIM"] is cfg.trim and not {"DIRECT_STORE", "PINGPONG", "PERSISTENT"} & set(kwargs)
        assert kwargs["VEC_STORE"] is cfg.vec_store
        assert kwargs["BLOCK_M"] == cfg.block_m and kwargs["maxnreg"] == res["maxnreg"]


def _fields(desc) -> dict:
    return {name: getattr(desc, name) for name in sm90._DESCRIPTOR_FIELDS}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,d,block", [(300, 4, 128, 128), (17, 1, 64, 64), (1, 2, 128, 64)])
def test_fast_descriptor_equals_the_validated_one(rows, heads, d, block, dtype):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x = torch.randn(rows, heads, d).to(dtype)
    fast = sm90._descriptor(x, block)
    slow = TensorDescriptor(x, [rows, heads * d], [heads * d, 1], [block, d], sm90._smem_layout((block, d), dtype))
    assert type(fast) is TensorDescriptor
    assert _fields(fast) == _fields(slow)


def test_descriptor_copies_what_tma_cannot_read():
    x = torch.randn(40, 8, 64, dtype=torch.float16)[:, ::2]  # heads not packed: not a 2-D TMA view
    desc = sm90._descriptor(x, 64)
    assert desc.base.is_contiguous() and torch.equal(desc.base, x)
    assert desc.shape == [40, 4 * 64] and desc.strides == [4 * 64, 1]


def test_descriptor_copies_a_contiguous_but_misaligned_tensor():
    """A packed view starting 2 bytes into its storage: ``contiguous()`` returns it unchanged, so the
    copy must be a fresh allocation (TMA needs a 16-byte aligned base)."""
    x = torch.randn(40 * 4 * 64 + 1, dtype=torch.float16)[1:].view(40, 4, 64)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    desc = sm90._descriptor(x, 64)
    assert desc.base.data_ptr() % 16 == 0 and torch.equal(desc.base, x)
    assert sm90._as_tma_tensor(x).data_ptr() % 16 == 0


@pytest.mark.parametrize("text", ["64,64,2,4", "32,64,3,4", "32,64,4,4"])
@pytest.mark.parametrize("d", [64, 128])
def test_one_consumer_dkdv_launches_two_ctas_per_sm(text, d, monkeypatch):
    grid, args, kwargs = _launch_ws("dkdv", text, 5, 32, 8, d, monkeypatch)
    assert grid == (40,) and args[-1] == 40
    assert kwargs["num_warps"] == 4 and kwargs["maxnreg"] == 128 and kwargs["BLOCK_N"] == 64
    res = launch_sm90.dkdv_resources(_cfg(text), d)
    assert res["ctas_per_sm"] == 2 and res["consumer_regs"] == 232, res


@pytest.mark.parametrize("text", ["128,64,2,8", "64,128,2,4", "16,64,2,4", "32,64,1,4", "64,96,2,4", "64,32,2,4"])
def test_dkdv_refuses_bad_configs(text, monkeypatch):
    with pytest.raises(ValueError, match="dK/dV"):
        _launch_ws("dkdv", text, 5, 32, 8, 128, monkeypatch)
    with pytest.raises(ValueError, match="dK/dV"):
        with configs.override(dkdv=_cfg(text)):
            pass


def _gluon_everywhere(monkeypatch):
    monkeypatch.setattr(op, "sm90_runs", lambda q, k, v, tma, head_dims, dtypes: True)


def test_dkdv_key_tiles_follow_a_forced_config(monkeypatch):
    _gluon_everywhere(monkeypatch)
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    with configs.override(dkdv=_cfg("32,64,3,4")):
        assert op.bwd_plan(q, q, q).dkdv_choice == (64, 32, True)


@pytest.mark.parametrize("heads,blocks", [((16, 16), (64, 64)), ((16, 8), (64, 64)), ((32, 8), (128, 64)),
                                          ((8, 1), (128, 64))])
def test_dkdv_default_by_gqa_group(heads, blocks, monkeypatch):
    """d = 128: one consumer (64-key tiles) unless the GQA group is DKDV_GQA_GROUP or more; the key tiles the
    forward builds (the plan's dkdv_choice) and the launcher's config agree."""
    _gluon_everywhere(monkeypatch)
    q = torch.zeros(8, heads[0], 128, dtype=torch.bfloat16)
    k = torch.zeros(8, heads[1], 128, dtype=torch.bfloat16)
    plan = op.bwd_plan(q, k, k)
    assert plan.dkdv_choice == (*blocks, True)
    assert (plan.dkdv.block_n, plan.dkdv.block_m) == blocks


@pytest.mark.parametrize("text,d", [("64,64,2,4", 128), ("64,64,2,4", 64), ("64,64,3,4", 64),
                                    ("64,64,4,4", 64), ("64,128,2,4", 64)])
def test_one_consumer_dq_launches_two_ctas_per_sm(text, d, monkeypatch):
    # one program per (64-query tile, query head): 5 tiles x 32 query heads
    grid, args, kwargs = _launch_ws("dq", text, 5, 32, 8, d, monkeypatch)
    cfg = _cfg(text)
    assert grid == (160,) and args[-1] == 160
    assert kwargs["num_warps"] == 4 and kwargs["maxnreg"] == 128 and kwargs["BLOCK_M"] == 64
    assert kwargs["BLOCK_N"] == cfg.block_n
    assert kwargs["CONSUMER_REGS"] == 232 and kwargs["PRODUCER_REGS"] == 24
    q_desc, k_desc, v_desc, do_desc = args[:4]  # Q / dO tiles of 64 rows, K / V blocks of block_n rows
    assert list(q_desc.block_shape) == list(do_desc.block_shape) == [64, d]
    assert list(k_desc.block_shape) == list(v_desc.block_shape) == [cfg.block_n, d]
    res = launch_sm90.dq_resources(cfg, d)
    assert res["ctas_per_sm"] == 2 and res["warps"] == 8 and res["consumer_regs"] == 232, res
    assert launch_sm90.dq_shared_bytes(cfg, d) <= 113 * 1024


@pytest.mark.parametrize("with_out", [False, True])
def test_d64_dq_runs_two_consumers_over_128_key_steps(with_out, monkeypatch):
    """d = 64 runs the two-consumer dQ over 128-key steps: one program per (128-query tile, query head), the
    consumers' 8 warps plus the producer's warp group, computing delta where it gets O."""
    cfg = configs.DQ_CONFIGS[64]
    assert cfg == _cfg("128,128,2,8") and configs.dq_config(64, short_seqs=True) == cfg
    out = torch.full((256, 32, 64), 3.0, dtype=torch.bfloat16) if with_out else None
    grid, args, kwargs = _launch_ws("dq", "128,128,2,8", 5, 32, 8, 64, monkeypatch, out=out)
    assert grid == (160,) and args[-1] == 160 and kwargs["num_warps"] == 4
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["STAGES"], kwargs["HEAD_DIM"]) == (128, 128, 2, 64)
    assert args[-5:-2] == (-1, 0, 0)  # the mask scalars (causal: no left bound, right 0, no chunk), section, items
    q_desc, k_desc, _, do_desc, o_desc = args[:5]
    assert list(q_desc.block_shape) == list(do_desc.block_shape) == list(k_desc.block_shape) == [128, 64]
    assert kwargs["DELTA_FROM_O"] is with_out and (o_desc is None) is not with_out
    # Q, dO (and O) of 128 rows and two 128-key (K, V) slots at d = 64: one CTA per SM, 240 registers a consumer
    res = launch_sm90.dq_resources(cfg, 64, with_out)
    assert launch_sm90.dq_shared_bytes(cfg, 64, delta_from_o=with_out) == (
        ((3 if with_out else 2) * 128 + 2 * 2 * 128) * 64 * 2 + 8 * (2 + 2 * 2))
    assert (res["ctas_per_sm"], res["consumer_regs"]) == (1, 240) and kwargs["maxnreg"] == res["maxnreg"]


def test_one_consumer_dq_shared_memory_and_resources():
    # d = 128: Q + dO of 64 rows 32 KB, each (K, V) slot of 64 keys 32 KB, one q_bar (no zero_bar), 2 x stages ring
    cfg = _cfg("64,64,2,4")
    assert launch_sm90.dq_shared_bytes(cfg, 128) == 96 * 1024 + 8 * (1 + 2 * 2)
    # 3 stages (128 KB) do not fit two CTAs: one CTA per SM, ws_split gives the consumer the whole 256 through
    # setmaxnreg, and the launch bound stays within what ptxas honours (255, rounded down to 248)
    res = launch_sm90.dq_resources(_cfg("64,64,3,4"), 128)
    assert res["ctas_per_sm"] == 1 and res["maxnreg"] == 248 and res["consumer_regs"] == 256, res
    # the two-consumer numbers (also the tree dQ's base): q_bar + zero_bar + 2 x stages ring
    assert launch_sm90.dq_shared_bytes(_cfg("128,64,4,8"), 128) == 192 * 1024 + 8 * (2 + 2 * 4)
    res = launch_sm90.dq_resources(_cfg("128,64,4,8"), 128)
    assert (res["ctas_per_sm"], res["warps"], res["maxnreg"], res["consumer_regs"]) == (1, 12, 168, 240)


@pytest.mark.parametrize("text", ["64,64,2,8", "128,64,2,4", "32,64,2,4", "64,32,2,4", "64,64,1,4",
                                  "128,32,4,8"])
def test_dq_refuses_bad_configs(text, monkeypatch):
    with pytest.raises(ValueError, match="dQ"):
        _launch_ws("dq", text, 5, 32, 8, 128, monkeypatch)
    with pytest.raises(ValueError, match="dQ"):
        configs.check_dq_config(_cfg(text))
    with pytest.raises(ValueError, match="dQ"):
        with configs.override(dq=_cfg(text)):
            pass


def test_dq_tables_are_valid_and_every_config_computes_delta_within_a_cta():
    """Every table config is one the dQ kernel takes and fits one CTA's shared memory, with O where it computes
    delta (`fused_delta`, `op.fuses_delta`); a config that leaves delta to the preprocess would not fit with O
    (else it should fuse); the one-consumer ones up to d = 128 fit two."""
    for table in (configs.DQ_CONFIGS, configs.DQ_SHORT_CONFIGS):
        for key, cfg in table.items():
            configs.check_dq_config(cfg)
            d, d_v = (key, key) if isinstance(key, int) else key
            if launch_sm90_bwd_parts.in_parts(d, d_v):  # 96, 192, MLA: the part kernel's layout
                size = functools.partial(launch_sm90_bwd_parts.dq_parts_shared_bytes, cfg, d, d_v)
            else:
                size = functools.partial(launch_sm90.dq_shared_bytes, cfg, d)
            assert size(delta_from_o=cfg.fused_delta) <= 232448, key
            assert cfg.fused_delta or size(delta_from_o=True) > 232448, key
            if launch_sm90_bwd_parts.in_parts(d, d_v):
                continue
            if cfg.block_m == 64 and d <= 128:
                assert launch_sm90.dq_resources(cfg, d, True)["ctas_per_sm"] == 2, (d, cfg)
    assert set(configs.DQ_CONFIGS) == set(configs.GLUON_HEAD_DIMS)


def test_dq_query_tiles_follow_a_forced_config(monkeypatch):
    _gluon_everywhere(monkeypatch)
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    with configs.override(dq=_cfg("64,64,2,4")):
        assert op.bwd_plan(q, q, q).dq_choice == (64, 64, True)
        assert configs.dq_config(128) == _cfg("64,64,2,4")


# ---------------------------------------------------------------- delta from O (warp-specialised dQ)
@pytest.mark.parametrize("text,d", [("64,64,2,4", 128), ("64,64,2,4", 64), ("128,64,4,8", 128)])
def test_dq_ws_launch_without_out_passes_no_o_descriptor(text, d, monkeypatch):
    """Without O: ``DELTA_FROM_O=False`` and ``o_desc=None`` (a Triton constant: no kernel parameter)."""
    _, args, kwargs = _launch_ws("dq", text, 5, 32, 8, d, monkeypatch)
    assert kwargs["DELTA_FROM_O"] is False
    assert args[4] is None
    lse, delta = args[5], args[6]  # Lse, Delta follow the descriptors
    assert lse.dtype == delta.dtype == torch.float32 and lse.shape == delta.shape == (32, 256)


@pytest.mark.parametrize("d", [64, 128])
def test_dq_delta_from_o_launch_passes_an_o_descriptor(d, monkeypatch):
    out = torch.full((256, 32, d), 3.0, dtype=torch.bfloat16)
    grid, args, kwargs = _launch_ws("dq", "64,64,2,4", 5, 32, 8, d, monkeypatch, out=out)
    assert kwargs["DELTA_FROM_O"] is True
    do_desc, o_desc = args[3:5]
    assert o_desc.base is out  # O itself (contiguous, aligned: no copy), not dO
    assert list(o_desc.block_shape) == list(do_desc.block_shape) == [64, d]
    assert o_desc.shape == do_desc.shape == [256, 32 * d] and o_desc.layout == do_desc.layout
    assert grid == (160,) and args[-1] == 160
    # the O tile (16 KB at d = 128) still leaves two CTAs per SM and the register split of the kernel without it
    res = launch_sm90.dq_resources(_cfg("64,64,2,4"), d, True)
    assert res == launch_sm90.dq_resources(_cfg("64,64,2,4"), d)
    assert res["ctas_per_sm"] == 2 and kwargs["maxnreg"] == res["maxnreg"] == 128
    assert kwargs["CONSUMER_REGS"] == 232 and kwargs["PRODUCER_REGS"] == 24


def test_dq_delta_from_o_shared_memory():
    cfg = _cfg("64,64,2,4")
    # Q + dO + O of 64 rows (48 KB at d = 128), two (K, V) slots of 64 keys (64 KB), q_bar + the ring's 4 barriers
    assert launch_sm90.dq_shared_bytes(cfg, 128, delta_from_o=True) == 112 * 1024 + 8 * (1 + 2 * 2)
    assert (launch_sm90.dq_shared_bytes(cfg, 128, delta_from_o=True) - launch_sm90.dq_shared_bytes(cfg, 128)
            == 64 * 128 * 2)
    # two CTAs per SM need <= SM_SHARED / 2 - 1 KB each; the compiled kernel takes 114940 B
    limit = sm90.SM_SHARED // 2 - 1024
    assert limit == 115712 and launch_sm90.dq_shared_bytes(cfg, 128, delta_from_o=True) <= limit
    assert sm90.ws_split(4, 114940)["ctas_per_sm"] == 2


@pytest.mark.parametrize("text", ["128,64,4,8", "128,128,2,8", "128,64,3,8"])
def test_two_consumer_dq_delta_from_o_launch(text, monkeypatch):
    """Two consumer warp groups compute delta too: an O descriptor of the tile's 128 rows, one CTA per SM (the O
    tile fits beside 4 stages of 64 keys at d = 128)."""
    out = torch.full((256, 32, 128), 3.0, dtype=torch.bfloat16)
    grid, args, kwargs = _launch_ws("dq", text, 5, 32, 8, 128, monkeypatch, out=out)
    assert kwargs["DELTA_FROM_O"] is True
    do_desc, o_desc = args[3:5]
    assert o_desc.base is out and list(o_desc.block_shape) == list(do_desc.block_shape) == [128, 128]
    cfg = _cfg(text)
    assert (launch_sm90.dq_shared_bytes(cfg, 128, delta_from_o=True) - launch_sm90.dq_shared_bytes(cfg, 128)
            == 128 * 128 * 2)
    # (128, 64, 4 stages) with O: 229456 B estimated, under the 232448 B a CTA may take
    assert launch_sm90.dq_shared_bytes(cfg, 128, delta_from_o=True) <= 229456
    assert launch_sm90.dq_resources(cfg, 128, True)["ctas_per_sm"] == 1


def test_dq_delta_from_o_needs_a_matching_out_and_a_writable_delta(monkeypatch):
    with pytest.raises(ValueError, match="out"):  # O shaped like dO
        _launch_ws("dq", "64,64,2,4", 5, 32, 8, 128, monkeypatch,
                   out=torch.zeros(256, 32, 64, dtype=torch.bfloat16))
    kernel = _recording(monkeypatch, "dq")
    q = torch.zeros(256, 4, 128, dtype=torch.bfloat16)
    lse = torch.zeros(4, 256)
    delta = torch.zeros(256, 4).t()  # lse's shape, not contiguous: a copy would be written, not this tensor
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    with pytest.raises(ValueError, match="contiguous"):
        launch_sm90.gluon_dq(q, q, q, q, lse, delta, torch.empty_like(q), torch.zeros(5, 6, dtype=torch.int32),
                             seq_args, 0.1, Mask.make(True), _cfg("64,64,2,4"), out=q)
    assert kernel.launches == []
