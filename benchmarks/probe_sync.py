"""Does a forward+backward of ``packattn.attention(..., backend="triton" | "triton_tree")`` make the host wait
for the GPU? Per workload: the synchronising CUDA calls one call makes (``torch.cuda.set_sync_debug_mode``
warnings, deduplicated), the CUDA runtime calls of 5 calls that can block (synchronize, memcpy, malloc, free)
from torch.profiler's CPU side, and the host time to issue 10 calls back to back against the time until the
GPU is done (host ~ total: the host waits somewhere; host << total: it runs ahead of the GPU).

    python3 benchmarks/probe_sync.py W1 W3 W8
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_breakdown import step_fn  # noqa: E402

from packattn.bench.workloads import tree_workloads, varlen_workloads  # noqa: E402

BLOCKING = ("Synchronize", "Memcpy", "Malloc", "Free")


def probe(name: str, w) -> None:
    step = step_fn(w)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = Counter(str(c.message).splitlines()[0][:120] for c in caught)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    runtime = Counter()
    runtime_us = Counter()
    for event in prof.events():
        if event.name.startswith("cuda") and any(b in event.name for b in BLOCKING):
            runtime[event.name] += 1
            runtime_us[event.name] += event.cpu_time_total
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"\n{name}: host {1e6 * (issued - start) / 10:.0f} us per call to issue, {1e6 * (done - start) / 10:.0f} us "
          f"per call until the GPU is done (10 calls back to back)")
    print(f"  sync debug warnings in one call: {dict(syncs) or 'none'}")
    for call, count in runtime.most_common():
        print(f"  {call}: {count / 5:.1f} per call, {runtime_us[call] / 5:.0f} us host per call")


def main(argv: list[str]) -> int:
    table = {**varlen_workloads(), **tree_workloads()}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in argv or ["W1", "W3", "W8"]:
        probe(name, table[name])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
