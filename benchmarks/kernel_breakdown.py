"""Where the GPU time of one forward+backward goes: every kernel of ``packattn.attention(...,
backend="triton" | "triton_tree")`` + ``torch.autograd.grad`` under torch.profiler, averaged over
``--iters`` calls (after a warm-up), per workload: kernel name, calls per f+b, GPU microseconds per
f+b, share of the total; then the GPU sum against the host time per call (calls issued back to back), the
wall time per call (sync after each call) and the do_bench median (what `packattn bench` reports).
``--forward``: the forward alone.

    python3 benchmarks/kernel_breakdown.py W8 W1 W7 D96 MLA docs:1024 [--iters 20]
    python3 benchmarks/kernel_breakdown.py W8 --variant "" --variant "fwd=GluonConfig(128, 128, 3, 8)"

``--variant``: config overrides ("NAME=VALUE;NAME=VALUE", "" for none; the format of `ab_configs.py`, applied
through `packattn.ops.varlen.configs.override`) under which every workload is broken down again, one after the
other in this process.
``--repeat R``: the whole list of variants R times, interleaved (A B A B ...), and ``--pause S`` seconds of idle
GPU before each breakdown: an H100 at its power limit runs the same kernels 10-20% slower hot than cool, so a
single A-then-B comparison measures the heat as much as the variants (benchmarks/NOTES.md). With
more than one variant or repeat a summary follows: per workload and variant the median, lowest and highest GPU
time and do_bench time over the repeats, and the SM clock recorded after each breakdown.

``docs:N``: 32768 tokens of documents of N tokens each (the last one shorter), heads 16/16, causal (W8 is
docs:512).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import packattn
from packattn.bench.runner import _gpu_state
from packattn.bench.workloads import Workload, head_dim_workloads, tree_workloads, varlen_workloads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_configs import variant as configs_variant  # noqa: E402


def step_fn(w, forward_only: bool = False):
    desc, q, k, v = w.make_inputs("cuda")
    tree = isinstance(desc, packattn.Tree)
    options = {} if tree else w.options
    backend = "triton_tree" if tree else "triton"
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)  # out's shape (MLA: d_v)

    def step():
        out = packattn.attention(q, k, v, desc, backend=backend, **options)
        if not forward_only:
            torch.autograd.grad(out, (q, k, v), dout)

    return step


def breakdown(name: str, w, iters: int, forward_only: bool = False) -> dict:
    """Print the breakdown of one workload; returns ``{"gpu_us", "bench_us", "kernels": {name: us}}``."""
    step = step_fn(w, forward_only)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    host_us = (time.perf_counter() - start) / iters * 1e6
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) / iters * 1e6
    bench_us = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    gpu_us = sum(totals.values()) / iters
    call = "forward" if forward_only else "f+b"
    print(f"\n{name}: GPU {gpu_us:.1f} us per {call} (sum of kernels), host {host_us:.1f} us per call issued back to "
          f"back, wall {wall_us:.1f} us per synchronised call, {bench_us:.1f} us do_bench median (as packattn bench)")
    for kernel, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {us / iters:9.1f} us  {counts[kernel] / iters:4.1f}x  {100 * us / iters / gpu_us:5.1f}%  {kernel[:90]}")
    return {"gpu_us": gpu_us, "bench_us": bench_us, "kernels": {k: us / iters for k, us in totals.items()}}


def summary(results: dict) -> None:
    """``results[(workload, variant)]``: the breakdowns (with ``"mhz"``) of that pair over the repeats."""
    print("\n## summary: median [lowest, highest] over the repeats, us per call")
    for (name, variant), runs in results.items():
        gpu = sorted(r["gpu_us"] for r in runs)
        bench = sorted(r["bench_us"] for r in runs)
        mhz = "/".join(str(r["mhz"]) for r in runs)
        print(f"{name:8s} {variant or '(as is)':60s} GPU {statistics.median(gpu):8.1f} [{gpu[0]:.1f}, {gpu[-1]:.1f}]"
              f"  do_bench {statistics.median(bench):8.1f} [{bench[0]:.1f}, {bench[-1]:.1f}]  MHz {mhz}")
        for kernel in sorted(runs[0]["kernels"], key=lambda k: -runs[0]["kernels"][k]):
            times = [r["kernels"].get(kernel, 0.0) for r in runs]
            print(f"    {statistics.median(times):9.1f} us  {kernel[:80]}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--forward", action="store_true", help="the forward alone (inputs requiring grad)")
    parser.add_argument("--variant", action="append", help='config overrides "NAME=VALUE;..." ("" = as is); repeatable')
    parser.add_argument("--repeat", type=int, default=1, help="run the list of variants this many times, interleaved")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of idle GPU before each breakdown")
    args = parser.parse_args(argv)
    table = {**varlen_workloads(), **tree_workloads(), **head_dim_workloads()}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.workloads:
        if name.startswith("docs:"):
            n = int(name[5:])
            table[name] = Workload(name, [n] * (32768 // n) + ([32768 % n] if 32768 % n else []),
                                   options={"causal": True})
    variants = args.variant or [""]
    results = defaultdict(list)
    for repeat in range(args.repeat):
        for variant in variants:
            if variant or args.repeat > 1:
                print(f"\n## variant {variant or '(as is)'}" + (f", repeat {repeat + 1}" if args.repeat > 1 else ""))
            with configs_variant(variant):
                for name in args.workloads:
                    time.sleep(args.pause)
                    result = breakdown(name, table[name], args.iters, args.forward)
                    result["mhz"] = _gpu_state(torch.cuda.current_device()).get("sm_mhz", "?")
                    results[(name, variant)].append(result)
    if len(variants) > 1 or args.repeat > 1:
        summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
