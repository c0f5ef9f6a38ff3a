"""Every tile table, threshold and per-GPU choice of the varlen kernels, in one place.

* which kernels may run at all: `HEAD_DIMS`, `DTYPES`; where the sm_90 Gluon kernels may: the forward at
  `GLUON_FWD_HEAD_DIMS`, the backward at `GLUON_HEAD_DIMS`, dtypes `GLUON_DTYPES` (passed to `sm90.sm90_runs`;
  every Gluon table covers them, `_check_tables`; head dims named by `sm90.dims_key`: ``d``, or ``(d, d_v)``);
* the portable Triton kernels: `launch_config` over `HOPPER_CONFIGS` / `HOPPER_LONG_FWD_CONFIGS` (sm_90),
  `FALLBACK_CONFIGS` (other CUDA GPUs), `FP32_CONFIGS`, `INTERPRETER_CONFIGS`;
* the sm_90 Gluon forward (`config_for`, all its tables by name: `fwd_tables`): `CONFIGS`, `LONG_CONFIGS`,
  `SHORT_CONFIGS` on `SHORT_CONFIG_GPUS`, `SHORT_DEFAULT_CONFIGS` elsewhere and at the head dims `SHORT_CONFIGS`
  lacks, `SHORT_MASKED_CONFIGS` under a mask at the rest (entries of `RELEASE_FWD_CONFIGS` replace theirs on
  the Triton release they name); it runs from `GLUON_MIN_SEQLEN` rows;
* the sm_90 Gluon backward (warp-specialised kernels): `dkdv_config` (`DKDV_CONFIGS`, `DKDV_GQA_CONFIGS` from
  `DKDV_GQA_GROUP`) and `dq_config` (`DQ_CONFIGS`, `DQ_SHORT_CONFIGS`); the Gluon dQ computes delta itself where
  its config's ``fused_delta`` says so (`packattn.ops.varlen.op.fuses_delta`);
* batch length classes: `LONG_SEQLEN`, and `SHORT_SEQLEN` (`packattn.lengths`, shared with dispatch);
* the Gluon kernels' work order: `heads_per_section` (`HEAD_SECTION`, `SHORT_HEAD_SECTION`).

Experiments change these in-process with `override` (tests and benchmark scripts; no environment
variables). The reasons behind each entry are in benchmarks/NOTES.md (versions named below).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import torch

from packattn.lengths import SHORT_SEQLEN, short_batch  # noqa: F401 (a length class of these tables)
from packattn.ops.runtime.launch import LaunchConfig, block_d, overriding
from packattn.ops.runtime.support import cuda_index, interpreting, triton_release, triton_version

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The head dims and dtypes of the sm_90 Gluon kernels (the plans ask `sm90.sm90_runs` with these): `CONFIGS`,
# `LONG_CONFIGS` and `DQ_CONFIGS` hold a config for each head dim, the other Gluon tables a subset
# (`_check_tables`, at import and in `override`); a dim added here needs its configs, and vice versa.
# 96 and 192 run in two power-of-two column parts, and MLA value head dims too (`fwd_sm90_parts`,
# `bwd_*_sm90_parts`).
GLUON_HEAD_DIMS = (64, 96, 128, 192, 256, (192, 128), (128, 64))
# The forward's: every dim of GLUON_HEAD_DIMS; where only the forward is Gluon the backward runs the Triton passes.
GLUON_FWD_HEAD_DIMS = GLUON_HEAD_DIMS
GLUON_DTYPES = (torch.float16, torch.bfloat16)
# Some sequence with >= LONG_SEQLEN queries: the forward takes its long-sequence configs (NOTES.md, v7).
LONG_SEQLEN = 8192
# The Gluon forward runs when some sequence has >= GLUON_MIN_SEQLEN queries: on shorter documents the
# Triton forward is as fast, and below 128 rows not measured (NOTES.md, v13 and v19).
GLUON_MIN_SEQLEN = 128


# ---------------------------------------------------------------- Triton kernels
# (kernel, padded head dim BLOCK_D) -> config. fwd and dq run per query tile, dkdv per key tile. BLOCK_D 128 (head
# dims 96, 128): the best of a sweep on the H200 (NOTES.md, v4 and v7); BLOCK_D 256 (head dims 192, 256): the best
# of a sweep on the H100 (NOTES.md, v33); the others are only checked to compile for sm_90a and fit in shared
# memory (scripts/check_triton_compile.py).
HOPPER_CONFIGS = {
    ("fwd", 32): LaunchConfig(128, 128, 4, 3),
    ("fwd", 64): LaunchConfig(128, 128, 8, 3),
    ("fwd", 128): LaunchConfig(128, 32, 4, 4),
    ("fwd", 256): LaunchConfig(64, 32, 4, 2),
    ("dq", 32): LaunchConfig(128, 64, 8, 2),
    ("dq", 64): LaunchConfig(128, 64, 8, 2),
    ("dq", 128): LaunchConfig(128, 64, 8, 3),
    ("dq", 256): LaunchConfig(64, 16, 4, 2),
    ("dkdv", 32): LaunchConfig(64, 128, 8, 2),
    ("dkdv", 64): LaunchConfig(64, 128, 8, 2),
    ("dkdv", 128): LaunchConfig(32, 64, 4, 3),
    ("dkdv", 256): LaunchConfig(32, 32, 4, 2),
}
# Forward of batches with a sequence of >= LONG_SEQLEN queries, BLOCK_D 128: 8 warps over 64-key blocks measured
# faster on one long document (W4), the table's on mixes of shorter ones (NOTES.md, v7).
HOPPER_LONG_FWD_CONFIGS = {128: LaunchConfig(128, 64, 8, 3)}
# other CUDA GPUs (Ampere/Ada: less shared memory)
FALLBACK_CONFIGS = {
    ("fwd", 128): LaunchConfig(64, 64, 4, 2),
    ("fwd", 256): LaunchConfig(64, 32, 4, 1),
    ("dq", 128): LaunchConfig(64, 32, 4, 2),
    ("dq", 256): LaunchConfig(32, 32, 4, 1),
    ("dkdv", 128): LaunchConfig(32, 64, 4, 2),
    ("dkdv", 256): LaunchConfig(32, 32, 4, 1),
}
# float32 inputs (IEEE dots: no tensor cores, twice the bytes per tile) on any CUDA GPU
FP32_CONFIGS = {
    ("fwd", 128): LaunchConfig(64, 32, 4, 2),
    ("fwd", 256): LaunchConfig(32, 32, 4, 1),
    ("dq", 128): LaunchConfig(64, 32, 4, 2),
    ("dq", 256): LaunchConfig(32, 32, 4, 1),
    ("dkdv", 128): LaunchConfig(32, 64, 4, 2),
    ("dkdv", 256): LaunchConfig(32, 32, 4, 1),
}
# Triton's interpreter: small blocks, deliberately different M and N so mix-ups show in tests
INTERPRETER_CONFIGS = {"fwd": LaunchConfig(32, 16, 1, 1), "dq": LaunchConfig(32, 16, 1, 1),
                       "dkdv": LaunchConfig(16, 32, 1, 1)}
PREPROCESS_BLOCK_M = 64  # rows per program of the backward preprocess (`launch_triton.bwd_delta`)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def launch_config(kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device,
                  long_seqs: bool = False) -> LaunchConfig:
    """Block sizes and launch options of the Triton ``kernel`` ("fwd", "dq", "dkdv") at tile width ``head_dim``
    (the launchers and the tile tables go through `triton_config`). ``long_seqs``: some sequence has at least
    `LONG_SEQLEN` queries."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_CONFIGS[kernel]
    bd = block_d(head_dim)
    if dtype == torch.float32:
        table = FP32_CONFIGS
    else:
        table = HOPPER_CONFIGS if _is_hopper(cuda_index(device)) else FALLBACK_CONFIGS
        if kernel == "fwd" and long_seqs and table is HOPPER_CONFIGS and bd in HOPPER_LONG_FWD_CONFIGS:
            return HOPPER_LONG_FWD_CONFIGS[bd]
    return table.get((kernel, bd)) or table[(kernel, 128 if bd <= 128 else 256)]


