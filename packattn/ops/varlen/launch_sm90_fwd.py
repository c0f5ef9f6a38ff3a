"""Launcher of the Gluon Hopper forward (`packattn.ops.varlen.common_sm90`).

`gluon_fwd` does what the body of ``packattn::varlen_fwd`` (`packattn.backends.triton_varlen`)
does for the Triton forward -- allocate ``out`` / ``lse`` (zeros / -inf where rows belong to no
sequence), launch one program per (query tile, query head) -- with TMA descriptors instead of
raw pointers for q, k and v. The query tile table must be built with this kernel's block sizes::

    cfg = config_for(head_dim)                         # BLOCK_M 128, BLOCK_N 128 (d = 64 / 128)
    q_tiles = tile_table(seqs, mask, False, cfg.block_m, cfg.block_n)

`gluon_fwd_supported` says whether the kernel can run these tensors (CUDA, compute capability
9.x, float16 / bfloat16, head dim 64 or 128, TMA-compatible strides).

Variants (`GluonConfig`, for A/B runs without code edits through ``$PACKATTN_GLUON_FWD_CONFIG``)::

    PACKATTN_GLUON_FWD_CONFIG="block_m,block_n,stages,num_warps[,ws][,persistent][,direct][,pingpong][,trim]"

* ``128,128,3,8`` -- `varlen_fwd_gluon_kernel` (the default at d = 128): 2 warp groups, CTA
  barrier before each ring refill;
* ``...,ws`` -- `varlen_fwd_gluon_ws_kernel`: a 1-warp TMA producer partition (24 registers) and
  one partition per consumer warp group (the rest of the registers, setmaxnreg), ready / empty
  mbarriers, no CTA barrier in the loop; ``num_warps`` still counts the consumer warps
  (``block_m // 16``), the launch adds the producer (`ws_resources`);
* ``...,ws,direct`` -- the output is stored from registers, so Q's buffer is released as soon as
  the tile's last S wgmma is done (instead of after the epilogue, which stages through it);
* ``...,ws,persistent`` -- ``ctas_per_sm x SMs`` programs loop over the work items (tiles x
  heads, longest first, round robin): the producer loads tile t+1's K/V (and, with ``direct``,
  its Q) while the consumers finish tile t;
* ``...,ws,pingpong`` -- the two consumer warp groups take turns issuing their wgmma (FA3's
  warp-group ping-pong): one group's softmax runs while the other's products occupy the tensor cores;
* ``...,ws,trim`` -- each consumer warp group skips the key blocks that none of its 64 rows sees (with 64-key
  blocks: the causal diagonal's second block for the tile's first rows); bitwise the same output.
`ab_variants` lists the ones `benchmarks/ab_gluon_fwd.py` times and
`scripts/check_gluon_compile.py --all` compiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from packattn import env
from packattn.backends import triton_base
from packattn.ops.runtime import fast_launch
from packattn.backends.triton_base import cuda_index
from packattn.ops.runtime.launch import _mask_constexprs

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class GluonConfig:
    block_m: int  # queries per tile: one warp group per 64 rows, so block_m == 16 * num_warps
    block_n: int  # keys per block
    stages: int  # K/V ring slots (>= 2; block j+stages is loaded once block j is done)
    num_warps: int = 8  # consumer warps (block_m // 16); the warp-specialised kernel adds a producer warp
    # warp-specialised kernel (`varlen_fwd_gluon_ws_kernel`): a 1-warp TMA producer partition and one
    # partition per consumer warp group, synchronised by ready / empty mbarriers (no CTA barrier in the loop)
    warp_specialize: bool = False
    # (warp_specialize only) a grid of (ctas per SM) x (SMs) programs looping over the work items
    persistent: bool = False
    # (warp_specialize only) store out from the accumulator registers instead of staging it in Q's
    # shared buffer, so the next tile's Q load overlaps this tile's last PV and epilogue
    direct_store: bool = False
    # (warp_specialize, block_m 128 only) FA3-style ping-pong: the two consumer warp groups take turns
    # issuing their wgmma, so one group's softmax runs under the other's products
    pingpong: bool = False
    # (warp_specialize, not pingpong) each consumer warp group skips the products of the tile's key blocks in
    # which no key is visible to any of its 64 rows (it still waits for them and releases their ring slot):
    # with 64-key blocks, the causal diagonal's second block for the first 64 rows of a 128-row tile
    trim: bool = False

    def __post_init__(self):
        if self.block_m != 16 * self.num_warps or self.block_m not in (64, 128):
            raise ValueError(f"{self}: block_m must be 64 or 128 and equal 16 * num_warps")
        if self.stages < 2:
            raise ValueError(f"{self}: stages must be >= 2")
        if (self.persistent or self.direct_store or self.pingpong) and not self.warp_specialize:
            raise ValueError(f"{self}: persistent / direct_store / pingpong need warp_specialize")
        if self.pingpong and self.block_m != 128:
            raise ValueError(f"{self}: pingpong needs two consumer warp groups (block_m 128)")
        if self.trim and (self.pingpong or not self.warp_specialize):
            raise ValueError(f"{self}: trim needs warp_specialize and no pingpong (the turns must match)")

    def label(self) -> str:
        """The `ENV_CONFIG` string of this configuration (`parse_config` reads it back)."""
        flags = [name for name, on in (("ws", self.warp_specialize), ("persistent", self.persistent),
                                       ("direct", self.direct_store), ("pingpong", self.pingpong),
                                       ("trim", self.trim)) if on]
        return ",".join([str(self.block_m), str(self.block_n), str(self.stages), str(self.num_warps)] + flags)


_FLAGS = {"ws": "warp_specialize", "persistent": "persistent", "direct": "direct_store", "pingpong": "pingpong",
          "trim": "trim"}


def parse_config(text: str) -> GluonConfig:
    """``"block_m,block_n,stages,num_warps[,flag...]"`` with flags ``ws`` (warp_specialize),
    ``persistent``, ``direct`` (direct_store) and ``pingpong``, e.g. ``"128,128,3,8"``, ``"128,128,3,8,ws"``,
    ``"128,128,3,8,ws,persistent,direct"``; the format of ``$PACKATTN_GLUON_FWD_CONFIG``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if len(parts) < 4:
        raise ValueError(f"{ENV_CONFIG}={text!r}: expected "
                         "block_m,block_n,stages,num_warps[,ws][,persistent][,direct][,pingpong][,trim]")
    flags = {}
    for flag in parts[4:]:
        if flag not in _FLAGS:
            raise ValueError(f"{ENV_CONFIG}={text!r}: unknown flag {flag!r} (known: {', '.join(_FLAGS)})")
        flags[_FLAGS[flag]] = True
    return GluonConfig(*(int(x) for x in parts[:4]), **flags)


