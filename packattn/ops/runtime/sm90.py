"""What the launchers of the Hopper (sm_90) Gluon kernels share: `sm90_runs` (may they run on these
tensors: the one rule), TMA descriptors over ``(rows, heads * d)`` views (`_descriptor`, with a fast path
that skips the descriptor class's checks), the register split of a warp-specialised kernel (`ws_split`)
and the grid of a persistent one (`ws_grid`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from packattn.ops.runtime import support

SM_SHARED = 233472  # bytes of shared memory per SM on sm_90 (each CTA also takes 1 KB of it)
CTA_SHARED = SM_SHARED - 1024  # the most one CTA may use
SM_REGISTERS = 65536
PRODUCER_REGS = 24  # the TMA warp only holds scalars (24 is the least setmaxnreg allows)
# ptxas takes a launch bound of at most 255 registers a thread (it ignores a larger one, with a warning); the
# bound is a multiple of 8 (the allocation unit). setmaxnreg itself goes up to 256.
PTXAS_MAX_REGS = 248
MIN_CONSUMER_REGS = 200  # a consumer warp group needs ~160 (BLOCK_N 64) to ~230 (BLOCK_N 128) registers

_GLUON_OFF = support.installed_gluon_unsupported()  # (the installed Triton cannot build the kernels: why)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """Device ``index``'s compute capability for the Gluon tests (which need 9.x): (0, 0) where the installed
    Triton cannot build our Gluon kernels (`support.gluon_unsupported`, logged), so every Gluon path says no."""
    cap = torch.cuda.get_device_capability(index)
    if cap[0] == 9 and _GLUON_OFF is not None:
        support.log_once(_GLUON_OFF)
        return (0, 0)
    return cap


def dims_key(head_dim: int, head_dim_v: int) -> int | tuple[int, int]:
    """How the Gluon tables name a pair of head dims: ``d`` where q/k and v share it, ``(d, d_v)`` otherwise (MLA)."""
    return head_dim if head_dim == head_dim_v else (head_dim, head_dim_v)


def sm90_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tma: bool, head_dims: tuple,
              dtypes: tuple[torch.dtype, ...]) -> bool:
    """May the sm_90 Gluon kernels run on these tensors? Not Triton's interpreter, not ``PACKATTN_PORTABLE``
    (those two and the Triton release: `support.sm90_kernels_off`, the part of this rule that holds for every
    call), CUDA tensors on a compute capability 9.x device (with a Triton the kernels are built for), a dtype
    of ``dtypes`` and head dims named in ``head_dims`` (`dims_key` of q/k's and v's: the caller's family's Gluon
    kernels, e.g. `packattn.ops.varlen.configs.GLUON_HEAD_DIMS` / ``GLUON_DTYPES``), heads_q a multiple of heads_kv; with
    ``tma`` also each tensor viewable as a TMA ``(rows, heads * d)`` matrix without a copy (`_tma_compatible`).
    Without ``tma`` the answer depends only on dtypes, shapes and device, so a forward (which builds the tile
    tables) and its backward (which launches, copying what TMA cannot read) agree."""
    # (plain and-chains and tuple membership: this runs on every call, and generators cost host time)
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return False
    if support.interpreting() or support.portable() or _capability(support.cuda_index(q.device))[0] != 9:
        return False
    dtype, d, d_v = q.dtype, q.shape[-1], v.shape[-1]
    if dtype not in dtypes or k.dtype != dtype or v.dtype != dtype or k.shape[-1] != d:
        return False
    if (d if d == d_v else (d, d_v)) not in head_dims or q.shape[1] % k.shape[1] != 0:  # `dims_key`, inlined
        return False
    return not tma or (_tma_compatible(q) and _tma_compatible(k) and _tma_compatible(v))


# ---------------------------------------------------------------- TMA descriptors
def _tma_compatible(x: torch.Tensor) -> bool:
    """``(rows, heads, d)`` viewable as a 2-D ``(rows, heads * d)`` TMA tensor: heads and d packed,
    16-byte aligned base and row stride."""
    _, heads, d = x.shape
    s0, s1, s2 = x.stride()  # one call: x.stride(i) costs ~0.3 us of host time each
    return (s2 == 1 and (s1 == d or heads == 1) and s0 * x.element_size() % 16 == 0
            and x.data_ptr() % 16 == 0 and s0 >= heads * d)


def _as_tma_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy TMA can read (`_tma_compatible`): contiguous, on a fresh (aligned) allocation."""
    if _tma_compatible(x):
        return x
    copy = x.contiguous()
    return copy if copy is not x and _tma_compatible(copy) else x.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    """NVMMA shared layout of a TMA block (widest swizzle the row length allows); cached: building it costs
    ~17 us of host time, once per descriptor."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


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


# ---------------------------------------------------------------- warp-specialised kernels: registers, grids
def ws_split(consumer_warps: int, cta_shared_bytes: int) -> dict:
    """Occupancy and register split of a warp-specialised kernel with ``consumer_warps`` consumer warps
    (warp groups of 4) and one producer warp: ``ctas_per_sm`` (as many CTAs as shared memory allows
    while each consumer warp group keeps >= `MIN_CONSUMER_REGS`), ``warps`` (the producer padded to a
    warp group), ``maxnreg`` (the launch bound: the SM's registers over all warps of the resident
    CTAs, at most `PTXAS_MAX_REGS`), ``consumer_regs`` (what setmaxnreg gives each consumer warp group:
    the rest after the producer's) and ``producer_regs``."""
    warps = 4 * ((consumer_warps + 1 + 3) // 4)
    consumers = consumer_warps // 4
    best = None
    for ctas in range(1, max(1, SM_SHARED // (cta_shared_bytes + 1024)) + 1):
        maxnreg = min(PTXAS_MAX_REGS, SM_REGISTERS // (ctas * warps * 32) // 8 * 8)
        idle = warps // 4 - consumers  # warp groups other than the consumers (the producer's)
        consumer_regs = min(256, (maxnreg * warps - PRODUCER_REGS * 4 * idle) // (4 * consumers)) // 8 * 8
        if best is None or consumer_regs >= MIN_CONSUMER_REGS:
            best = {"ctas_per_sm": ctas, "warps": warps, "maxnreg": maxnreg, "consumer_regs": consumer_regs,
                    "producer_regs": PRODUCER_REGS}
    return best


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def ws_grid(device: torch.device, num_work: int, resources: dict, max_programs: int | None = None) -> int:
    """Programs of a persistent warp-specialised launch: ``ctas_per_sm x SMs`` of them (at most one per work
    item, at most ``max_programs``) looping over the work items."""
    grid = min(num_work, resources["ctas_per_sm"] * _num_sms(support.cuda_index(device)))
    return grid if max_programs is None else max(1, min(grid, max_programs))
