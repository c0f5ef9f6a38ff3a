"""Launching our Triton / Gluon kernels with less host time than ``kernel[grid](*args, **kwargs)``.

``JITFunction.run`` (Triton 3.6) costs ~50 us of host time per launch on the H200 hosts, of which the
compiled kernel's launcher is ~19 us; the rest binds the arguments, computes Triton's specialisation key (alignment and divisibility of
every argument), looks the kernel up and checks globals. A forward + backward of a batch of short
documents makes four launches, and its host time decides its wall time (benchmarks/NOTES.md, v20).

`launch(kernel, grid, args, kwargs)` keeps, per kernel, a cache keyed by a specialisation key of our
own, `arg_key` per argument plus the keyword arguments (constexprs and launch options) and the
device. The key is at least as fine as Triton's (``tests/test_fast_launch.py`` checks that equal keys
mean equal Triton specialisations, on the argument kinds our launchers pass):

* tensor: dtype and 16-byte alignment of ``data_ptr()``;
* int: equal to 1 (Triton makes it a constant), divisible by 16, and whether it fits 32 bits;
* bool, float, None: the type alone (Triton does not specialise their values; None is a constant);
* a host ``TensorDescriptor``: dtype, block shape, shared layout (Triton specialises on those) and padding.

A miss launches through ``kernel[grid]`` (compiling if needed) and stores the compiled kernel; a hit
calls the compiled kernel's launcher directly with the arguments in signature order. Not used under
Triton's interpreter, while a launch hook is set (profilers: the hook needs Triton's launch metadata),
with ``PACKATTN_PORTABLE=1``, or on a Triton release it was not checked on
(`support.FAST_LAUNCH_TRITON`; the reason is logged once); anything unusual (an argument kind not
listed) goes the slow way.
"""

from __future__ import annotations

import torch

from packattn.ops.runtime import support

# Compile options of every kernel of ours, passed explicitly: FP fusion on (``a * b + c`` as one FMA, e.g. the
# softmax's scale-and-subtract), what Triton 3.6 - 3.9 default to; Triton 3.9 warns once a process about a
# compile that leaves it to the default, which its next release turns off. The compile-check scripts use them too.
COMPILE_OPTIONS = {"enable_fp_fusion": True}
_INT32 = (-(2**31), 2**31 - 1)
_MISSING = object()
_caches: dict = {}  # kernel -> {key: (launcher, function, packed_metadata, tail)}
_CACHE_SIZE = 256  # per kernel; cleared when full (a process sees a handful of variants per kernel)
_RELEASE_OFF = support.release_unsupported("fast launches", support.FAST_LAUNCH_TRITON,
                                           support.triton_version(), "kernels launch through kernel[grid]")


class _Unkeyable(Exception):
    """An argument whose Triton specialisation `arg_key` does not model: launch the slow way."""


def arg_key(x):
    """The part of Triton's specialisation key that ``x`` decides (module docstring)."""
    t = type(x)
    if t is int:
        return (x == 1, x % 16 == 0, _INT32[0] <= x <= _INT32[1])
    if t is float or t is bool or x is None:
        return t
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    block_shape = getattr(x, "block_shape", None)
    layout = getattr(x, "layout", _MISSING)
    base = getattr(x, "base", None)
    if block_shape is not None and layout is not _MISSING and isinstance(base, torch.Tensor):
        return ("desc", base.dtype, tuple(block_shape), layout, getattr(x, "padding", None))
    raise _Unkeyable(t)


def enabled() -> bool:
    """Fast launches are possible now: CUDA Triton (not the interpreter), no launch hook, not ``PACKATTN_PORTABLE``."""
    if support.portable() or support.interpreting():
        return False
    if _RELEASE_OFF is not None:
        support.log_once(_RELEASE_OFF)
        return False
    from triton import knobs

    return _no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook)


def _no_hook(hook) -> bool:
    """No launch hook: None, or (Triton 3.6) an empty ``HookChain``."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's launcher when this
    specialisation has launched before. ``args``: the kernel's leading positional parameters;
    ``kwargs``: its remaining parameters (constexprs) by name and Triton's launch options
    (``num_warps``, ``num_stages``, ``maxnreg``, ...)."""
    if not enabled():
        kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
        return
    device = torch.cuda.current_device()
    try:
        key = (device, tuple(kwargs.items()), *map(arg_key, args))
    except _Unkeyable:
        kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
        return
    _launch_cached(kernel, grid, args, kwargs, device, key)


def launch_keyed(kernel, grid: tuple, args: tuple, kwargs: dict, key) -> None:
    """`launch` with the caller's cache key instead of one computed from every argument (a launcher that
    fixes its kernel's scalars and keyword arguments per call shape keys its launches by that shape and the
    alignment of its tensors). Contract: equal ``key`` (hashable) means equal ``kwargs`` and equal `arg_key`
    of every argument. Shares `launch`'s cache (its keys hold the keyword arguments where this one's hold "keyed")."""
    if not enabled():
        kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
        return
    device = torch.cuda.current_device()
    _launch_cached(kernel, grid, args, kwargs, device, (device, "keyed", key))


def _launch_cached(kernel, grid: tuple, args: tuple, kwargs: dict, device: int, key) -> None:
    cache = _caches.get(kernel)
    if cache is None:
        cache = _caches[kernel] = {}
    entry = cache.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
        if hasattr(compiled, "result"):  # (asynchronous compilation)
            compiled = compiled.result()
        if compiled is None:  # nothing launched (a stand-in kernel of the host-cost probes)
            return
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        cache[key] = _entry(kernel, compiled, len(args), kwargs)
        return
    launcher, function, packed, tail = entry
    stream = torch.cuda.current_stream(device).cuda_stream if _raw_stream is None else _raw_stream(device)
    launcher(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, function, packed,
             None, None, None, *args, *tail)


def _entry(kernel, compiled, num_args: int, kwargs: dict) -> tuple:
    """What a later launch with the same key needs: the launcher, the loaded function, the packed
    metadata and the values of the parameters after the positional ones (from ``kwargs`` or their
    defaults), in signature order -- the arguments ``JITFunction.run`` hands the launcher."""
    params = kernel.signature.parameters
    names = list(params)[num_args:]
    tail = []
    for name in names:
        value = kwargs.get(name, _MISSING)
        if value is _MISSING:
            value = params[name].default
        tail.append(value)
    return compiled.run, compiled.function, compiled.packed_metadata, tuple(tail)


try:  # torch's raw current-stream query (what Triton's driver uses), when present
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - CPU-only builds
    _raw_stream = None