# Shared memory at d = 128, BLOCK_N 128, 3 stages: Q 32 KB + 3 x (K 32 KB + V 32 KB) = 224 KB of 227
# (one CTA per SM, no spills); d = 64 has room for a fourth slot. Measured on an H200 (results/2026-11-22/
# ab_gluon_fwd_ws_h200.txt, d = 128, no_grad forward): warp-specialised + persistent + direct store is the best
# or within 1% of it on every workload: W1 408 TF/s (plain 128x128: 380), W2 478 (404), W4 505 (419), W8 227
# (227). d = 64 takes the same scheme, correctness-checked there but not timed.
CONFIGS = {64: GluonConfig(128, 128, 4, 8, True, True, True), 128: GluonConfig(128, 128, 3, 8, True, True, True)}
# Other configurations that compile cleanly for sm_90a without spills (scripts/check_gluon_compile.py
# --config ...), for A/B runs: at d = 128, (128, 64, 4 stages) needs 160 KB / ~165-180 registers;
# (64, 64, 3 stages, 4 warps) needs 112 KB / ~160 registers, so two CTAs share an SM and one CTA's
# prologue / epilogue hides behind the other's main loop (at the price of reading K/V twice as often).
ALTERNATIVES = [GluonConfig(128, 64, 4), GluonConfig(64, 64, 3, 4)]


