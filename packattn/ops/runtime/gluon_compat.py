"""Gluon names that moved between the Triton releases our Hopper kernels are built for."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# TMA tile load into shared memory: `tma.async_load` where it exists (3.9 keeps the old name only to raise)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# cp.async of a tensor of pointers into shared memory: `async_copy.async_load` where it exists (as `tma_load`)
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a barrier over the calling partition's warps: `barrier` where it exists (from 3.7), `thread_barrier` before
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# `shared_memory_descriptor.reinterpret`: public from 3.9 (`_reinterpret` before)
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def smem_as_block(buf, ROWS: gl.constexpr):
    """The bytes of ``buf`` (a 2-d shared-memory buffer) as ``[1, ROWS, columns]``, its dtype and layout."""
    if _PUBLIC_REINTERPRET:
        view = buf.reinterpret(buf.dtype, [1, ROWS, buf.shape[1]], buf.layout)
    else:
        view = buf._reinterpret(buf.dtype, [1, ROWS, buf.shape[1]], buf.layout)
    return view
