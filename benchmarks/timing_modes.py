"""Why does one kernel read two times? For a few short-document shapes and forward configs, the forward with
autograd on and off, three ways: do_bench's event time (what bench / tune / check report), the kernels' own
durations from CUPTI (torch.profiler: GPU time only), and the host time of a call (perf_counter, no sync).
An event time well above the CUPTI time with a host time near it is host-bound; a CUPTI time that jumps
between two levels across calls is the GPU (e.g. a persistent grid whose CTAs do not all start at once).

    PYTHONPATH=$PWD python benchmarks/timing_modes.py
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.testing

import packattn
from packattn.bench.workloads import Workload
from packattn.ops.varlen import configs
from packattn.ops.varlen.configs import GluonConfig

SHAPES = {"S128d64": ([128] * 256, 64), "s384d64": ([384] * 85, 64), "S512d64": ([512] * 64, 64)}
CONFIGS = {"128x128x4 vec": GluonConfig(128, 128, 4, 8, vec_store=True),
           "64x64x3 vec (2 CTAs/SM)": GluonConfig(64, 64, 3, 4, vec_store=True)}


def cupti_ms(fn, calls: int = 30) -> list[float]:
    """The GPU durations (ms) of the attention kernels of ``calls`` calls of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [e.device_time / 1e3 for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "varlen" in e.name and "fwd" in e.name]


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'shape':8s} {'config':24s} {'grad':5s} {'event ms':>9s} {'cupti med':>9s} {'min':>7s} {'max':>7s} "
          f"{'host us':>8s}")
    for name, (lengths, d) in SHAPES.items():
        w = Workload(name, lengths, heads_q=32, heads_kv=8, head_dim=d, options={"causal": True})
        desc, q, k, v = w.make_inputs("cuda", requires_grad=True)
        for label, cfg in CONFIGS.items():
            for grad in (False, True):
                def call(q=q, k=k, v=v, desc=desc, grad=grad):
                    with torch.set_grad_enabled(grad):
                        return packattn.attention(q, k, v, desc, backend="triton", causal=True)
                with configs.override(fwd=cfg):
                    call()
                    event = triton.testing.do_bench(call, warmup=100, rep=100, return_mode="median")
                    gpu = cupti_ms(call) or [float("nan")]
                    host = host_us(call)
                print(f"{name:8s} {label:24s} {str(grad):5s} {event:9.3f} {statistics.median(gpu):9.3f} "
                      f"{min(gpu):7.3f} {max(gpu):7.3f} {host:8.0f}", flush=True)


if __name__ == "__main__":
    main()