def ab_variants(head_dim: int) -> list[GluonConfig]:
    """Every configuration worth an A/B run at ``head_dim``, the launcher's default first: the
    table, `ALTERNATIVES`, and the warp-specialised kernel (not timed yet) on the default tiles
    (plain; direct_store; persistent; persistent + direct_store) and on `ALTERNATIVES`' tiles.
    `scripts/check_gluon_compile.py --all` compiles all of them, `benchmarks/ab_gluon_fwd.py` times them."""
    base = CONFIGS[head_dim]
    out = [base, LONG_CONFIGS[head_dim]] + ALTERNATIVES
    ws = dict(warp_specialize=True)
    out += [replace(base, **ws), replace(base, **ws, direct_store=True), replace(base, **ws, persistent=True),
            replace(base, **ws, persistent=True, direct_store=True)]
    for alt in ALTERNATIVES:
        out += [replace(alt, **ws), replace(alt, **ws, persistent=True, direct_store=True)]
    return list(dict.fromkeys(out))  # drop repeats, keep the order


# "block_m,block_n,stages,num_warps[,ws][,persistent][,direct][,pingpong][,trim]" overrides CONFIGS (A/B runs);
# see parse_config
ENV_CONFIG = "PACKATTN_GLUON_FWD_CONFIG"


# Long sequences (some sequence with >= triton_varlen.LONG_SEQLEN queries): the same configs are best on W4
# (one 32k document, chunks of 8192: 2.179 ms vs 2.597 for the two-CTAs-per-SM 64x64 ws variant).
LONG_CONFIGS = CONFIGS


# Short sequences (no sequence longer than triton_varlen.SHORT_SEQLEN = 512 rows) at d = 128: 64 x 64 tiles, one
# consumer warp group, two CTAs per SM (one CTA's prologue / epilogue under the other's main loop, less waste on
# the causal diagonal). H200, forward kernel time (results/2026-11-24/s8_short_docs_sweep_h200.txt): causal
# documents of 512 rows 275.7 -> 254.5 us; of 1024 rows 372.6 -> 388.7 (worse, hence the threshold).
# Only on the GPUs named in SHORT_CONFIG_GPUS: on the H100 (3.35 TB/s against the H200's 4.8) the 128 x 128 tiles
# of CONFIGS win on the same documents, as they read K/V half as often (results/2026-11-25/s11_w8_sweep_h100.txt:
# W8 forward 343 -> 317 us with head sections of 2, 312 -> 294 with the short batches' sections of 1).
SHORT_CONFIGS = {128: GluonConfig(64, 64, 3, 4, True, True, True)}
SHORT_CONFIG_GPUS = ("H200",)
# Short sequences on the other GPUs (the H100): 128-row tiles over 64-key blocks with `GluonConfig.trim` (the first
# warp group of a tile skips the causal diagonal's second block). H100, W8 forward kernel (results/2026-11-25/
# s14_fwd_trim_h100.txt): 282.0 us (CONFIGS' 128 x 128) -> 278.6 (128 x 64, 5 stages) -> 269.4 (with trim) -> 267.0
# (4 stages, with trim); on W1 the same tiles lose (878-898 -> 963-983 us), so only short batches take them.
SHORT_TRIM_CONFIGS = {128: GluonConfig(128, 64, 4, 8, True, True, True, trim=True)}


