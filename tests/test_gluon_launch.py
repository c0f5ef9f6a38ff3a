"""Host-side rules of the Gluon launchers that need no GPU: the head-section work order, the config
strings of the forward / backward kernels, and the TMA descriptors built without re-validation."""

from __future__ import annotations

import pytest
import torch

from packattn.ops.varlen import launch_sm90_bwd as tb
from packattn.ops.varlen import launch_sm90_fwd as tg


@pytest.mark.parametrize("heads_kv", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 7])
@pytest.mark.parametrize("env", ["", "0", "1", "2", "3", "5", "64"])
@pytest.mark.parametrize("short", [False, True])
def test_head_sections_tile_the_heads(heads_kv, group, env, short, monkeypatch):
    monkeypatch.setenv(tg.ENV_HEAD_SECTION, env)
    heads_q = heads_kv * group
    per = tg.heads_per_section(heads_q, group, short)
    # whole kv-head groups, and sections that tile the heads exactly (the kernels' decode relies on it)
    assert per % group == 0 and heads_q % per == 0 and group <= per <= heads_q
    wanted = (tg.SHORT_HEAD_SECTION if short else tg.HEAD_SECTION) if env == "" else int(env)
    if wanted <= 0 or wanted >= heads_kv:
        assert per == heads_q
    else:
        assert per // group <= wanted  # rounded down to a divisor of the kv heads, never up


def test_short_batches_take_their_own_head_section(monkeypatch):
    monkeypatch.delenv(tg.ENV_HEAD_SECTION, raising=False)
    assert tg.SHORT_HEAD_SECTION != tg.HEAD_SECTION
    assert tg.heads_per_section(16, 1, short_seqs=True) == tg.SHORT_HEAD_SECTION
    assert tg.heads_per_section(16, 1) == tg.HEAD_SECTION


def test_head_section_env_must_be_a_number(monkeypatch):
    monkeypatch.setenv(tg.ENV_HEAD_SECTION, "two")
    with pytest.raises(ValueError, match="PACKATTN_GLUON_HEAD_SECTION"):
        tg.heads_per_section(16, 1)


def test_forward_config_strings_round_trip_and_pingpong_rules():
    for text in ("128,128,3,8", "128,128,3,8,ws,persistent,direct", "128,128,3,8,ws,persistent,direct,pingpong",
                 "128,64,4,8,ws,persistent,direct,trim"):
        assert tg.parse_config(text).label() == text
    assert tg.parse_config("128,64,4,8,ws,persistent,direct,trim") == tg.SHORT_TRIM_CONFIGS[128]
    for bad in ("128,64,4,8,trim", "128,128,3,8,ws,pingpong,trim"):  # trim: ws only, and not with ping-pong
        with pytest.raises(ValueError, match="trim needs"):
            tg.parse_config(bad)
    with pytest.raises(ValueError, match="need warp_specialize"):
        tg.GluonConfig(128, 128, 3, 8, pingpong=True)
    with pytest.raises(ValueError, match="two consumer warp groups"):
        tg.GluonConfig(64, 64, 3, 4, warp_specialize=True, pingpong=True)
    with pytest.raises(ValueError, match="unknown flag"):
        tg.parse_config("128,128,3,8,ws,ping")


def test_backward_config_strings_round_trip_and_persistent_needs_ws():
    for text in ("32,128,4,8", "64,128,2,8,ws", "64,128,2,8,ws,persistent", "128,64,4,8,ws,persistent"):
        assert tb.parse_config(text).label() == text
    for bad in ("64,128,2,8,persistent", "64,128,2,8,ws,fast", "64,128,2", "128,64,4,8,persistent,ws"):
        with pytest.raises(ValueError, match="expected block_m,block_n,stages,num_warps"):
            tb.parse_config(bad)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_persistent_is_off_by_default_and_set_by_the_env(head_dim, monkeypatch):
    monkeypatch.delenv(tb.ENV_DQ, raising=False)
    monkeypatch.delenv(tb.ENV_DKDV, raising=False)
    assert not tb.dq_config(head_dim).persistent and not tb.dkdv_config(head_dim).persistent
    monkeypatch.setenv(tb.ENV_DQ, "128,64,4,8,ws,persistent")
    assert tb.dq_config(head_dim) == tb.GluonBwdConfig(128, 64, 4, 8, warp_specialize=True, persistent=True)
    monkeypatch.setenv(tb.ENV_DQ, "128,32,4,8,ws,persistent")  # the WS dQ's shape rules still apply
    with pytest.raises(ValueError, match="warp-specialised dQ kernel takes"):
        tb.dq_config(head_dim)


