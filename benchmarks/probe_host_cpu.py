"""Host cost of OUR Python per W8 call, measured on a CPU-only machine: the GPU path's Python runs on
CPU tensors with every kernel launch replaced by a no-op, so what is timed is packattn's own code
(dispatch, tile-table lookups, eligibility tests, TMA descriptors, allocations, autograd glue) and not
Triton's JIT entry (binder + launcher, ~30-45 us per launch on the H200 host, not included here).

Stubs (installed by `install_stubs`, process-wide):

* ``torch.Tensor.is_cuda`` is True, ``torch.cuda.is_available`` True, compute capability (9, 0),
  132 SMs, current device 0 -- so the Gluon (sm_90) choices are taken as on an H200;
* ``triton_varlen.device_unsupported`` and ``triton_tree.device_unsupported`` accept "cpu" (dispatch only, cached
  per params);
* ``triton_varlen.launch_config`` is called with ``cuda:0`` instead of the CPU device (so the Hopper
  table is used, not the interpreter's) -- a thin wrapper, ~0.3 us per call;
* every ``*_kernel`` in ``packattn.kernels.*`` launches nothing (``kernel[grid](...)`` returns at once).

The process re-executes itself with glibc's mmap disabled (``MALLOC_MMAP_MAX_=0``): a 128 MB
``torch.empty`` otherwise costs ~50 us of mmap/munmap per call on CPU, where the CUDA caching
allocator takes ~2 us; it still costs ~10 us here (4 such outputs per f+b).

Fills are real memsets here: the short-batch backward's ``delta = zeros_like(lse)`` (2 MB on W8)
costs 85-260 us of CPU per f+b (see ``--profile``), where the GPU path launches one fill kernel
(a few us of host): subtract it from the forward + backward figure.

usage: python3 benchmarks/probe_host_cpu.py [--calls 200] [--repeats 7] [--profile] [--workload W8|W1|W3|W8tree|...]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pkgutil
import pstats
import sys
import time
import types

_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
if any(os.environ.get(k) != v for k, v in _MALLOC_ENV.items()):
    os.environ.update(_MALLOC_ENV)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402


def _noop_launch(*args, **kwargs):
    return None


class _NoLaunch:
    """Stands for a ``@triton.jit`` / ``@gluon.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __init__(self, kernel):
        self.fn = getattr(kernel, "fn", kernel)  # `triton_varlen._launch` keys on kernel.fn.__name__
        self.kernel = kernel

    def __getitem__(self, grid):
        return _noop_launch


def install_stubs() -> None:
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=132, name="stub H200")

    import packattn.kernels
    from packattn.backends import triton_varlen as tv

    for info in pkgutil.iter_modules(packattn.kernels.__path__):
        module = importlib.import_module(f"packattn.kernels.{info.name}")
        for name, obj in list(vars(module).items()):
            if name.endswith("_kernel") and hasattr(obj, "__getitem__") and hasattr(obj, "fn"):
                setattr(module, name, _NoLaunch(obj))

    from packattn.backends import triton_tree

    tv.device_unsupported = lambda device_type: None
    triton_tree.device_unsupported = lambda device_type: None
    real_launch_config = tv.launch_config
    cuda0 = torch.device("cuda", 0)

    def launch_config(kernel, head_dim, dtype, device, long_seqs=False):
        return real_launch_config(kernel, head_dim, dtype, cuda0, long_seqs)

    tv.launch_config = launch_config


def make_w8(dtype=torch.bfloat16):
    import packattn

    torch.manual_seed(0)
    seqs = packattn.Varlen.from_lengths([512] * 64)
    total = seqs.total_q
    q, k, v = (torch.empty(total, 16, 128, dtype=dtype).normal_().requires_grad_() for _ in range(3))
    dout = torch.empty(total, 16, 128, dtype=dtype).normal_()
    return seqs, q, k, v, dout


def us_per_call(fn, calls: int, repeats: int) -> tuple[float, float]:
    """``(min, median)`` over ``repeats`` batches of the wall time per call (us); the minimum is the
    steadier number on a shared machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    times.sort()
    return times[0], times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile of 200 f+b calls, by own time")
    parser.add_argument("--workload", default="W8", help="W8 (default) or another of bench.workloads' (tree ones: triton_tree)")
    args = parser.parse_args()

    install_stubs()
    import packattn
    from packattn.backends import triton_varlen as tv

    from packattn.bench.workloads import tree_workloads, varlen_workloads

    backend = "triton"
    if args.workload == "W8":
        seqs, q, k, v, dout = make_w8()
        options = {"causal": True}
    elif args.workload in tree_workloads():  # the tree backend on a `Tree` (W6, W7, W8tree)
        seqs, q, k, v = tree_workloads()[args.workload].make_inputs("cpu")
        dout, options, backend = torch.randn_like(q), {}, "triton_tree"
    else:
        w = varlen_workloads()[args.workload]
        seqs, q, k, v = w.make_inputs("cpu")
        dout, options = torch.randn_like(q), w.options

    def fwd():
        return packattn.attention(q, k, v, seqs, backend=backend, **options)

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    def fwdbwd():
        torch.autograd.grad(fwd(), (q, k, v), dout)

    # the path taken must be the H200's: Gluon forward, Gluon WS dK/dV, Gluon WS dQ
    assert tv.use_gluon_fwd(q, k, v) and tv.use_gluon_dkdv(q, k, v), "stubs did not select the Gluon path"
    for f in (fwd, fwd_nograd, fwdbwd):  # warm up: tile tables, dispatch cache, lru caches
        f()

    print(f"torch {torch.__version__}, CPU stubs (no launches), {args.workload} ({type(seqs).__name__}, "
          f"{q.shape[0]} rows), heads {q.shape[1]}/{k.shape[1]}, d={q.shape[2]}, bf16, {options}, backend {backend}")
    print(f"packattn from {os.path.dirname(packattn.__file__)}")
    print(f"{'host us per call':<28} {'min':>8} {'median':>8}")
    for label, f in (("forward (requires grad)", fwd), ("forward (no grad)", fwd_nograd), ("forward + backward", fwdbwd)):
        print(f"{label:<28} {'%8.1f %8.1f' % us_per_call(f, args.calls, args.repeats)}")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fwdbwd()
        prof.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
            print(f"--- cProfile of 200 forward+backward calls, by {order}\n{text.getvalue()}")


if __name__ == "__main__":
    main()