def config_for(head_dim: int, long_seqs: bool = False, short_seqs: bool = False,
               device: torch.device | None = None) -> GluonConfig:
    """Block sizes, pipeline depth and warps for ``head_dim``; the tile table must use block_m/block_n.
    ``long_seqs`` / ``short_seqs``: the batch's length class (`triton_varlen.TritonVarlenBackend.run`);
    ``device``: the CUDA device it runs on (short batches: `SHORT_CONFIGS` on `SHORT_CONFIG_GPUS`,
    `SHORT_TRIM_CONFIGS` on the others; None: the current device). ``$PACKATTN_GLUON_FWD_CONFIG`` ("128,64,4,8",
    "128,128,3,8,ws,persistent,direct": `parse_config`) overrides the table, for A/B runs."""
    override = env.get(ENV_CONFIG)
    if override:
        return parse_config(override)
    if short_seqs and head_dim in SHORT_CONFIGS:
        if _short_config_gpu(cuda_index(device) if torch.cuda.is_available() else -1):
            return SHORT_CONFIGS[head_dim]
        return SHORT_TRIM_CONFIGS[head_dim]
    return (LONG_CONFIGS if long_seqs else CONFIGS)[head_dim]


@functools.lru_cache(maxsize=None)
def _short_config_gpu(index: int) -> bool:
    """Is CUDA device ``index`` one of `SHORT_CONFIG_GPUS` (False for -1: no CUDA device)?"""
    if index < 0:
        return False
    name = torch.cuda.get_device_name(index)
    return any(gpu in name for gpu in SHORT_CONFIG_GPUS)


def smem_layout(block: list[int], dtype: torch.dtype):
    """NVMMA shared layout of a TMA block (widest swizzle the row length allows)."""
    return _smem_layout(tuple(block), dtype)


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    # cached: building it costs ~17 us of host time, four times per launch (one per descriptor)
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


_GLUON_OFF = triton_base.gluon_unsupported()  # (the installed Triton cannot build the kernels: why)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """Device ``index``'s compute capability for the Gluon tests (which need 9.x): (0, 0) where the installed
    Triton cannot build our Gluon kernels (`triton_base.gluon_unsupported`, logged), so every Gluon path says no."""
    cap = torch.cuda.get_device_capability(index)
    if cap[0] == 9 and _GLUON_OFF is not None:
        triton_base.log_once(_GLUON_OFF)
        return (0, 0)
    return cap


def _tma_compatible(x: torch.Tensor) -> bool:
    """``(rows, heads, d)`` viewable as a 2-D ``(rows, heads * d)`` TMA tensor: heads and d packed,
    16-byte aligned base and row stride."""
    _, heads, d = x.shape
    s0, s1, s2 = x.stride()  # one call: x.stride(i) costs ~0.3 us of host time each
    return (s2 == 1 and (s1 == d or heads == 1) and s0 * x.element_size() % 16 == 0
            and x.data_ptr() % 16 == 0 and s0 >= heads * d)


def gluon_fwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> bool:
    """Can `gluon_fwd` run these inputs without copies? CUDA on a compute capability 9.x device,
    float16 / bfloat16, head dim 64 or 128 (q, k, v alike), heads_q a multiple of heads_kv, and
    each tensor viewable as a TMA 2-D ``(rows, heads * d)`` tensor (heads and d packed, 16-byte
    aligned base and row stride). `gluon_fwd` itself copies a tensor that fails only the last test."""
    # (plain loops and and-chains: this runs on every call, and generators cost host time)
    tensors = (q, k) if v is None else (q, k, v)
    if not (q.is_cuda and k.is_cuda and (v is None or v.is_cuda)) or q.dim() != 3 or k.dim() != 3:
        return False
    if _capability(cuda_index(q.device))[0] != 9:
        return False
    dtype, d = q.dtype, q.shape[-1]
    if dtype not in DTYPES or d not in HEAD_DIMS:
        return False
    for t in tensors:
        if t.dtype != dtype or t.shape[-1] != d:
            return False
    if q.shape[1] % k.shape[1] != 0:
        return False
    for t in tensors:
        if not _tma_compatible(t):
            return False
    return True


def _as_tma_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy TMA can read (`_tma_compatible`): contiguous, on a fresh (aligned) allocation."""
    if _tma_compatible(x):
        return x
    copy = x.contiguous()
    return copy if copy is not x and _tma_compatible(copy) else x.clone(memory_format=torch.contiguous_format)


