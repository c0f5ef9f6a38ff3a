"""Where the host time of one forward goes on the GPU machine, per workload (varlen ones through backend
"triton", tree ones through "triton_tree"; inputs requiring grad, as `packattn bench` times them):
cProfile of ``--calls`` forwards sorted by own time (Python functions and the C calls they make, e.g.
``torch.empty`` or a kernel launcher), then torch.profiler's CPU ops by self time (aten ops and CUDA
runtime calls). Answers "which call makes this forward host-bound" where `kernel_breakdown.py --forward`
shows that it is (host time per call above the GPU time).

    python3 benchmarks/probe_host_forward.py W8 W8tree W1 [--calls 200] [--rows 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_breakdown import step_fn  # noqa: E402

from packattn.bench.workloads import tree_workloads, varlen_workloads  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args(argv)
    table = {**varlen_workloads(), **tree_workloads()}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.workloads:
        step = step_fn(table[name], forward_only=True)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            step()
        host_us = (time.perf_counter() - start) / args.calls * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            step()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.rows)
        print(f"\n## {name}: host {host_us:.1f} us per forward issued back to back\n{text.getvalue()}")
        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            for _ in range(50):
                step()
            torch.cuda.synchronize()
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
