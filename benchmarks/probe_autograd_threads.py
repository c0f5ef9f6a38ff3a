"""Host cost of a forward+backward with PyTorch's autograd running CUDA backward nodes on its device
thread (the default) or on the calling thread (``torch.autograd.set_multithreading_enabled(False)``):
host microseconds per W8 f+b (20 calls issued back to back, median of 15 batches), with the time
spent inside the backward's launchers (preprocess, Gluon dK/dV, Gluon dQ) per call, and the same for
a tiny autograd graph (the engine's own hand-off cost).

    python3 benchmarks/probe_autograd_threads.py [W8]
"""

from __future__ import annotations

import collections
import sys
import time

import torch

import packattn
from packattn.ops.varlen import launch_sm90_bwd as tbg
from packattn.backends import triton_varlen as tv
from packattn.bench.workloads import varlen_workloads

spent = collections.defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        spent[name] += time.perf_counter() - start
        return result
    return wrapper


def host_us(fn, calls: int = 20, batches: int = 15) -> float:
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> None:
    name = (sys.argv[1:] or ["W8"])[0]
    w = varlen_workloads()[name]
    seqs, q, k, v = w.make_inputs("cuda")
    dout = torch.randn_like(q)
    tbg.gluon_launch_dkdv = timed("launch dK/dV", tbg.gluon_launch_dkdv)
    tbg.gluon_launch_dq = timed("launch dQ", tbg.gluon_launch_dq)
    tv.bwd_delta = timed("preprocess", tv.bwd_delta)

    def fwdbwd():
        torch.autograd.grad(packattn.attention(q, k, v, seqs, backend="triton", **w.options), (q, k, v), dout)

    x = torch.randn(1024, device="cuda", requires_grad=True)

    def tiny():
        torch.autograd.grad((x * 2).sum(), x)

    for _ in range(5):
        fwdbwd()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {name}")
    for threads in (True, False, True):
        torch.autograd.set_multithreading_enabled(threads)
        spent.clear()
        us = host_us(fwdbwd)
        pieces = ", ".join(f"{k} {v / 300 * 1e6:.1f}" for k, v in spent.items())
        print(f"autograd device threads {'on ' if threads else 'off'}: f+b {us:7.1f} us ({pieces}); "
              f"tiny graph {host_us(tiny):6.1f} us")
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