def _descriptor(x: torch.Tensor, block_rows: int):
    """TMA descriptor over the 2-D ``(rows, heads * d)`` view of ``x`` (of a contiguous copy where TMA
    cannot read ``x`` itself, as `_as_tma_tensor`), blocks ``[block_rows, d]``. Rows past the tensor
    read as zeros; rows of other sequences are masked in the kernel."""
    tma = _tma_compatible(x)
    if not tma:
        x, tma = _as_tma_tensor(x), True
    rows, heads, d = x.shape
    args = (x, [rows, heads * d], [x.stride()[0], 1], [block_rows, d], _smem_layout((block_rows, d), x.dtype))
    if tma and rows > 0 and heads > 0:  # the per-tensor checks of TensorDescriptor pass
        cls = _unchecked_descriptor_class(block_rows, d, x.dtype)
        if cls is not None:
            return _unchecked_descriptor(cls, *args)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(*args)


# The fields of Gluon's Hopper TensorDescriptor (a dataclass) that `_unchecked_descriptor` fills in
_DESCRIPTOR_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")


def _unchecked_descriptor(cls, base, shape, strides, block_shape, layout):
    """``cls(base, shape, strides, block_shape, layout)`` without its ``__post_init__`` checks (~2 us of
    host time per descriptor, 11 descriptors per W8 forward+backward); see `_unchecked_descriptor_class`."""
    desc = cls.__new__(cls)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding = (
        base, shape, strides, block_shape, layout, "zero")
    return desc


@functools.lru_cache(maxsize=None)
def _unchecked_descriptor_class(block_rows: int, d: int, dtype: torch.dtype):
    """Gluon's ``TensorDescriptor`` when `_descriptor` may build descriptors with blocks ``[block_rows, d]``
    of ``dtype`` through `_unchecked_descriptor`, else None (`_descriptor` then calls the class). Yes
    when the class is the plain dataclass known here and a descriptor built both ways over a small
    tensor is the same (so the block / dtype / layout checks pass and ``__post_init__`` derives no other
    state); the per-tensor checks (16-byte aligned base and row stride, unit last stride, positive
    shape) are `_descriptor`'s, before each use."""
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    try:
        if tuple(f.name for f in dataclasses.fields(TensorDescriptor)) != _DESCRIPTOR_FIELDS:
            return None
        x = torch.empty(block_rows, d, dtype=dtype)
        args = (x, [block_rows, d], [d, 1], [block_rows, d], _smem_layout((block_rows, d), dtype))
        checked = TensorDescriptor(*args)
        unchecked = _unchecked_descriptor(TensorDescriptor, *args)
    except (AssertionError, TypeError, ValueError, KeyError):
        return None
    return TensorDescriptor if vars(unchecked) == vars(checked) else None


SM_SHARED = 233472  # bytes of shared memory per SM on sm_90 (each CTA also takes 1 KB of it)
SM_REGISTERS = 65536
PRODUCER_REGS = 24  # the TMA warp only holds scalars (24 is the least setmaxnreg allows)


def shared_bytes(cfg: GluonConfig, head_dim: int, element_size: int = 2) -> int:
    """Shared memory of one CTA: Q, the K/V ring and the mbarriers."""
    return (cfg.block_m + 2 * cfg.stages * cfg.block_n) * head_dim * element_size + 8 * (2 + 2 * cfg.stages)


MIN_CONSUMER_REGS = 200  # a consumer warp group needs ~160 (BLOCK_N 64) to ~230 (BLOCK_N 128) registers