def triton_config(kernel: str, q: torch.Tensor, v: torch.Tensor, long_seqs: bool = False) -> LaunchConfig:
    """`launch_config` of the Triton ``kernel`` on these tensors, for the launchers and the tile tables alike: the
    tile width is the wider of the q/k and v head dims (with MLA the wider tile bounds shared memory and
    registers)."""
    return launch_config(kernel, max(q.shape[-1], v.shape[-1]), q.dtype, q.device, long_seqs)


# ---------------------------------------------------------------- Gluon forward (sm_90)
@dataclass(frozen=True)
class GluonConfig:
    """A configuration of the warp-specialised Gluon forward (`packattn.ops.varlen.fwd_sm90`): a 1-warp TMA
    producer and one consumer partition per warp group of 64 query rows, a persistent grid, the output stored
    from registers (``vec_store``: after a conversion inside each warp, `common_sm90.quad_vec_layout`)."""

    block_m: int  # queries per tile: one consumer warp group per 64 rows, so block_m == 16 * num_warps
    block_n: int  # keys per block
    stages: int  # K/V ring slots (>= 2)
    num_warps: int  # consumer warps (block_m // 16); the launch adds the producer warp
    # each consumer warp group skips the products of the tile's key blocks in which no key is visible to any of
    # its 64 rows (with 64-key blocks: the causal diagonal's second block for a 128-row tile's first rows)
    trim: bool = False
    # lazy rescaling (None: off, the kernel's code as without it), in log2 units: a row's running max moves only
    # when a block's max exceeds it by more than this (P <= 2^t: at most 15, fp16's P operand), and a consumer
    # warp group skips the O rescale when none of its rows moved.
    rescale_threshold: float | None = None
    # separate K and V barriers in the ring: a slot's K goes back to the producer once S is done, its V once PV
    # is, so the next K loads under the softmax and PV (False: one barrier for both, released after PV)
    split_kv: bool = False
    # Q as the S product's A operand in registers (loaded once a tile, its shared memory released at once) instead
    # of read from shared memory by every wgmma
    q_in_regs: bool = False
    # the output (its first value part: all of a power-of-two value dim) stored as 16-byte row pieces after a
    # conversion inside each warp (`common_sm90.quad_vec_layout`; its scratch, `launch_sm90.VEC_STORE_SCRATCH`,
    # added to the CTA's shared memory) instead of 4-byte column pairs straight from the accumulator registers
    vec_store: bool = False

    def __post_init__(self):
        if self.block_m != 16 * self.num_warps or self.block_m not in (64, 128):
            raise ValueError(f"{self}: block_m must be 64 or 128 and equal 16 * num_warps")
        if self.stages < 2:
            raise ValueError(f"{self}: stages must be >= 2")
        t = self.rescale_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 15):
            raise ValueError(f"{self}: rescale_threshold must be None or a number in [0, 15]")
        if not all(isinstance(flag, bool) for flag in (self.split_kv, self.q_in_regs, self.vec_store)):
            raise TypeError(f"{self}: split_kv, q_in_regs and vec_store must be bools")


