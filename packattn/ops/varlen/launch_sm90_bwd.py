"""Launchers of the Gluon Hopper backward (`packattn.ops.varlen.bwd_sm90`).

`gluon_launch_dkdv` / `gluon_launch_dq` take what the Triton launch paths of
`packattn.backends.triton_varlen.varlen_bwd` take (`launch_dkdv` and the dq launch below it):
q, k, v, dout, lse, delta (from `triton_varlen.bwd_delta`), the preallocated outputs, the tile
table, ``seq_args = (cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)``, ``scale`` and
``mask_args = (window_left, window_right, chunk_size)``, plus ``top_left`` (the Triton path passes it
inside its ``common`` constexpr dict). `gluon_varlen_bwd` is a drop-in body for
``packattn::varlen_bwd`` (same arguments, same ``(dq, dk, dv)``).

The tile tables must be built with this kernel's block sizes (not `launch_config`'s)::

    dkdv, dq = dkdv_config(head_dim), dq_config(head_dim)
    dkdv_tiles = tile_table(seqs, mask, True, dkdv.block_n, dkdv.block_m)   # key tiles, query blocks
    dq_tiles = tile_table(seqs, mask, False, dq.block_m, dq.block_n)        # query tiles, key blocks

`gluon_bwd_supported(q, k, v, dout)` says whether the kernels can run these tensors (CUDA,
compute capability 9.x, float16 / bfloat16, head dim 64 or 128, GQA); tensors that are not
viewable as TMA ``(rows, heads * d)`` matrices are copied by the launchers. `gluon_bwd_eligible`
is the same test without strides, for deciding at forward time which tables to build.

In the triton backend (`packattn.backends.triton_varlen`) on sm_90: the dQ pass is `gluon_launch_dq`
(`triton_varlen.dq_choice`: its tile table's blocks) and, at head dim 128, the dK/dV pass is the
warp-specialised `gluon_launch_dkdv` (`use_gluon_dkdv`; its key tile table is built by the forward
with `dkdv_blocks`). Both decisions depend only on dtypes, shapes, device and the environment, so
the forward and the backward agree; ``PACKATTN_TRITON_BWD=triton`` keeps the Triton passes.
With a warp-specialised dQ config (`dq_computes_delta`), a Gluon dK/dV pass and no dlse, `triton_varlen.fuses_delta`
drops the preprocess: the dQ pass computes and writes delta (``gluon_launch_dq(..., delta_from_o=True)``) and
runs before the dK/dV pass. `gluon_varlen_bwd` (every pass in Gluon, with this module's configs) serves A/B runs
(`benchmarks/ab_gluon_bwd.py`). The tree backward (`triton_tree`) runs the warp-specialised dK/dV
with the tree mask (`gluon_launch_dkdv(..., key_end=...)`) where `use_gluon_dkdv` says so, the
Triton ``launch_dkdv(..., tree=True)`` otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from packattn import env
from packattn.ops.runtime import fast_launch
from packattn.backends.triton_base import cuda_index
from packattn.ops.runtime.launch import _mask_constexprs
from packattn.ops.varlen.launch_sm90_fwd import (DTYPES, HEAD_DIMS, LOG2E, _capability, _descriptor,
                                                gluon_fwd_supported, heads_per_section, ws_grid, ws_split)


@dataclass(frozen=True)
class GluonBwdConfig:
    block_m: int  # queries per block (dK/dV: per ring step; dQ: per tile, == 16 * num_warps)
    block_n: int  # keys per block (dK/dV: per tile, == 16 * num_warps; dQ: per ring step)
    stages: int  # ring slots; >= 3 for any prefetch (the slot of step j-1 is refilled at the end of step j)
    num_warps: int = 8  # (warp_specialize: the consumer warps; the launch adds the producer warp)
    # dK/dV: `varlen_bwd_gluon_ws.varlen_bwd_dkdv_gluon_ws_kernel`, a 1-warp TMA producer and two
    # consumer warp groups of 64 keys (block_n 128, num_warps 8) with ~240 registers each (setmaxnreg),
    # or one (block_n 64, num_warps 4: two CTAs per SM, 232 registers), ready / empty mbarriers, no CTA
    # barrier in the loop; dQ: `varlen_bwd_gluon_dq_ws.varlen_bwd_dq_gluon_ws_kernel`,
    # the same with two consumer warp groups of 64 queries (block_m 128, num_warps 8) or one (block_m 64,
    # num_warps 4)
    warp_specialize: bool = False
    # (warp-specialised dK/dV and dQ) a grid of (ctas per SM) x (SMs) programs looping over the work items,
    # the next item's K/V (dK/dV, `varlen_bwd_gluon_ws`) or Q/dO (dQ, `varlen_bwd_gluon_dq_ws`) load
    # overlapping this item's epilogue (PERSISTENT); the tree dQ (`triton_tree_gluon_dq`) ignores it
    persistent: bool = False

    def label(self) -> str:
        """The ``$PACKATTN_GLUON_DKDV_CONFIG`` string of this configuration (`parse_config` reads it back)."""
        return ",".join([str(self.block_m), str(self.block_n), str(self.stages), str(self.num_warps)]
                        + (["ws"] if self.warp_specialize else []) + (["persistent"] if self.persistent else []))


# Every config here compiles for sm_90a without spills or ptxas warnings, with the overlap visible in
# the TTGIR / PTX, for every mask and bf16 / fp16 (scripts/check_gluon_bwd_compile.py). Timed on an H200:
# dQ (128, 64, 4 stages) 1.03/1.04/1.01/1.19x the Triton dQ pass on W1/W2/W4/W8
# (results/2026-11-22/ab_gluon_bwd_h200.txt): the default dQ of the triton backend on sm_90.
# dK/dV at d = 128: the warp-specialised kernel (64 queries per step, 2 stages) is the triton backend's
# pass on sm_90 (`triton_varlen.use_gluon_dkdv`): 1.32-1.50x the Triton pass on W1/W2/W4/W8
# (results/2026-11-23/ab_gluon_dkdv_ws_h200_W1.txt, ..._W2_W4_W8.txt). d = 64 keeps the
# non-specialised kernel here (",ws" at d = 64 is correct but not timed), so the Triton pass runs there.
DKDV_CONFIGS = {64: GluonBwdConfig(64, 128, 4), 128: GluonBwdConfig(64, 64, 2, 4, True)}
# Since 2026-11-24 (eighth session) the d = 128 default is the one-consumer variant (64 keys per tile, two CTAs per
# SM, below). H200 dK/dV kernel time, two consumers (64, 128, 2, 8, ws) -> one (64, 64, 2, 4, ws)
# (results/2026-11-24/s8_dkdv_one_consumer_h200.txt, s8_dkdv_one_consumer_w2_w7_h200.txt): W8 437.9 -> 389.8 us,
# 256-row documents 372.6 -> 319.7, 1024-row 606.0 -> 557.9, W1 1500.5 -> 1420.0, W3 1442 -> 1352, W4 3578 -> 3558,
# W5 822 -> 748, W7 (tree) 3215 -> 3129, W6 1155 -> 1153; but W2 (GQA group 4) 2574 -> 2626, so GQA groups of 4
# or more keep the two-consumer kernel (DKDV_GQA_CONFIGS: each 128-key tile walks group x blocks steps there).
DKDV_GQA_CONFIGS = {128: GluonBwdConfig(64, 128, 2, 8, True)}
DKDV_GQA_GROUP = 4
DQ_CONFIGS = {64: GluonBwdConfig(128, 64, 4), 128: GluonBwdConfig(128, 64, 4, 8, True)}
# Short sequences (none longer than triton_varlen.SHORT_SEQLEN = 512 rows) at d = 128: the one-consumer WS dQ
# (64-query tiles, two CTAs per SM; the forward builds the dQ tile table with these blocks, `triton_varlen.dq_choice`).
# H200 dQ kernel time, 32768 tokens of causal documents of 256 / 512 (W8) / 1024 rows: eighth session, the
# non-specialised (128, 64, 4) against (128, 64, 4, 8, ws): 294.4 -> 258.5, 345.7 -> 329.4, 446.2 -> 484.5 us
# (results/2026-11-24/s8_short_docs_sweep_h200.txt); ninth session, (128, 64, 4) -> (64, 64, 2, 4, ws): 259.0 ->
# 260.3, 330.8 -> 318.8, and 1024 rows 449.3 (128, 64, 4, 8, ws) -> 430.5, but W1 986.3 -> 1021.2
# (results/2026-11-24/s9_dq_one_consumer_h200.txt).
DQ_SHORT_CONFIGS = {128: GluonBwdConfig(64, 64, 2, 4, True)}
# With this config (any one-consumer WS dQ, `one_consumer_dq`), a Gluon dK/dV pass and no dlse, the triton backend
# skips the backward preprocess (W8 on an H200: 68 of 1029 us): `triton_varlen.fuses_delta`; the dQ pass runs first
# with ``gluon_launch_dq(..., delta_from_o=True, out=O)`` (`varlen_bwd_gluon_dq_delta`, DELTA FROM O: the producer loads
# the tile's O with Q / dO by TMA, the consumer computes delta = rowsum(dO O) in its first step under the S / dP
# wgmma and writes it for the dK/dV pass). 16 KB more shared memory at d = 128 (114940 B compiled, two CTAs per SM
# still), consumer 212-217 of 232 registers, no spills (scripts/check_gluon_bwd_compile.py --kernels dq
# --delta-from-o). On GPUs since the eleventh session (benchmarks/NOTES.md, v21); two consumers: `fused_delta_dq`.
# Spill-free alternatives for A/B runs. Non-specialised dK/dV: at d = 128 dK + dV hold 128 float32
# registers per thread, so 64-query blocks spill and (32, 128, 4 stages) is its best shape (0.65-0.99x
# the Triton pass); (.., 64, .., 4 warps) tiles: one warp group, <= 98 KB of shared memory, so two CTAs
# share an SM and drift out of phase -- the Triton dK/dV kernel's best shape (32 x 64, 4 warps).
# Warp-specialised dK/dV (",ws", `varlen_bwd_gluon_ws`): 64-query blocks at d = 128 fit the
# consumers' 240 registers without spills (scripts/check_gluon_bwd_compile.py --kernels dkdv --config
# 64,128,4,8,ws: every mask, bf16 / fp16, d 64 / 128; ~238 registers per consumer at d = 128, ~170 at d = 64);
# d = 128 takes 64 KB (K, V) + 32 KB per stage of shared memory (195 KB at 4 stages), d = 64 half of it.
# One consumer warp group (block_n 64, num_warps 4, e.g. "32,64,3,4,ws"; `varlen_bwd_gluon_ws`, ONE CONSUMER):
# 64-key tiles, <= ~113 KB of shared memory so that two CTAs share an SM (`dkdv_ws_resources`: ctas_per_sm 2,
# maxnreg 128, consumer 232 registers), one CTA's K/V prologue and dK/dV epilogue hidden behind the other's
# steps -- for short documents (W8: ~5 steps per 128-key tile, 31 waves of one CTA per SM), as the forward's
# 64 x 64 one-warp-group config (the default at d = 128, above). Without spills for every mask, bf16 / fp16, d 64 / 128 and the tree mask
# (consumer registers used at d = 128 / 64; shared memory at d = 128): (32, 64, 2 / 3 / 4 stages) ~200-206 /
# ~135, 66 / 83 / 100 KB; (64, 64, 2 stages) 230 of 232 / ~170, 100 KB (tight: 64 queries per step hold S^T and
# dP^T in 32 registers each); at d = 64 also (64, 64, 3 stages), 68 KB. Not persistent (refused). (32, 64, 3 / 4
# stages) measured slower than (64, 64, 2) everywhere and slower than two consumers on W1.
DKDV_WS_ALTERNATIVES = {64: [GluonBwdConfig(64, 128, 4, 8, True), GluonBwdConfig(64, 128, 2, 8, True),
                             GluonBwdConfig(64, 64, 3, 4, True)],
                        128: [GluonBwdConfig(64, 128, 4, 8, True), GluonBwdConfig(64, 128, 3, 8, True),
                              GluonBwdConfig(32, 64, 3, 4, True), GluonBwdConfig(32, 64, 4, 4, True),
                              GluonBwdConfig(64, 64, 2, 4, True)]}
DKDV_ALTERNATIVES = {64: [GluonBwdConfig(64, 64, 4, 4)] + DKDV_WS_ALTERNATIVES[64],
                     128: [GluonBwdConfig(32, 128, 4), GluonBwdConfig(32, 64, 4, 4)] + DKDV_WS_ALTERNATIVES[128]}
# Warp-specialised dQ (",ws", `varlen_bwd_gluon_dq_ws`; the default at d = 128 since 2026-11-23, fifth session):
# H200 A/B (results/2026-11-23/ab_gluon_dq_ws_h200.txt), (128, 64, 4 stages) vs the non-specialised Gluon dQ:
# W1 1.264 -> 1.088 ms, W2 2.393 -> 2.049, W4 3.005 -> 2.544 (1.15-1.18x); 43 nasty cases ok.
# 128-query tiles, two consumer warp groups of 64 queries, (K, V) ring by a 1-warp producer. block_n 64
# with >= 3 stages carries dS[j] into step j+1 (the non-specialised kernel's schedule); block_n 128
# (2 stages: 192 KB at d = 128) finishes each block's dQ product in its step. (128, 64) configs keep the
# Triton dQ pass's blocks, so the triton backend's dQ tile table fits them (`triton_varlen.dq_choice`).
# ",ws,persistent" (`varlen_bwd_gluon_dq_ws`, PERSISTENT: ctas_per_sm x SMs programs loop over the work items, as
# the persistent WS dK/dV) compiles without spills for (128, 64, 3 or 4 stages), every mask, d 64 / 128; built, not
# yet measured on a GPU, so off by default ($PACKATTN_GLUON_DQ_CONFIG=128,64,4,8,ws,persistent selects it).
# One consumer warp group (block_m 64, num_warps 4, e.g. "64,64,2,4,ws"; `varlen_bwd_gluon_dq_ws`, ONE CONSUMER), as the
# one-consumer dK/dV above: 64-query tiles, <= ~113 KB of shared memory so that two CTAs share an SM (`dq_ws_resources`:
# ctas_per_sm 2, maxnreg 128, consumer 232 registers), one CTA's Q/dO prologue and dQ epilogue hidden behind the other's
# steps. Shared memory: 64 queries of Q + dO and each (K, V) ring slot of 64 keys take 32 KB each at d = 128, 16 KB at
# d = 64: at d = 128 only (64, 64, 2 stages) fits two CTAs (96 KB; 3 stages take 128 KB: one CTA per SM, `ws_split` then
# gives maxnreg 256, which ptxas ignores with a warning, and the consumer 256 registers: not listed), at d = 64 (64, 64,
# 2 / 3 / 4 stages) and (64, 128, 2 stages) do (48-80 KB). Without spills or ptxas warnings for every mask, bf16 / fp16
# (consumer registers used of 232; compiled shared memory): d = 128 (64, 64, 2) 175-183, 98540 B; d = 64 (64, 64,
# 2 / 3 / 4) 137-152, 49388 / 65804 / 82188 B, (64, 128, 2) 203-217, 82156 B. Not persistent (refused:
# `check_dq_ws_config`). The dQ tile table follows the config's blocks (`triton_varlen.dq_choice`); the tree dQ
# (`use_gluon_tree_dq`) only runs 128 x 64 tiles. On GPUs since the ninth session (d = 128: `DQ_SHORT_CONFIGS`).
DQ_WS_ALTERNATIVES = {64: [GluonBwdConfig(128, 64, 4, 8, True), GluonBwdConfig(128, 128, 2, 8, True),
                           GluonBwdConfig(64, 64, 2, 4, True), GluonBwdConfig(64, 64, 3, 4, True),
                           GluonBwdConfig(64, 64, 4, 4, True), GluonBwdConfig(64, 128, 2, 4, True)],
                      128: [GluonBwdConfig(128, 64, 4, 8, True), GluonBwdConfig(128, 64, 3, 8, True),
                            GluonBwdConfig(128, 128, 2, 8, True), GluonBwdConfig(64, 64, 2, 4, True)]}
DQ_ALTERNATIVES = {64: [GluonBwdConfig(64, 64, 4, 4)] + DQ_WS_ALTERNATIVES[64],
                   128: [GluonBwdConfig(128, 64, 3), GluonBwdConfig(128, 32, 4), GluonBwdConfig(64, 64, 3, 4)]
                   + DQ_WS_ALTERNATIVES[128]}
# "block_m,block_n,stages,num_warps[,ws[,persistent]]" overrides DKDV_CONFIGS / DQ_CONFIGS (A/B runs)
ENV_DKDV = "PACKATTN_GLUON_DKDV_CONFIG"
ENV_DQ = "PACKATTN_GLUON_DQ_CONFIG"


def parse_config(text: str) -> GluonBwdConfig:
    """``"block_m,block_n,stages,num_warps[,ws[,persistent]]"`` (``ws``: warp_specialize, ``persistent``:
    a persistent grid, warp-specialised kernels only), e.g. ``"32,128,4,8"``, ``"64,128,4,8,ws"`` (dK/dV),
    ``"128,64,4,8,ws"`` (dQ), ``"128,64,4,8,ws,persistent"``; the format of ``$PACKATTN_GLUON_DKDV_CONFIG`` /
    ``_DQ_CONFIG``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if len(parts) not in (4, 5, 6) or parts[4:] not in ([], ["ws"], ["ws", "persistent"]):
        raise ValueError(f"{text!r}: expected block_m,block_n,stages,num_warps[,ws[,persistent]]")
    return GluonBwdConfig(*(int(x) for x in parts[:4]), warp_specialize=len(parts) >= 5, persistent=len(parts) == 6)


