"""Sweep launch configs of the Triton varlen kernels on the GPU (one device call).

usage: [TUNE_KERNELS=fwd,dkdv,dq] [TUNE_CONFIGS="M,N,w,s;..."] python3 benchmarks/tune_triton.py [W1 W8 ...]
For each workload: forward time per fwd config; then fwd+bwd time per dkdv config and per dq
config (the other kernels at their current configs). Prints a table per kernel, best first.
"""

from __future__ import annotations

import os
import sys

import torch
import triton.testing

import packattn
from packattn.backends import triton_varlen as tv
from packattn.bench.workloads import varlen_workloads

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3)]
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 128, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2),
        (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 4, 3), (32, 64, 4, 3)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2),
      (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")


def main(names):
    table = varlen_workloads()
    original = dict(tv.HOPPER_CONFIGS)
    for name in names:
        w = table[name]
        seqs0, q, k, v = w.make_inputs("cuda", torch.bfloat16)
        dout = torch.randn_like(q)
        flops = w.fwd_flops()

        def run(kernel, cfg, fwd_only):
            tv.HOPPER_CONFIGS.clear()
            tv.HOPPER_CONFIGS.update(original)
            tv.HOPPER_CONFIGS[(kernel, 128)] = tv.LaunchConfig(*cfg)
            tv._reduced_stages.clear()
            seqs = w.varlen("cuda")  # fresh per-batch tile tables for these block sizes
            if fwd_only:
                with torch.no_grad():
                    ms = bench(lambda: packattn.attention(q, k, v, seqs, backend="triton", **w.options))
                return ms, flops / ms / 1e9
            def step():
                out = packattn.attention(q, k, v, seqs, backend="triton", **w.options)
                torch.autograd.grad(out, (q, k, v), dout)
            ms = bench(step)
            return ms, 3.5 * flops / ms / 1e9

        kernels = os.environ.get("TUNE_KERNELS", "fwd,dkdv,dq").split(",")
        override = os.environ.get("TUNE_CONFIGS")  # e.g. "32,64,4,3;64,128,8,3;32,64,4,3" (repeats allowed: A/B)
        listed = [tuple(int(x) for x in c.split(",")) for c in override.split(";")] if override else None
        for kernel, configs, fwd_only in (("fwd", listed or FWD, True), ("dkdv", listed or DKDV, False),
                                          ("dq", listed or DQ, False)):
            if kernel not in kernels:
                continue
            rows = []
            for cfg in configs:
                try:
                    ms, tf = run(kernel, cfg, fwd_only)
                    rows.append((ms, tf, cfg, ""))
                except Exception as e:  # noqa: BLE001
                    rows.append((float("inf"), 0.0, cfg, f"{type(e).__name__}: {str(e)[:60]}"))
            if not listed:
                rows.sort()
            label = "fwd" if fwd_only else "fwd+bwd"
            print(f"\n{name} {kernel} ({label} time; BLOCK_M, BLOCK_N, warps, stages)")
            for ms, tf, cfg, err in rows:
                print(f"  {cfg}  {ms:8.3f} ms  {tf:6.1f} TF/s {err}")
    tv.HOPPER_CONFIGS.clear()
    tv.HOPPER_CONFIGS.update(original)


if __name__ == "__main__":
    main(sys.argv[1:] or ["W1", "W8"])