class _RecordingKernel:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _launch_ws(kind: str, text: str, tiles: int, heads_q: int, heads_kv: int, d: int, monkeypatch, sms: int = 132,
               **dq_options):
    """Launch the warp-specialised dQ or dK/dV pass with config ``text`` on CPU tensors (tile table of
    ``tiles`` rows) against a recording kernel on a fake device of ``sms`` SMs: ``(grid, args, kwargs)``.
    ``dq_options``: more keyword arguments of `gluon_launch_dq` (``delta_from_o``, ``out``)."""
    from packattn.ops.varlen import bwd_dq_sm90 as varlen_bwd_gluon_dq_ws
    from packattn.ops.varlen import bwd_dkdv_sm90 as varlen_bwd_gluon_ws

    module, name = ((varlen_bwd_gluon_dq_ws, "varlen_bwd_dq_gluon_ws_kernel") if kind == "dq"
                    else (varlen_bwd_gluon_ws, "varlen_bwd_dkdv_gluon_ws_kernel"))
    kernel = _RecordingKernel()
    monkeypatch.setattr(module, name, kernel)
    monkeypatch.setattr(tg, "_num_sms", lambda index: sms)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cfg = tb.parse_config(text)
    rows = 256
    q, dout = (torch.zeros(rows, heads_q, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.zeros(rows, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
    lse, delta = (torch.zeros(heads_q, rows) for _ in range(2))
    table = torch.zeros(tiles, 6, dtype=torch.int32)
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    if kind == "dq":
        tb.gluon_launch_dq(q, k, v, dout, lse, delta, torch.empty_like(q), table, seq_args, 0.1, (-1, 0, 0), False,
                           config=cfg, **dq_options)
    else:
        tb.gluon_launch_dkdv(q, k, v, dout, lse, delta, torch.empty_like(k), torch.empty_like(v), table, seq_args,
                             0.1, (-1, 0, 0), False, config=cfg)
    assert len(kernel.launches) == 1
    return kernel.launches[0]


@pytest.mark.parametrize("kind,text", [("dq", "128,64,4,8,ws"), ("dkdv", "64,128,2,8,ws")])
@pytest.mark.parametrize("tiles", [1, 3, 256])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_ws_grid_one_program_per_item_or_persistent(kind, text, tiles, persistent, d, monkeypatch):
    heads_q, heads_kv = 32, 8
    grid, args, kwargs = _launch_ws(kind, text + (",persistent" if persistent else ""), tiles, heads_q, heads_kv, d,
                                    monkeypatch)
    # work items: (query tile, query head) for dQ, (key tile, kv head) for dK/dV; passed as num_work
    num_work = tiles * (heads_q if kind == "dq" else heads_kv)
    assert args[-1] == num_work
    assert kwargs["PERSISTENT"] is persistent
    ctas = (tb.dq_ws_resources if kind == "dq" else tb.dkdv_ws_resources)(tb.parse_config(text), d)["ctas_per_sm"]
    assert grid == ((min(num_work, ctas * 132),) if persistent else (num_work,))


def test_dq_persistent_grid_on_w8(monkeypatch):
    # W8: 64 documents of 512 tokens (4 query tiles of 128 each), 32 heads: 8192 items over one CTA per SM
    grid, args, kwargs = _launch_ws("dq", "128,64,4,8,ws,persistent", 64 * 4, 32, 32, 128, monkeypatch)
    assert args[-1] == 8192 and grid == (132,) and kwargs["PERSISTENT"] is True
    grid, args, kwargs = _launch_ws("dq", "128,64,4,8,ws", 64 * 4, 32, 32, 128, monkeypatch)
    assert args[-1] == 8192 and grid == (8192,) and kwargs["PERSISTENT"] is False


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


def test_descriptor_copies_a_contiguous_but_misaligned_tensor():
    """A packed view starting 2 bytes into its storage: ``contiguous()`` returns it unchanged, so the
    copy must be a fresh allocation (TMA needs a 16-byte aligned base)."""
    x = torch.randn(40 * 4 * 64 + 1, dtype=torch.float16)[1:].view(40, 4, 64)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    desc = tg._descriptor(x, 64)
    assert desc.base.data_ptr() % 16 == 0 and torch.equal(desc.base, x)
    assert tg._as_tma_tensor(x).data_ptr() % 16 == 0



@pytest.mark.parametrize("text", ["64,64,2,4,ws", "32,64,3,4,ws", "32,64,4,4,ws"])
@pytest.mark.parametrize("d", [64, 128])
def test_one_consumer_dkdv_launches_two_ctas_per_sm(text, d, monkeypatch):
    grid, args, kwargs = _launch_ws("dkdv", text, 5, 32, 8, d, monkeypatch)
    assert grid == (40,) and args[-1] == 40
    assert kwargs["num_warps"] == 4 and kwargs["maxnreg"] == 128 and kwargs["BLOCK_N"] == 64
    assert kwargs["PERSISTENT"] is False
    res = tb.dkdv_ws_resources(tb.parse_config(text), d)
    assert res["ctas_per_sm"] == 2 and res["consumer_regs"] == 232, res


@pytest.mark.parametrize("text", ["32,64,3,4,ws,persistent", "64,64,2,8,ws", "64,128,2,4,ws", "16,64,2,4,ws",
                                  "32,64,1,4,ws"])
def test_one_consumer_dkdv_refuses_bad_configs(text, monkeypatch):
    with pytest.raises(ValueError):
        _launch_ws("dkdv", text, 5, 32, 8, 128, monkeypatch)
    monkeypatch.setenv(tb.ENV_DKDV, text)
    with pytest.raises(ValueError):
        tb.dkdv_config(128)


def test_dkdv_key_tiles_follow_the_one_consumer_config(monkeypatch):
    from packattn.backends import triton_varlen as tv
    monkeypatch.setenv(tb.ENV_DKDV, "32,64,3,4,ws")
    monkeypatch.setattr(tv, "_gluon_bwd_possible", lambda q, k, v: True)
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    assert tv.dkdv_choice(q, q, q) == (64, 32, True)
    assert tv.dkdv_blocks(q, q, q) == (64, 32)


@pytest.mark.parametrize("heads,blocks", [((16, 16), (64, 64)), ((16, 8), (64, 64)), ((32, 8), (128, 64)),
                                          ((8, 1), (128, 64))])
def test_dkdv_default_by_gqa_group(heads, blocks, monkeypatch):
    """d = 128: one consumer (64-key tiles) unless the GQA group is DKDV_GQA_GROUP or more; the key tiles the
    forward builds (dkdv_choice) and the launcher's default config agree."""
    from packattn.backends import triton_varlen as tv

    monkeypatch.delenv(tb.ENV_DKDV, raising=False)
    monkeypatch.setattr(tv, "_gluon_bwd_possible", lambda q, k, v: True)
    q = torch.zeros(8, heads[0], 128, dtype=torch.bfloat16)
    k = torch.zeros(8, heads[1], 128, dtype=torch.bfloat16)
    assert tv.dkdv_choice(q, k, k) == (*blocks, True)
    cfg = tb.dkdv_config(128, heads[0] // heads[1])
    assert (cfg.block_n, cfg.block_m) == blocks and cfg.warp_specialize


@pytest.mark.parametrize("text,d", [("64,64,2,4,ws", 128), ("64,64,2,4,ws", 64), ("64,64,3,4,ws", 64),
                                    ("64,64,4,4,ws", 64), ("64,128,2,4,ws", 64)])
def test_one_consumer_dq_launches_two_ctas_per_sm(text, d, monkeypatch):
    # one program per (64-query tile, query head): 5 tiles x 32 query heads
    grid, args, kwargs = _launch_ws("dq", text, 5, 32, 8, d, monkeypatch)
    cfg = tb.parse_config(text)
    assert grid == (160,) and args[-1] == 160
    assert kwargs["num_warps"] == 4 and kwargs["maxnreg"] == 128 and kwargs["BLOCK_M"] == 64
    assert kwargs["BLOCK_N"] == cfg.block_n and kwargs["PERSISTENT"] is False
    assert kwargs["CONSUMER_REGS"] == 232 and kwargs["PRODUCER_REGS"] == 24
    q_desc, k_desc, v_desc, do_desc = args[:4]  # Q / dO tiles of 64 rows, K / V blocks of block_n rows
    assert list(q_desc.block_shape) == list(do_desc.block_shape) == [64, d]
    assert list(k_desc.block_shape) == list(v_desc.block_shape) == [cfg.block_n, d]
    res = tb.dq_ws_resources(cfg, d)
    assert res["ctas_per_sm"] == 2 and res["warps"] == 8 and res["consumer_regs"] == 232, res
    assert tb.dq_ws_shared_bytes(cfg, d) <= 113 * 1024


def test_one_consumer_dq_shared_memory_and_resources():
    # d = 128: Q + dO of 64 rows 32 KB, each (K, V) slot of 64 keys 32 KB, one q_bar (no zero_bar), 2 x stages ring
    cfg = tb.parse_config("64,64,2,4,ws")
    assert tb.dq_ws_shared_bytes(cfg, 128) == 96 * 1024 + 8 * (1 + 2 * 2)
    # 3 stages (128 KB) do not fit two CTAs: one CTA per SM, ws_split gives the consumer the whole 256
    res = tb.dq_ws_resources(tb.parse_config("64,64,3,4,ws"), 128)
    assert res["ctas_per_sm"] == 1 and res["maxnreg"] == 256 and res["consumer_regs"] == 256, res
    # the two-consumer numbers (also the tree dQ's base) are unchanged: q_bar + zero_bar + 2 x stages ring
    assert tb.dq_ws_shared_bytes(tb.parse_config("128,64,4,8,ws"), 128) == 192 * 1024 + 8 * (2 + 2 * 4)
    res = tb.dq_ws_resources(tb.parse_config("128,64,4,8,ws"), 128)
    assert (res["ctas_per_sm"], res["warps"], res["maxnreg"], res["consumer_regs"]) == (1, 12, 168, 240)


@pytest.mark.parametrize("text", ["64,64,2,4,ws,persistent", "64,64,2,8,ws", "128,64,2,4,ws", "32,64,2,4,ws",
                                  "64,32,2,4,ws", "64,64,1,4,ws", "128,32,4,8,ws"])
def test_one_consumer_dq_refuses_bad_configs(text, monkeypatch):
    with pytest.raises(ValueError, match="dQ"):
        _launch_ws("dq", text, 5, 32, 8, 128, monkeypatch)
    with pytest.raises(ValueError, match="dQ"):
        tb.check_dq_ws_config(tb.parse_config(text))
    monkeypatch.setenv(tb.ENV_DQ, text)
    with pytest.raises(ValueError, match="dQ"):
        tb.dq_config(128)


def test_dq_ws_alternatives_are_valid_and_one_consumer_ones_fit_two_ctas():
    for d, configs in tb.DQ_WS_ALTERNATIVES.items():
        for cfg in configs:
            tb.check_dq_ws_config(cfg)
            if cfg.block_m == 64:
                assert tb.dq_ws_resources(cfg, d)["ctas_per_sm"] == 2, (d, cfg)
    # the defaults: two consumers, one for short sequences at d = 128
    assert all(cfg.block_m == 128 for cfg in tb.DQ_CONFIGS.values())
    assert tb.DQ_SHORT_CONFIGS[128] == tb.parse_config("64,64,2,4,ws")


def test_dq_query_tiles_follow_the_one_consumer_config(monkeypatch):
    from packattn.backends import triton_varlen as tv
    monkeypatch.setenv(tb.ENV_DQ, "64,64,2,4,ws")
    monkeypatch.setattr(tv, "_gluon_bwd_possible", lambda q, k, v: True)
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    assert tv.dq_choice(q, q, q) == (64, 64, True)
    assert tb.dq_config(128) == tb.GluonBwdConfig(64, 64, 2, 4, warp_specialize=True)


# ---------------------------------------------------------------- DELTA_FROM_O (one-consumer WS dQ)
@pytest.mark.parametrize("text,d", [("64,64,2,4,ws", 128), ("64,64,2,4,ws", 64), ("128,64,4,8,ws", 128),
                                    ("128,64,4,8,ws,persistent", 128)])
def test_dq_ws_launch_without_delta_from_o_passes_no_o_descriptor(text, d, monkeypatch):
    """The default: ``DELTA_FROM_O=False`` and ``o_desc=None`` (a Triton constant: the kernel's parameters
    and PTX are those of the kernel before DELTA_FROM_O existed)."""
    _, args, kwargs = _launch_ws("dq", text, 5, 32, 8, d, monkeypatch)
    assert kwargs["DELTA_FROM_O"] is False
    assert args[4] is None
    lse, delta = args[5], args[6]  # Lse, Delta follow the descriptors
    assert lse.dtype == delta.dtype == torch.float32 and lse.shape == delta.shape == (32, 256)


@pytest.mark.parametrize("d", [64, 128])
def test_dq_delta_from_o_launch_passes_an_o_descriptor(d, monkeypatch):
    out = torch.full((256, 32, d), 3.0, dtype=torch.bfloat16)
    grid, args, kwargs = _launch_ws("dq", "64,64,2,4,ws", 5, 32, 8, d, monkeypatch, delta_from_o=True, out=out)
    assert kwargs["DELTA_FROM_O"] is True and kwargs["PERSISTENT"] is False
    do_desc, o_desc = args[3:5]
    assert o_desc.base is out  # O itself (contiguous, aligned: no copy), not dO
    assert list(o_desc.block_shape) == list(do_desc.block_shape) == [64, d]
    assert o_desc.shape == do_desc.shape == [256, 32 * d] and o_desc.layout == do_desc.layout
    assert grid == (160,) and args[-1] == 160
    # the O tile (16 KB at d = 128) still leaves two CTAs per SM and the register split of the kernel without it
    res = tb.dq_ws_resources(tb.parse_config("64,64,2,4,ws"), d, True)
    assert res == tb.dq_ws_resources(tb.parse_config("64,64,2,4,ws"), d)
    assert res["ctas_per_sm"] == 2 and kwargs["maxnreg"] == res["maxnreg"] == 128
    assert kwargs["CONSUMER_REGS"] == 232 and kwargs["PRODUCER_REGS"] == 24


def test_dq_delta_from_o_shared_memory():
    cfg = tb.parse_config("64,64,2,4,ws")
    # Q + dO + O of 64 rows (48 KB at d = 128), two (K, V) slots of 64 keys (64 KB), q_bar + the ring's 4 barriers
    assert tb.dq_ws_shared_bytes(cfg, 128, delta_from_o=True) == 112 * 1024 + 8 * (1 + 2 * 2)
    assert tb.dq_ws_shared_bytes(cfg, 128, delta_from_o=True) - tb.dq_ws_shared_bytes(cfg, 128) == 64 * 128 * 2
    # two CTAs per SM need <= SM_SHARED / 2 - 1 KB each; the compiled kernel takes 114940 B (scripts/
    # check_gluon_bwd_compile.py --kernels dq --delta-from-o): 772 B to spare
    limit = tg.SM_SHARED // 2 - 1024
    assert limit == 115712 and tb.dq_ws_shared_bytes(cfg, 128, delta_from_o=True) <= limit
    assert tg.ws_split(4, 114940)["ctas_per_sm"] == 2


@pytest.mark.parametrize("text", ["128,64,4,8,ws,persistent", "128,64,4,8", "64,64,3,4"])
def test_dq_delta_from_o_refuses_other_configs(text, monkeypatch):
    """Only the warp-specialised dQ without a persistent grid computes delta (one tile per program)."""
    out = torch.zeros(256, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="warp-specialised dQ config without a persistent grid"):
        _launch_ws("dq", text, 5, 32, 8, 128, monkeypatch, delta_from_o=True, out=out)
    assert not tb.dq_computes_delta(tb.parse_config(text)) and not tb.one_consumer_dq(tb.parse_config(text))
    assert tb.one_consumer_dq(tb.parse_config("64,64,2,4,ws")) and tb.one_consumer_dq(tb.DQ_SHORT_CONFIGS[128])
    assert not tb.one_consumer_dq(None) and not tb.dq_computes_delta(None)


@pytest.mark.parametrize("text", ["128,64,4,8,ws", "128,128,2,8,ws", "128,64,3,8,ws"])
def test_two_consumer_dq_delta_from_o_launch(text, monkeypatch):
    """Two consumer warp groups compute delta too: an O descriptor of the tile's 128 rows, one CTA per SM (the O
    tile fits beside 4 stages of 64 keys at d = 128), and the backward uses it unless
    ``$PACKATTN_GLUON_FUSED_DELTA=0``."""
    out = torch.full((256, 32, 128), 3.0, dtype=torch.bfloat16)
    grid, args, kwargs = _launch_ws("dq", text, 5, 32, 8, 128, monkeypatch, delta_from_o=True, out=out)
    assert kwargs["DELTA_FROM_O"] is True and kwargs["PERSISTENT"] is False
    do_desc, o_desc = args[3:5]
    assert o_desc.base is out and list(o_desc.block_shape) == list(do_desc.block_shape) == [128, 128]
    cfg = tb.parse_config(text)
    assert tb.dq_ws_shared_bytes(cfg, 128, delta_from_o=True) - tb.dq_ws_shared_bytes(cfg, 128) == 128 * 128 * 2
    # (128, 64, 4 stages) with O: 229456 B estimated, 229760 B compiled, under the 232448 B a CTA may take
    assert tb.dq_ws_shared_bytes(cfg, 128, delta_from_o=True) <= 229456
    assert tb.dq_ws_resources(cfg, 128, True)["ctas_per_sm"] == 1
    assert tb.dq_computes_delta(cfg) and not tb.one_consumer_dq(cfg)
    monkeypatch.delenv(tb.ENV_FUSED_DELTA, raising=False)
    assert tb.fused_delta_dq(cfg) and not tb.fused_delta_dq(tb.parse_config(text + ",persistent"))
    monkeypatch.setenv(tb.ENV_FUSED_DELTA, "0")
    assert not tb.fused_delta_dq(cfg) and tb.fused_delta_dq(tb.DQ_SHORT_CONFIGS[128])


def test_dq_delta_from_o_needs_out_and_a_writable_delta(monkeypatch):
    with pytest.raises(ValueError, match="out"):
        _launch_ws("dq", "64,64,2,4,ws", 5, 32, 8, 128, monkeypatch, delta_from_o=True)
    with pytest.raises(ValueError, match="out"):  # O shaped like dO
        _launch_ws("dq", "64,64,2,4,ws", 5, 32, 8, 128, monkeypatch, delta_from_o=True,
                   out=torch.zeros(256, 32, 64, dtype=torch.bfloat16))
    kernel = _RecordingKernel()
    from packattn.ops.varlen import bwd_dq_sm90 as varlen_bwd_gluon_dq_ws
    monkeypatch.setattr(varlen_bwd_gluon_dq_ws, "varlen_bwd_dq_gluon_ws_kernel", kernel)
    q = torch.zeros(256, 4, 128, dtype=torch.bfloat16)
    lse = torch.zeros(4, 256)
    delta = torch.zeros(256, 4).t()  # lse's shape, not contiguous: a copy would be written, not this tensor
    seq_args = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(4))
    with pytest.raises(ValueError, match="contiguous"):
        tb.gluon_launch_dq(q, q, q, q, lse, delta, torch.empty_like(q), torch.zeros(5, 6, dtype=torch.int32),
                           seq_args, 0.1, (-1, 0, 0), False, config=tb.parse_config("64,64,2,4,ws"),
                           delta_from_o=True, out=q)
    assert kernel.launches == []