def _config(name: str, table: dict, head_dim: int) -> GluonBwdConfig:
    override = env.get(name)
    if override:
        return parse_config(override)
    return table[head_dim]


def dkdv_config(head_dim: int, group: int = 1) -> GluonBwdConfig:
    """Blocks of the dK/dV kernel for query heads per kv head ``group`` (``$PACKATTN_GLUON_DKDV_CONFIG``
    overrides; `DKDV_GQA_CONFIGS` from `DKDV_GQA_GROUP`); its tile table is
    ``tile_table(seqs, mask, True, cfg.block_n, cfg.block_m)``. A warp-specialised config must be one
    the kernel takes (`check_dkdv_ws_config`: ValueError otherwise, before a table is built)."""
    table = {**DKDV_CONFIGS, **DKDV_GQA_CONFIGS} if group >= DKDV_GQA_GROUP else DKDV_CONFIGS
    cfg = _config(ENV_DKDV, table, head_dim)
    if cfg.warp_specialize:
        check_dkdv_ws_config(cfg)
    return cfg


def dq_config(head_dim: int, short_seqs: bool = False) -> GluonBwdConfig:
    """Blocks of the dQ kernel (``$PACKATTN_GLUON_DQ_CONFIG`` overrides; ``short_seqs``: no sequence
    longer than `triton_varlen.SHORT_SEQLEN`, `DQ_SHORT_CONFIGS`); its tile table is
    ``tile_table(seqs, mask, False, cfg.block_m, cfg.block_n)``. A warp-specialised config must be one the
    kernel takes (`check_dq_ws_config`: ValueError otherwise, before a table is built)."""
    table = {**DQ_CONFIGS, **DQ_SHORT_CONFIGS} if short_seqs else DQ_CONFIGS
    cfg = _config(ENV_DQ, table, head_dim)
    if cfg.warp_specialize:
        check_dq_ws_config(cfg)
    return cfg