# d = 128, 128 x 128, 3 stages: Q 32 KB + 3 x (K 32 KB + V 32 KB) = 224 KB of 227; d = 64 has room for a
# fourth slot. The best or within 1% of it on W1/W2/W4/W8 (NOTES.md, v8 and v13). d = 256: 64-key blocks, 2
# stages (Q 64 KB + 2 x 64 KB = 192 KB; the 64 x 256 float32 output takes 128 of a consumer's registers) with
# separate K / V barriers, so the next K loads under the softmax and PV (32-key blocks in 3 stages, the previous
# best, are bound by their Q reads; NOTES.md, v37), and lazy rescaling: its O rescale (128 multiplies per thread a
# block) costs more than the block's softmax; at the other dims lazy rescaling is slower (v35) and the split
# barriers gain nothing (v37). 96, 192 and MLA: the best of two configs that compile for sm_90a without spills
# (v34; Triton 3.6's ptxas, see `RELEASE_FWD_CONFIGS` for 3.9); at 192 and MLA with Q in registers: their 64-key S
# products would read Q from shared memory as often as K (at 96 / 128 it is slower, v37). The output leaves in
# `vec_store`'s 16-byte pieces at 64, 96, 256 and MLA (v39, v40; at 192 no gain, v39, but in short batches it is
# on; no room at d = 128 with 3 stages; 128 / 64 untried). 192 is trimmed: with 64-key blocks the causal diagonal's
# second block holds no key the tile's first 64 rows see (-1.4% on W1 lengths with Triton 3.6, v43; at 256 and MLA
# no gain; Triton 3.9's release entry below keeps its untrimmed config).
CONFIGS = {64: GluonConfig(128, 128, 4, 8, vec_store=True), 96: GluonConfig(128, 128, 3, 8, vec_store=True),
           128: GluonConfig(128, 128, 3, 8),
           192: GluonConfig(128, 64, 3, 8, trim=True, q_in_regs=True),
           256: GluonConfig(128, 64, 2, 8, rescale_threshold=8.0, split_kv=True, vec_store=True),
           (192, 128): GluonConfig(128, 64, 4, 8, q_in_regs=True, vec_store=True),
           (128, 64): GluonConfig(128, 128, 4, 8)}
