"""Host cost of each piece of a W8 forward+backward (bf16, backend "triton") on a GPU machine: the
launches one by one (Triton forward, preprocess, Gluon dK/dV, Gluon dQ), a TMA descriptor, and the
Triton JIT's binder (argument specialisation), each timed on the host over calls issued back to
back with a synchronize between batches (so the launch queue never fills), then a cProfile of the
Gluon dK/dV launches sorted by own time.

usage: python3 benchmarks/probe_launch_cost.py [W8]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
import triton

import packattn
from packattn.ops.varlen import launch_sm90_bwd as tbg
from packattn.backends import triton_varlen as tv
from packattn.ops.varlen.launch_sm90_fwd import _as_tma_tensor, _descriptor
from packattn.bench.workloads import varlen_workloads


def host_us(fn, calls: int = 20, batches: int = 10) -> float:
    """Median over batches of the host time per call (us), synchronizing between batches."""
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def _jit_breakdown(call) -> list:
    """Host cost of the pieces of one Gluon dK/dV launch: Triton's JIT entry (`JITFunction.run`) with
    prebuilt arguments, its binder alone, and the compiled kernel's launcher called directly."""
    from triton.runtime import driver

    from packattn.ops.varlen import bwd_dkdv_sm90 as ws

    captured = {}
    kernel = ws.varlen_bwd_dkdv_gluon_ws_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured.update(grid=grid, args=args, kwargs=kwargs)
                return kernel[grid](*args, **kwargs)
            return launch

    ws.varlen_bwd_dkdv_gluon_ws_kernel = Spy()
    try:
        args, kwargs = call
        tbg.gluon_launch_dkdv(*args, **kwargs)
    finally:
        ws.varlen_bwd_dkdv_gluon_ws_kernel = kernel
    grid, a, kw = captured["grid"], captured["args"], captured["kwargs"]
    compiled = kernel[grid](*a, **kw)
    device = driver.active.get_current_device()
    binder = kernel.device_caches[device][4]
    bound, _, _ = binder(*a, **kw)
    values = tuple(bound.values())
    stream = driver.active.get_current_stream(device)

    def direct():
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values), None, None, *values)

    return [("  JITFunction.run, args prebuilt", host_us(lambda: kernel[grid](*a, **kw))),
            ("  binder alone", host_us(lambda: binder(*a, **kw), calls=100)),
            ("  compiled launcher directly", host_us(direct))]


def main() -> None:
    name = (sys.argv[1:] or ["W8"])[0]
    w = varlen_workloads()[name]
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {name}")

    captured = {}
    real_dkdv, real_dq, real_delta = tbg.gluon_launch_dkdv, tbg.gluon_launch_dq, tv.bwd_delta

    def keep(key, real):
        def wrapper(*args, **kwargs):
            captured[key] = (args, kwargs)
            return real(*args, **kwargs)
        return wrapper

    tbg.gluon_launch_dkdv, tbg.gluon_launch_dq = keep("dkdv", real_dkdv), keep("dq", real_dq)
    tv.bwd_delta = keep("delta", real_delta)
    try:
        out = packattn.attention(q, k, v, seqs, backend="triton", **w.options)
        torch.autograd.grad(out, (q, k, v), dout)
    finally:
        tbg.gluon_launch_dkdv, tbg.gluon_launch_dq, tv.bwd_delta = real_dkdv, real_dq, real_delta

    def fwd():
        return packattn.attention(q, k, v, seqs, backend="triton", **w.options)

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    out = fwd()

    def fwdbwd():
        torch.autograd.grad(fwd(), (q, k, v), dout)

    rows = [("forward (requires grad)", host_us(fwd)), ("forward (no grad)", host_us(fwd_nograd)),
            ("forward + backward", host_us(fwdbwd))]
    for key in ("delta", "dkdv", "dq"):
        if key in captured:
            args, kwargs = captured[key]
            fn = {"delta": real_delta, "dkdv": real_dkdv, "dq": real_dq}[key]
            rows.append((f"launch {key}", host_us(lambda: fn(*args, **kwargs))))
    if "dkdv" in captured:
        rows += _jit_breakdown(captured["dkdv"])
    qt = _as_tma_tensor(q.detach())
    rows.append(("one TMA descriptor", host_us(lambda: _descriptor(qt, 64), calls=100)))
    rows.append(("torch.empty_like(q)", host_us(lambda: torch.empty_like(q), calls=100)))
    rows.append(("torch.zeros_like(q)", host_us(lambda: torch.zeros_like(q), calls=100)))
    if "dkdv" in captured:
        prof = cProfile.Profile()
        args, kwargs = captured["dkdv"]
        prof.enable()
        for _ in range(50):
            real_dkdv(*args, **kwargs)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(f"--- cProfile of 50 Gluon dK/dV launches (own time)\n{text.getvalue()}")
    print(f"{'piece':32s} host us per call")
    for label, us in rows:
        print(f"{label:32s} {us:8.1f}")


if __name__ == "__main__":
    main()