def gluon_bwd_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Device, dtype, head dim and GQA test of `gluon_bwd_supported`, without strides (the launchers
    copy what TMA cannot read): stable between the forward (which builds the tile tables) and the
    backward (which launches), so both sides can call it and agree."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return False
    if _capability(cuda_index(q.device))[0] != 9:
        return False
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    d = q.shape[-1]
    return d in HEAD_DIMS and k.shape[-1] == d and v.shape[-1] == d and q.shape[1] % k.shape[1] == 0


def gluon_bwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> bool:
    """Can the Gluon backward run these inputs without copies? `gluon_bwd_eligible`, dout shaped
    and typed like q, and every tensor viewable as a TMA ``(rows, heads * d)`` matrix."""
    return (gluon_bwd_eligible(q, k, v) and dout.is_cuda and dout.dtype == q.dtype and dout.shape == q.shape
            and gluon_fwd_supported(q, k, v) and gluon_fwd_supported(dout, k))


def dkdv_shared_bytes(cfg: GluonBwdConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one warp-specialised dK/dV CTA: K and V of the tile, the (Q, dO) ring, lse /
    delta per ring slot, the consumers' query-position tables, the mbarriers (``kv_bar``, with two
    consumers ``zero_bar``, the ring's)."""
    consumers = cfg.block_n // 64
    return ((2 * cfg.block_n + 2 * cfg.stages * cfg.block_m) * head_dim * element_size
            + 4 * (2 * cfg.stages * cfg.block_m + consumers * cfg.block_m) + 8 * (consumers + 2 * cfg.stages))


def check_dkdv_ws_config(cfg: GluonBwdConfig) -> None:
    """Raise ValueError unless the warp-specialised dK/dV kernel takes ``cfg``: two consumer warp groups
    (block_n 128, num_warps 8), or one (block_n 64, num_warps 4; not persistent), 32 or 64 queries per step,
    >= 2 stages."""
    two = (cfg.block_n, cfg.num_warps) == (128, 8)
    one = (cfg.block_n, cfg.num_warps) == (64, 4)
    if not cfg.warp_specialize or not (one or two) or cfg.block_m not in (32, 64) or cfg.stages < 2:
        raise ValueError(f"{cfg.label()}: the warp-specialised dK/dV kernel takes block_m 32 / 64, stages >= 2 and "
                         "block_n 128 with num_warps 8 (two consumer warp groups) or block_n 64 with num_warps 4 "
                         "(one), ws")
    if one and cfg.persistent:
        raise ValueError(f"{cfg.label()}: the persistent dK/dV grid needs two consumer warp groups "
                         "(block_n 128, num_warps 8)")


@functools.lru_cache(maxsize=None)
def dkdv_ws_resources(cfg: GluonBwdConfig, head_dim: int) -> dict:
    """Register split of the warp-specialised dK/dV kernel, as `triton_fwd_gluon.ws_resources` does
    it for the forward (same SM constants, this kernel's shared memory): ``ctas_per_sm``, ``warps``
    (consumers + the producer warp, padded to warp groups), ``maxnreg`` (launch bound),
    ``consumer_regs`` / ``producer_regs`` (setmaxnreg of the partitions). At d = 128, block_n 128:
    one CTA per SM, 12 warps, maxnreg 168, consumers 240, producer 24. One consumer warp group
    (block_n 64, num_warps 4) with <= ~113 KB of shared memory (at d = 128: 64,64,2 or 32,64,2 / 3 / 4):
    two CTAs per SM, 8 warps each (the producer padded to a warp group), maxnreg 128, consumer 232."""
    check_dkdv_ws_config(cfg)
    return ws_split(cfg.num_warps, dkdv_shared_bytes(cfg, head_dim))


def dq_ws_shared_bytes(cfg: GluonBwdConfig, head_dim: int, element_size: int = 2, delta_from_o: bool = False) -> int:
    """Shared memory of one warp-specialised dQ CTA: Q and dO of the tile (``delta_from_o``: and O, see
    `gluon_launch_dq`), the (K, V) ring, the mbarriers (``q_bar``, with two consumers ``zero_bar``, the
    ring's)."""
    consumers = cfg.block_m // 64
    tiles = 3 if delta_from_o else 2
    return ((tiles * cfg.block_m + 2 * cfg.stages * cfg.block_n) * head_dim * element_size
            + 8 * (consumers + 2 * cfg.stages))


def check_dq_ws_config(cfg: GluonBwdConfig) -> None:
    """Raise ValueError unless the warp-specialised dQ kernel takes ``cfg``: two consumer warp groups
    (block_m 128, num_warps 8), or one (block_m 64, num_warps 4; not persistent), 64 or 128 keys per step,
    >= 2 stages."""
    two = (cfg.block_m, cfg.num_warps) == (128, 8)
    one = (cfg.block_m, cfg.num_warps) == (64, 4)
    if not cfg.warp_specialize or not (one or two) or cfg.block_n not in (64, 128) or cfg.stages < 2:
        raise ValueError(f"{cfg.label()}: the warp-specialised dQ kernel takes block_n 64 / 128, stages >= 2 and "
                         "block_m 128 with num_warps 8 (two consumer warp groups) or block_m 64 with num_warps 4 "
                         "(one), ws")
    if one and cfg.persistent:
        raise ValueError(f"{cfg.label()}: the persistent dQ grid needs two consumer warp groups "
                         "(block_m 128, num_warps 8)")


def dq_computes_delta(cfg: GluonBwdConfig | None) -> bool:
    """Can the dQ kernel of ``cfg`` compute delta itself (``gluon_launch_dq(..., delta_from_o=True)``)? The
    warp-specialised one without a persistent grid, with one or two consumer warp groups."""
    return cfg is not None and cfg.warp_specialize and not cfg.persistent


def one_consumer_dq(cfg: GluonBwdConfig | None) -> bool:
    """Is ``cfg`` the one-consumer warp-specialised dQ kernel (block_m 64, ws, not persistent; `check_dq_ws_config`
    holds for it), the one whose delta computation (``gluon_launch_dq(..., delta_from_o=True)``) the backward
    has computed since the eleventh session (`fused_delta_dq`)?"""
    return cfg is not None and cfg.warp_specialize and (cfg.block_m, cfg.num_warps) == (64, 4) and not cfg.persistent


# DELTA FROM O with two consumer warp groups (block_m 128, `varlen_bwd_gluon_dq_delta`: each consumer sums its own 64
# rows of the O tile): at d = 128 the O tile takes 32 KB of the 35 KB that (128, 64, 4 stages) leaves (229760 B
# compiled, one CTA per SM), consumers 215-224 of 240 registers, no spills, the overlap check passes
# (scripts/check_gluon_bwd_compile.py --kernels dq --delta-from-o --config 128,64,4,8,ws). It drops the preprocess
# of long batches (95 us of W1's / W4's f+b on an H100, 187 us of W2's) for a dQ pass 3-7% longer. Measured on an H100
# (sixteenth session, kernel_breakdown A/B interleaved x3, results/2026-11-25/s16_fused_delta_ab_h100.txt): GPU per
# f+b against the unchanged forward kernel -1.6% W1, -1.1% W2, -0.4% W4; so the default wherever the dQ config can
# (`dq_computes_delta`). ``$PACKATTN_GLUON_FUSED_DELTA=0`` keeps the preprocess for two consumer warp groups (A/B).
ENV_FUSED_DELTA = "PACKATTN_GLUON_FUSED_DELTA"


def fused_delta_dq(cfg: GluonBwdConfig | None) -> bool:
    """Does the dQ pass of ``cfg`` compute delta in the backward (`triton_varlen.fuses_delta`)? Every config that
    can (`dq_computes_delta`); with ``$PACKATTN_GLUON_FUSED_DELTA=0`` (`ENV_FUSED_DELTA`) only the one-consumer
    one."""
    return one_consumer_dq(cfg) or (dq_computes_delta(cfg) and env.get(ENV_FUSED_DELTA) != "0")


@functools.lru_cache(maxsize=None)
def dq_ws_resources(cfg: GluonBwdConfig, head_dim: int, delta_from_o: bool = False) -> dict:
    """Register split of the warp-specialised dQ kernel (`varlen_bwd_gluon_dq_ws`), as `dkdv_ws_resources`:
    ``ctas_per_sm``, ``warps``, ``maxnreg``, ``consumer_regs``, ``producer_regs``. At d = 128 (block_m 128,
    block_n 64 with 4 stages or 128 with 2: ~192 KB of shared memory): one CTA per SM, 12 warps, maxnreg
    168, consumers 240, producer 24. One consumer warp group (block_m 64, num_warps 4) with <= ~113 KB of
    shared memory (at d = 128: 64,64,2; at d = 64: 64,64,2 / 3 / 4 and 64,128,2): two CTAs per SM, 8 warps
    each (the producer padded to a warp group), maxnreg 128, consumer 232 -- also with ``delta_from_o`` (O
    tile too: 112 KB at d = 128, 64,64,2). The config must be one the kernel takes (`check_dq_ws_config`)."""
    check_dq_ws_config(cfg)
    return ws_split(cfg.num_warps, dq_ws_shared_bytes(cfg, head_dim, delta_from_o=delta_from_o))


def gluon_launch_dkdv(q, k, v, dout, lse, delta, dk, dv, tiles, seq_args, scale: float, mask_args,
                      top_left: bool, key_end: torch.Tensor | None = None,
                      config: GluonBwdConfig | None = None, short_seqs: bool = False) -> None:
    """dK/dV pass (`varlen_bwd_dkdv_gluon_kernel`, or `varlen_bwd_gluon_ws.varlen_bwd_dkdv_gluon_ws_kernel`
    when the config says ``warp_specialize``), one program per (key tile, kv head). ``tiles``
    built with ``dkdv_config(d).block_n`` keys per tile and ``.block_m`` as the query step; ``lse`` /
    ``delta`` float32 ``(heads_q, rows)`` with row stride 1; ``dk`` / ``dv`` written on the rows of
    sequences only (the caller fills padding rows). ``key_end`` (int32 `Tree.row_subtree_end`): the
    tree mask (warp-specialised kernel only; ``tiles`` from `triton_tree.build_key_tiles`, ``seq_args``
    one sequence of all rows); ``mask_args`` / ``top_left`` are then ignored. ``config``: `dkdv_config`'s
    answer when the caller has it already (saves re-reading the environment). ``short_seqs``: a batch of
    short sequences (`triton_fwd_gluon.heads_per_section`'s work order)."""
    heads_kv = k.shape[1]
    grid = (tiles.shape[0] * heads_kv,)
    if grid[0] == 0 or k.shape[0] == 0:
        return
    if q.shape[0] == 0:  # no queries anywhere: no key gets a gradient (and a TMA tensor needs rows)
        dk.zero_()
        dv.zero_()
        return
    lse, delta = lse.contiguous(), delta.contiguous()  # (`_descriptor` copies what TMA cannot read)
    cfg = config if config is not None else dkdv_config(q.shape[-1], q.shape[1] // k.shape[1])
    tree = key_end is not None
    if tree:
        if not cfg.warp_specialize:
            raise ValueError(f"the tree mask needs the warp-specialised dK/dV kernel (config {cfg.label()})")
        mask_args, top_left = (-1, -1, 0), False  # no window / chunk: the constexprs select the tree mask alone
    tensors = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
               _descriptor(dout, cfg.block_m), lse, delta, dk, dv, tiles, *seq_args)
    scalars = (*dk.stride()[:2], *dv.stride()[:2], lse.stride()[0],
               heads_kv, q.shape[1] // heads_kv, scale * LOG2E, scale, *mask_args)
    blocks = dict(HEAD_DIM=q.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                  **_mask_constexprs(*mask_args, top_left))
    if cfg.warp_specialize:
        from packattn.ops.varlen.bwd_dkdv_sm90 import varlen_bwd_dkdv_gluon_ws_kernel

        res = dkdv_ws_resources(cfg, q.shape[-1])
        key_end = key_end if tree else tiles  # KeyEnd: any int32 pointer without the tree mask
        section = heads_per_section(q.shape[1], q.shape[1] // heads_kv, short_seqs) * heads_kv // q.shape[1]  # kv heads
        num_work = grid[0]
        if cfg.persistent:
            grid = (ws_grid(q.device, cfg, num_work, res),)
        if num_work + grid[0] >= 2**30:  # the persistent kernel packs the item index into 30 bits
            raise ValueError(f"too many dK/dV work items ({num_work})")
        fast_launch.launch(varlen_bwd_dkdv_gluon_ws_kernel, grid, (*tensors, key_end, *scalars, section, num_work),
                           dict(blocks, TREE=tree, PERSISTENT=cfg.persistent, CONSUMER_REGS=res["consumer_regs"],
                                PRODUCER_REGS=res["producer_regs"], num_warps=4, maxnreg=res["maxnreg"]))
        return
    from packattn.ops.varlen.bwd_sm90 import varlen_bwd_dkdv_gluon_kernel

    fast_launch.launch(varlen_bwd_dkdv_gluon_kernel, grid, (*tensors, *scalars), dict(blocks, num_warps=cfg.num_warps))


def gluon_launch_dq(q, k, v, dout, lse, delta, dq, tiles, seq_args, scale: float, mask_args, top_left: bool,
                    config: GluonBwdConfig | None = None, delta_from_o: bool = False, out=None,
                    short_seqs: bool = False) -> None:
    """dQ pass (`varlen_bwd_dq_gluon_kernel`, or `varlen_bwd_gluon_dq_ws.varlen_bwd_dq_gluon_ws_kernel` when
    the config says ``warp_specialize``), one program per (query tile, query head), or with ``persistent``
    (warp-specialised only) ``ctas_per_sm x SMs`` programs looping over them (`ws_grid`). ``tiles`` built with
    ``dq_config(d).block_m`` queries per tile and ``.block_n`` as the key step; ``dq`` written on the rows
    of sequences only. ``config``: `dq_config`'s answer when the caller has it already. ``short_seqs``: a batch of
    short sequences (`triton_fwd_gluon.heads_per_section`'s work order).

    ``delta_from_o`` (a WS config without a persistent grid, `dq_computes_delta`; ValueError otherwise): the kernel
    computes delta = rowsum(dO * O) itself from ``out`` (the forward output, O; loaded by TMA with Q / dO,
    `varlen_bwd_gluon_dq_delta`) and WRITES it into ``delta`` (float32, lse's shape, contiguous:
    written in place, not copied) on the rows of the tiles that have key blocks; other rows keep what
    ``delta`` held (the caller passes zeros, `triton_varlen.fuses_delta`). No dlse term: the caller
    subtracts nothing."""
    cfg = config if config is not None else dq_config(q.shape[-1])
    if delta_from_o:
        if not dq_computes_delta(cfg):
            raise ValueError(f"delta_from_o needs a warp-specialised dQ config without a persistent grid, "
                             f"not {cfg.label()}")
        if out is None or out.shape != dout.shape or out.dtype != dout.dtype:
            raise ValueError("delta_from_o needs out (O) shaped and typed like dout")
        if not delta.is_contiguous() or delta.shape != lse.shape:
            raise ValueError("delta_from_o writes delta in place: it must be contiguous and shaped like lse")
    heads_q = q.shape[1]
    grid = (tiles.shape[0] * heads_q,)
    if grid[0] == 0 or q.shape[0] == 0:
        return
    if k.shape[0] == 0:  # no keys anywhere: every query sees nothing
        dq.zero_()
        return
    lse, delta = lse.contiguous(), delta.contiguous()  # (`_descriptor` copies what TMA cannot read)
    descs = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
             _descriptor(dout, cfg.block_m))
    rest = (lse, delta, dq, tiles, *seq_args, *dq.stride()[:2], lse.stride()[0],
            heads_q, heads_q // k.shape[1], scale * LOG2E, scale, *mask_args)
    blocks = dict(HEAD_DIM=q.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                  **_mask_constexprs(*mask_args, top_left))
    if cfg.warp_specialize:
        from packattn.ops.varlen.bwd_dq_sm90 import varlen_bwd_dq_gluon_ws_kernel

        res = dq_ws_resources(cfg, q.shape[-1], delta_from_o)
        section = heads_per_section(heads_q, heads_q // k.shape[1], short_seqs)
        num_work = grid[0]
        if cfg.persistent:
            grid = (ws_grid(q.device, cfg, num_work, res),)
        if num_work + grid[0] >= 2**30:  # the persistent kernel packs the item index into 30 bits
            raise ValueError(f"too many dQ work items ({num_work})")
        # o_desc: None without delta_from_o (a constant for Triton: no kernel parameter, the PTX of the kernel
        # without DELTA_FROM_O unchanged)
        o_desc = _descriptor(out, cfg.block_m) if delta_from_o else None
        fast_launch.launch(varlen_bwd_dq_gluon_ws_kernel, grid, (*descs, o_desc, *rest, section, num_work),
                           dict(blocks, PERSISTENT=cfg.persistent, DELTA_FROM_O=delta_from_o,
                                CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4,
                                maxnreg=res["maxnreg"]))
        return
    from packattn.ops.varlen.bwd_sm90 import varlen_bwd_dq_gluon_kernel

    fast_launch.launch(varlen_bwd_dq_gluon_kernel, grid, (*descs, *rest), dict(blocks, num_warps=cfg.num_warps))


def gluon_varlen_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                     dq_tiles, dkdv_tiles, scale: float, window_left: int, window_right: int, chunk_size: int,
                     top_left: bool, padded_q: bool, padded_kv: bool, pad_rows_q=None, pad_rows_kv=None):
    """``(dq, dk, dv)`` exactly as ``packattn::varlen_bwd`` computes them (same arguments), with the
    Gluon kernels; the tile tables must come from `dkdv_config` / `dq_config` (module docstring)."""
    from packattn.backends.triton_varlen import _new_output, bwd_delta

    lse = lse.contiguous()
    delta = bwd_delta(out, dout, lse, dlse)
    dq = _new_output(q.shape, q.dtype, q.device, padded_q, pad_rows_q)
    dk = _new_output(k.shape, k.dtype, k.device, padded_kv, pad_rows_kv)
    dv = _new_output(v.shape, v.dtype, v.device, padded_kv, pad_rows_kv)
    seq_args = (cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv)
    mask_args = (window_left, window_right, chunk_size)
    gluon_launch_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_tiles, seq_args, scale, mask_args, top_left)
    gluon_launch_dq(q, k, v, dout, lse, delta, dq, dq_tiles, seq_args, scale, mask_args, top_left)
    return dq, dk, dv