# Batches with a sequence of >= LONG_SEQLEN queries: the same tiles measured best on W4 (NOTES.md, v13). (A copy
# made before `RELEASE_FWD_CONFIGS` applies: a release entry names each table it replaces configs in.)
LONG_CONFIGS = dict(CONFIGS)
# Short batches (`short_batch`) at d = 128 on the GPUs named in SHORT_CONFIG_GPUS: 64 x 64 tiles, one consumer
# warp group, two CTAs per SM (NOTES.md, v19); on the H100 the 128-row tiles win (v22).
SHORT_CONFIGS = {128: GluonConfig(64, 64, 3, 4)}
SHORT_CONFIG_GPUS = ("H200",)
# Short batches everywhere else: 128-row tiles over 64-key blocks, trimmed. d = 128: NOTES.md, v28; 192 / 256
# (an H100, v39): faster at every short shape of the cost table, causal or not (192 GQA -25%).
SHORT_DEFAULT_CONFIGS = {128: GluonConfig(128, 64, 4, 8, trim=True),
                         192: GluonConfig(128, 64, 3, 8, trim=True, q_in_regs=True, vec_store=True),
                         256: GluonConfig(128, 64, 2, 8, trim=True, rescale_threshold=8.0, split_kv=True,
                                          vec_store=True)}
# Short batches under a causal, window or chunk mask at d = 64 / 96, where the smaller tiles skip more of each
# document's masked blocks (NOTES.md, v40: up to 2x at 160-token documents); with no mask CONFIGS' 128 x 128 tiles
# stay faster from 256-token documents up.
SHORT_MASKED_CONFIGS = {64: GluonConfig(64, 64, 3, 4, vec_store=True),
                        96: GluonConfig(128, 64, 4, 8, trim=True, vec_store=True)}
