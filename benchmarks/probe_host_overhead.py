"""Is a short forward host-bound? For each workload (bf16, backend "triton"): GPU time of the
forward (do_bench median) under torch.no_grad and with inputs requiring grad, the host time per
call (wall time of 200 calls issued back to back, before the final synchronize), and the 15
functions with the most cumulative host time in one grad-mode call (cProfile).

usage: python3 benchmarks/probe_host_overhead.py [W8 W1 ...]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
import triton.testing

import packattn
from packattn.bench.workloads import varlen_workloads


def host_ms_per_call(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def main() -> None:
    names = sys.argv[1:] or ["W8", "W1"]
    table = varlen_workloads()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for name in names:
        w = table[name]
        seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=True)

        def fwd():
            return packattn.attention(q, k, v, seqs, backend="triton", **w.options)

        fwd()
        with torch.no_grad():
            gpu_nograd = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            host_nograd = host_ms_per_call(fwd)
        gpu_grad = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
        host_grad = host_ms_per_call(fwd)
        rows.append((name, gpu_nograd, gpu_grad, host_nograd, host_grad))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fwd()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(15)
        print(f"--- {name}: cProfile of 20 grad-mode forwards\n{text.getvalue()}")
    print(f"{'workload':<10} {'gpu ms no_grad':>15} {'gpu ms grad':>12} {'host ms no_grad':>16} {'host ms grad':>13}")
    for name, a, b, c, d in rows:
        print(f"{name:<10} {a:15.3f} {b:12.3f} {c:16.3f} {d:13.3f}")


if __name__ == "__main__":
    main()
