"""Is a call host-bound? For each workload (bf16, backend "triton") and each environment variant:
the GPU time (do_bench median, which waits for the GPU) and the host time per call (wall time of
200 calls issued back to back, before the final synchronize) of the forward (inputs requiring grad)
and of forward+backward. When host >= GPU the call is host-bound and its bench time is host time.
With ``--profile``, the 15 functions with the most cumulative host time in 20 forward+backward calls.

usage: python3 benchmarks/probe_host_overhead.py [--profile] [W8 W1 ...]
Variants: default, PACKATTN_TRITON_BWD=triton (Triton dQ pass), PACKATTN_TRITON_FWD=triton.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from unittest import mock

import torch
import triton.testing

import packattn
from packattn.bench.workloads import varlen_workloads

VARIANTS = {"default": {}, "triton_bwd": {"PACKATTN_TRITON_BWD": "triton"},
            "triton_fwd": {"PACKATTN_TRITON_FWD": "triton"}}


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
    args = sys.argv[1:]
    profile = "--profile" in args
    names = [a for a in args if not a.startswith("--")] or ["W8", "W1"]
    table = varlen_workloads()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for name in names:
        w = table[name]
        seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)

        def fwd():
            return packattn.attention(q, k, v, seqs, backend="triton", **w.options)

        def fwdbwd():
            torch.autograd.grad(fwd(), (q, k, v), dout)

        for variant, env in VARIANTS.items():
            with mock.patch.dict(os.environ, env):
                fwdbwd()
                times = [triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median") for f in (fwd, fwdbwd)]
                times += [host_ms_per_call(f) for f in (fwd, fwdbwd)]
                rows.append((name, variant, *times))
                if profile and variant == "default":
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(20):
                        fwdbwd()
                    prof.disable()
                    torch.cuda.synchronize()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(15)
                    print(f"--- {name}: cProfile of 20 forward+backward calls\n{text.getvalue()}")
    print(f"{'workload':<8} {'variant':<11} {'gpu fwd':>8} {'gpu f+b':>8} {'host fwd':>9} {'host f+b':>9}  (ms per call)")
    for name, variant, a, b, c, d in rows:
        bound = "  host-bound" if d >= b else ""
        print(f"{name:<8} {variant:<11} {a:8.3f} {b:8.3f} {c:9.3f} {d:9.3f}{bound}")


if __name__ == "__main__":
    main()