# Forward configs of one Triton release (major.minor) in place of the tables' above, applied at import. Triton 3.9
# compiles with ptxas 13.4 (and `--regAllocOptLevel=2`), which spills inside the key-block loop where 3.6's ptxas
# did not: at d = 192 with Q in registers (W1 lengths on an H100: 0.80 ms against 0.60 with Q in shared memory,
# which matches 3.6's table config there) and at d = 128 without a mask (2 spill accesses a block; the split K / V
# barriers compile clean and time the same causal). d = 96 keeps its config on 3.9 though it spills there too (7
# accesses in the loop): the configs that do not were slower (0.81-0.84 against 0.78 ms). NOTES.md, v42.
_T39_LONG = {128: GluonConfig(128, 128, 3, 8, split_kv=True), 192: GluonConfig(128, 64, 3, 8, vec_store=True)}
RELEASE_FWD_CONFIGS = {"3.9": {"CONFIGS": _T39_LONG, "LONG_CONFIGS": _T39_LONG,
                               "SHORT_DEFAULT_CONFIGS": {192: GluonConfig(128, 64, 3, 8, trim=True, vec_store=True)}}}
for _name, _entries in RELEASE_FWD_CONFIGS.get(triton_release(triton_version()), {}).items():
    globals()[_name] = {**globals()[_name], **_entries}
FORCE_FWD: GluonConfig | None = None  # `override(fwd=...)`: the config every Gluon forward takes


def config_for(head_dim: int, long_seqs: bool = False, short_seqs: bool = False,
               device: torch.device | None = None, masked: bool = False) -> GluonConfig:
    """The Gluon forward's config for ``head_dim``, the batch's length class (``long_seqs`` / ``short_seqs``) and
    mask (``masked``: causal, a window or chunks) on CUDA ``device`` (None: the current one); its query tile table
    is built with ``block_m`` / ``block_n``."""
    if FORCE_FWD is not None:
        return FORCE_FWD
    if short_seqs and head_dim in SHORT_CONFIGS and _short_config_gpu(
            cuda_index(device) if torch.cuda.is_available() else -1):
        return SHORT_CONFIGS[head_dim]
    if short_seqs and head_dim in SHORT_DEFAULT_CONFIGS:
        return SHORT_DEFAULT_CONFIGS[head_dim]
    if short_seqs and masked and head_dim in SHORT_MASKED_CONFIGS:
        return SHORT_MASKED_CONFIGS[head_dim]
    return (LONG_CONFIGS if long_seqs else CONFIGS)[head_dim]


def fwd_tables() -> dict[str, dict]:
    """Every table `config_for` reads, by name (the current ones: `override` replaces them)."""
    return {"CONFIGS": CONFIGS, "LONG_CONFIGS": LONG_CONFIGS, "SHORT_CONFIGS": SHORT_CONFIGS,
            "SHORT_DEFAULT_CONFIGS": SHORT_DEFAULT_CONFIGS, "SHORT_MASKED_CONFIGS": SHORT_MASKED_CONFIGS}


@functools.lru_cache(maxsize=None)
def _short_config_gpu(index: int) -> bool:
    """Is CUDA device ``index`` one of `SHORT_CONFIG_GPUS` (False for -1: no CUDA device)?"""
    if index < 0:
        return False
    name = torch.cuda.get_device_name(index)
    return any(gpu in name for gpu in SHORT_CONFIG_GPUS)


# Work order of the warp-specialised kernels: the query heads in sections of HEAD_SECTION kv-head groups, one
# section after the other, so the programs running at once share few heads' K/V (Q/dO) in L2 (NOTES.md, v15);
# short batches take sections of one group (v22). 0: all heads in one section.
HEAD_SECTION = 2
SHORT_HEAD_SECTION = 1


def heads_per_section(heads_q: int, group_size: int, short_seqs: bool = False) -> int:
    """Query heads per section of the work order: `HEAD_SECTION` (`SHORT_HEAD_SECTION` for a batch of
    ``short_seqs``) kv-head groups, clipped to all heads and rounded down to a divisor of the kv heads."""
    groups = SHORT_HEAD_SECTION if short_seqs else HEAD_SECTION
    heads_kv = heads_q // group_size
    if groups <= 0 or groups >= heads_kv:
        return heads_q
    while heads_kv % groups:
        groups -= 1
    return groups * group_size