@functools.lru_cache(maxsize=None)
def ws_resources(cfg: GluonConfig, head_dim: int) -> dict:
    """Occupancy and register split of the warp-specialised forward (`ws_split` with its shared memory)."""
    return ws_split(cfg.num_warps, shared_bytes(cfg, head_dim))


def ws_split(consumer_warps: int, cta_shared_bytes: int) -> dict:
    """Occupancy and register split of a warp-specialised kernel with ``consumer_warps`` consumer warps
    (warp groups of 4) and one producer warp: ``ctas_per_sm`` (as many CTAs as shared memory allows
    while each consumer warp group keeps >= `MIN_CONSUMER_REGS`), ``warps`` (the producer padded to a
    warp group), ``maxnreg`` (the launch bound: the SM's registers over all warps of the resident
    CTAs), ``consumer_regs`` (what setmaxnreg gives each consumer warp group: the rest after the
    producer's) and ``producer_regs``."""
    warps = 4 * ((consumer_warps + 1 + 3) // 4)
    consumers = consumer_warps // 4
    best = None
    for ctas in range(1, max(1, SM_SHARED // (cta_shared_bytes + 1024)) + 1):
        maxnreg = min(256, SM_REGISTERS // (ctas * warps * 32)) // 8 * 8
        idle = warps // 4 - consumers  # warp groups other than the consumers (the producer's)
        consumer_regs = min(256, (maxnreg * warps - PRODUCER_REGS * 4 * idle) // (4 * consumers)) // 8 * 8
        if best is None or consumer_regs >= MIN_CONSUMER_REGS:
            best = {"ctas_per_sm": ctas, "warps": warps, "maxnreg": maxnreg, "consumer_regs": consumer_regs,
                    "producer_regs": PRODUCER_REGS}
    return best


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Work order of the warp-specialised kernels (`varlen_fwd_gluon_ws._section_order`): the query heads in
# sections of HEAD_SECTION kv-head groups, one section after the other, so the programs running at the same
# time share few heads' K/V (Q/dO) in L2. Measured on an H200 against one section of all heads (the old
# order; results/2026-11-23/s6_ab_head_section_f*_h200.txt, bitwise-equal results), f+b: W1 3.766 -> 3.432
# ms, W2 6.758 -> 6.637, W4 8.697 -> 7.961, W8 1.194 -> 1.150, W6 3.080 -> 2.907, W7 7.588 -> 7.264; the
# forward alone W1 0.936 -> 0.876 (1 group: 0.880, 4: 0.887). $PACKATTN_GLUON_HEAD_SECTION overrides it
# (A/B runs; 0 = all heads in one section).
HEAD_SECTION = 2
# Batches of short sequences (`triton_varlen.SHORT_SEQLEN`) take sections of one kv-head group in the forward and
# both backward passes: H100, W8 (results/2026-11-25/s11_w8_sweep_h100.txt, two machines) forward 343 -> 318 us,
# dK/dV 448 -> 424, dQ 427 -> 378, f+b kernels 1220 -> 1121 us. (W1, long documents: 3118 -> 3617 us; W2 / W4 / W5
# gain 2-4%: left at 2 for now.)
SHORT_HEAD_SECTION = 1
ENV_HEAD_SECTION = "PACKATTN_GLUON_HEAD_SECTION"


def heads_per_section(heads_q: int, group_size: int, short_seqs: bool = False) -> int:
    """Query heads per section of the work order: `HEAD_SECTION` (`SHORT_HEAD_SECTION` for a batch of
    ``short_seqs``; ``$PACKATTN_GLUON_HEAD_SECTION`` overrides both) kv-head groups, clipped to all heads and
    rounded down to a divisor of the kv heads."""
    text = env.get(ENV_HEAD_SECTION, "").strip()
    try:
        groups = int(text) if text else (SHORT_HEAD_SECTION if short_seqs else HEAD_SECTION)
    except ValueError:
        raise ValueError(f"{ENV_HEAD_SECTION}={text!r}: expected a number of kv-head groups (0: all heads)") from None
    heads_kv = heads_q // group_size
    if groups <= 0 or groups >= heads_kv:
        return heads_q
    while heads_kv % groups:
        groups -= 1
    return groups * group_size


def ws_grid(device: torch.device, cfg: GluonConfig, num_work: int, resources: dict,
            max_programs: int | None = None) -> int:
    """Programs of a warp-specialised launch: one per work item, or with ``cfg.persistent``
    ``ctas_per_sm x SMs`` of them looping over the work items (at most ``max_programs``)."""
    if not cfg.persistent:
        return num_work
    grid = min(num_work, resources["ctas_per_sm"] * _num_sms(cuda_index(device)))
    return grid if max_programs is None else max(1, min(grid, max_programs))


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
              row_offsets_q: torch.Tensor, row_offsets_kv: torch.Tensor, q_tiles: torch.Tensor,
              scale: float, window_left: int, window_right: int, chunk_size: int, top_left: bool,
              padded_q: bool, long_seqs: bool = False, short_seqs: bool = False, config: GluonConfig | None = None,
              max_programs: int | None = None, out: torch.Tensor | None = None,
              lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the forward, as ``packattn::varlen_fwd``; ``q_tiles`` built with
    ``config_for(head_dim).block_m / .block_n`` (or ``config``'s, when given: it replaces
    `config_for`); ``scale >= 0`` (the backend flips q otherwise). ``max_programs`` (tests of
    the persistent grid: many tiles per program on small problems) caps a persistent grid.
    ``out`` / ``lse``: preallocated outputs whose rows in no sequence already hold 0 / -inf (the
    kernel writes only rows of sequences); allocated here (zero / -inf filled when ``padded_q``)
    when not given."""
    from packattn.ops.varlen.fwd_sm90 import varlen_fwd_gluon_ws_kernel

    total_q, heads_q, head_dim = q.shape  # (`_descriptor` copies what TMA cannot read)
    heads_kv = k.shape[1]
    # rows in no sequence are never written by the kernel: they must start as zeros / -inf
    if out is None:
        out = q.new_zeros(q.shape) if padded_q else q.new_empty(q.shape)
    if lse is None:
        lse = torch.full((heads_q, total_q), float("-inf"), device=q.device, dtype=torch.float32) if padded_q \
            else torch.empty((heads_q, total_q), device=q.device, dtype=torch.float32)
    num_work = q_tiles.shape[0] * heads_q
    if num_work == 0 or total_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no keys anywhere: every row sees nothing (and a TMA tensor needs rows)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    cfg = config or config_for(head_dim, long_seqs, short_seqs, q.device)
    args = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n), out, lse, q_tiles,
            cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
            out.stride(0), out.stride(1), lse.stride(0),
            heads_q, heads_q // heads_kv, scale * LOG2E, window_left, window_right, chunk_size)
    masks = _mask_constexprs(window_left, window_right, chunk_size, top_left)
    if not cfg.warp_specialize:
        from packattn.ops.varlen.common_sm90 import varlen_fwd_gluon_kernel

        fast_launch.launch(varlen_fwd_gluon_kernel, (num_work,), args, dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, **masks,
            num_warps=cfg.num_warps))
        return out, lse
    res = ws_resources(cfg, head_dim)
    section = heads_per_section(heads_q, heads_q // heads_kv, short_seqs)
    fast_launch.launch(varlen_fwd_gluon_ws_kernel, (ws_grid(q.device, cfg, num_work, res, max_programs),),
                       (*args, num_work, section), dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, **masks,
        DIRECT_STORE=cfg.direct_store, CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"],
        PINGPONG=cfg.pingpong, TRIM=cfg.trim, num_warps=4, maxnreg=res["maxnreg"]))
    return out, lse