# ---------------------------------------------------------------- Gluon backward (sm_90)
@dataclass(frozen=True)
class GluonBwdConfig:
    """A configuration of a warp-specialised Gluon backward pass. dK/dV: ``block_n`` keys per tile (one consumer
    warp group per 64; ``key_split``: two sharing one 64-key tile), ``block_m`` queries per ring step.
    dQ: ``block_m`` queries per tile (one consumer warp group per 64), ``block_n`` keys per step; it can compute
    delta itself (`launch_sm90.gluon_dq` with ``out``)."""

    block_m: int
    block_n: int
    stages: int  # ring slots
    num_warps: int  # the consumer warps; the launch adds the producer warp
    # dK/dV only: the key-split kernel (`launch_sm90_ksplit`, d = 192 / 256): block_m 64 queries a step, block_n
    # 64 keys, num_warps 8 (two consumer warp groups of 32 keys' S / dP each)
    key_split: bool = False
    # dQ only: the dQ pass computes delta from O (O's tile in shared memory, no preprocess kernel;
    # `op.fuses_delta`); False: the preprocess computes delta and the dQ pass has that shared memory for its ring
    fused_delta: bool = True

    def __post_init__(self):
        if not isinstance(self.key_split, bool) or not isinstance(self.fused_delta, bool):
            raise TypeError(f"{self}: key_split and fused_delta must be bools")


# dK/dV: the one-consumer warp-specialised kernel at d = 64 and 128 (NOTES.md, v11, v19 and v33); GQA groups of
# DKDV_GQA_GROUP or more keep the two-consumer one at d = 128 (v19).
# d = 192 / 256: the key-split kernel (`launch_sm90_ksplit`: each of two consumer warp groups computes S / dP for
# 32 of a tile's 64 keys), the best f+b at those dims (NOTES.md, v36); 192/128 two consumers of 64 keys each
# (faster there than the key split, v36); 96 and 128/64 two consumers (one ties): the best of
# the configs that compile without spills (NOTES.md, v35).
DKDV_CONFIGS = {64: GluonBwdConfig(64, 64, 2, 4), 96: GluonBwdConfig(64, 128, 2, 8),
                128: GluonBwdConfig(64, 64, 2, 4), 192: GluonBwdConfig(64, 64, 3, 8, key_split=True),
                256: GluonBwdConfig(64, 64, 2, 8, key_split=True),
                (192, 128): GluonBwdConfig(32, 128, 2, 8), (128, 64): GluonBwdConfig(64, 128, 2, 8)}
DKDV_GQA_CONFIGS = {128: GluonBwdConfig(64, 128, 2, 8)}
DKDV_GQA_GROUP = 4
# dQ: the two-consumer warp-specialised kernel at d = 64 (128-key steps, NOTES.md v33) and d = 128 (v12/v13);
# the one-consumer one for short batches (v19); at d = 256 the one-consumer one (64 x 64, 2 stages: with O for
# delta, 224 KB of shared memory); 96 and MLA two consumers (NOTES.md, v35); 192 two consumers with delta from
# the preprocess (O's tile would not fit beside their 2-stage ring; faster than one consumer with O, v37). The
# dQ tile table follows the config's blocks.
DQ_CONFIGS = {64: GluonBwdConfig(128, 128, 2, 8), 96: GluonBwdConfig(128, 64, 3, 8),
              128: GluonBwdConfig(128, 64, 4, 8), 192: GluonBwdConfig(128, 64, 2, 8, fused_delta=False),
              256: GluonBwdConfig(64, 64, 2, 4),
              (192, 128): GluonBwdConfig(128, 64, 2, 8), (128, 64): GluonBwdConfig(128, 64, 4, 8)}
DQ_SHORT_CONFIGS = {128: GluonBwdConfig(64, 64, 2, 4)}
FORCE_DKDV: GluonBwdConfig | None = None  # `override(dkdv=...)`: the config of every Gluon dK/dV pass
FORCE_DQ: GluonBwdConfig | None = None  # `override(dq=...)`: the config of every Gluon dQ pass


def dkdv_config(head_dim: int, group: int = 1) -> GluonBwdConfig | None:
    """The Gluon dK/dV config for ``group`` query heads per kv head, None where the Triton pass runs; its key
    tile table is ``tile_table(seqs, mask, True, cfg.block_n, cfg.block_m)``."""
    if FORCE_DKDV is not None:
        return FORCE_DKDV
    if group >= DKDV_GQA_GROUP and head_dim in DKDV_GQA_CONFIGS:
        return DKDV_GQA_CONFIGS[head_dim]
    return DKDV_CONFIGS.get(head_dim)


def dq_config(head_dim: int, short_seqs: bool = False) -> GluonBwdConfig:
    """The Gluon dQ config (``short_seqs``: a `short_batch`); its tile table is
    ``tile_table(seqs, mask, False, cfg.block_m, cfg.block_n)``."""
    if FORCE_DQ is not None:
        return FORCE_DQ
    if short_seqs and head_dim in DQ_SHORT_CONFIGS:
        return DQ_SHORT_CONFIGS[head_dim]
    return DQ_CONFIGS[head_dim]


def check_dkdv_config(cfg: GluonBwdConfig) -> None:
    """Raise ValueError unless a warp-specialised dK/dV kernel takes ``cfg``. ``key_split`` (the key-split kernel,
    `launch_sm90_ksplit`, which checks its configs here): block_m 64, block_n 64, num_warps 8 (two consumer warp
    groups sharing one 64-key tile), >= 2 stages. Otherwise: two consumer warp groups of 64 keys each (block_n
    128, num_warps 8) or one (block_n 64, num_warps 4), 32 or 64 queries per step, >= 2 stages."""
    if cfg.fused_delta is False:
        raise ValueError(f"{cfg}: fused_delta is a dQ option (the dK/dV kernels read delta)")
    if cfg.key_split:
        if (cfg.block_m, cfg.block_n, cfg.num_warps) != (64, 64, 8) or cfg.stages < 2:
            raise ValueError(f"{cfg}: the key-split dK/dV kernel takes block_m 64, block_n 64, num_warps 8 (two "
                             "consumer warp groups) and stages >= 2")
        return
    two = (cfg.block_n, cfg.num_warps) == (128, 8)
    one = (cfg.block_n, cfg.num_warps) == (64, 4)
    if not (one or two) or cfg.block_m not in (32, 64) or cfg.stages < 2:
        raise ValueError(f"{cfg}: the warp-specialised dK/dV kernel takes block_m 32 / 64, stages >= 2 and "
                         "block_n 128 with num_warps 8 (two consumer warp groups) or block_n 64 with num_warps 4 "
                         "(one); two warp groups on 64 keys is the key-split kernel (key_split=True)")


def check_dq_config(cfg: GluonBwdConfig) -> None:
    """Raise ValueError unless the warp-specialised dQ kernel takes ``cfg``: two consumer warp groups (block_m 128,
    num_warps 8) or one (block_m 64, num_warps 4), 64 or 128 keys per step, >= 2 stages."""
    if cfg.key_split:
        raise ValueError(f"{cfg}: key_split is a dK/dV option (the dQ kernel has none)")
    two = (cfg.block_m, cfg.num_warps) == (128, 8)
    one = (cfg.block_m, cfg.num_warps) == (64, 4)
    if not (one or two) or cfg.block_n not in (64, 128) or cfg.stages < 2:
        raise ValueError(f"{cfg}: the warp-specialised dQ kernel takes block_n 64 / 128, stages >= 2 and "
                         "block_m 128 with num_warps 8 (two consumer warp groups) or block_m 64 with num_warps 4 "
                         "(one)")


def _check_tables() -> None:
    """Every Gluon table covers the head dims of `GLUON_HEAD_DIMS` it must (`CONFIGS`, `LONG_CONFIGS`,
    `DQ_CONFIGS`: all; the others: a subset, every `SHORT_CONFIGS` dim with a `SHORT_DEFAULT_CONFIGS` entry), and
    every backward config in the tables (and forced by `override`) is one its kernel takes."""
    _check_head_dims()
    for table in (DKDV_CONFIGS, DKDV_GQA_CONFIGS):
        for cfg in table.values():
            check_dkdv_config(cfg)
    for table in (DQ_CONFIGS, DQ_SHORT_CONFIGS):
        for cfg in table.values():
            check_dq_config(cfg)
    if FORCE_DKDV is not None:
        check_dkdv_config(FORCE_DKDV)
    if FORCE_DQ is not None:
        check_dq_config(FORCE_DQ)


def _check_head_dims() -> None:
    """Raise ValueError where a Gluon table lacks a head dim of `GLUON_HEAD_DIMS` that its lookup needs, or holds
    one the plans never ask for (it would be ignored)."""
    dims, fwd_dims = set(GLUON_HEAD_DIMS), set(GLUON_FWD_HEAD_DIMS)
    if not dims <= fwd_dims:
        raise ValueError(f"GLUON_HEAD_DIMS {sorted(dims)} must be forward head dims too (GLUON_FWD_HEAD_DIMS)")
    full = {"CONFIGS": (CONFIGS, fwd_dims), "LONG_CONFIGS": (LONG_CONFIGS, fwd_dims), "DQ_CONFIGS": (DQ_CONFIGS, dims)}
    partial = {"SHORT_CONFIGS": (SHORT_CONFIGS, fwd_dims), "SHORT_DEFAULT_CONFIGS": (SHORT_DEFAULT_CONFIGS, fwd_dims),
               "SHORT_MASKED_CONFIGS": (SHORT_MASKED_CONFIGS, fwd_dims),
               "DKDV_CONFIGS": (DKDV_CONFIGS, dims), "DKDV_GQA_CONFIGS": (DKDV_GQA_CONFIGS, dims),
               "DQ_SHORT_CONFIGS": (DQ_SHORT_CONFIGS, dims)}
    for name, (table, want) in full.items():
        if set(table) != want:
            raise ValueError(f"{name} has head dims {sorted(table, key=str)}, the plans ask for "
                             f"{sorted(want, key=str)}: one config each")
    for name, (table, want) in partial.items():
        if not set(table) <= want:
            raise ValueError(f"{name} has head dims {sorted(table, key=str)} outside {sorted(want, key=str)}")
    if not set(SHORT_CONFIGS) <= set(SHORT_DEFAULT_CONFIGS):
        raise ValueError("every head dim of SHORT_CONFIGS needs a SHORT_DEFAULT_CONFIGS entry (`config_for`)")
    shadowed = set(SHORT_MASKED_CONFIGS) & set(SHORT_DEFAULT_CONFIGS)
    if shadowed:
        raise ValueError(f"SHORT_MASKED_CONFIGS has head dims {sorted(shadowed, key=str)} that SHORT_DEFAULT_CONFIGS "
                         "answers first (`config_for`): they would be ignored")


_check_tables()
_SHORTCUTS = {"fwd": "FORCE_FWD", "dkdv": "FORCE_DKDV", "dq": "FORCE_DQ"}


@contextlib.contextmanager
def override(**values):
    """Replace tables or thresholds of this module while the ``with`` block runs (experiments, tests; not
    thread-safe), e.g. ``override(GLUON_MIN_SEQLEN=512, HEAD_SECTION=1)`` or ``override(DQ_CONFIGS={...})``;
    ``fwd=`` / ``dkdv=`` / ``dq=``: one config every such Gluon pass takes, whatever the batch. The backward
    must run under the same overrides as its forward (the forward builds its tile tables). Costs nothing on
    the hot path: the functions read this module's names when called."""
    names = {_SHORTCUTS.get(name, name): value for name, value in values.items()}
    if "RELEASE_FWD_CONFIGS" in names:
        raise ValueError("RELEASE_FWD_CONFIGS is applied at import: override the tables it changes instead")
    with overriding(sys.modules[__name__], names, _check_tables):
        yield
