"""Sweep launch configs of the portable Triton varlen kernels on the GPU (one device call).

usage: python3 benchmarks/tune_triton.py [W1 W8 ...] [--kernels fwd,dkdv,dq] [--configs "M,N,w,s;..."]
For each workload: forward time per fwd config; then fwd+bwd time per dkdv config and per dq config (the other
kernels at their current configs), at the workload's tile width (BLOCK_D of the wider of its q/k and v head dims;
the head-dim sweep's workloads D64 ... D256, MLA are accepted too). Prints a table per kernel, best first.
The sweep runs with ``PACKATTN_PORTABLE=1`` (the Triton kernels, not the Hopper Gluon ones) and sets the
`HOPPER_CONFIGS` entry under test through `packattn.ops.varlen.configs.override`. ``--configs`` replaces the
lists below (repeats allowed: an A/B, in the order given).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

import packattn
from packattn.bench.workloads import head_dim_workloads, varlen_workloads
from packattn.ops.runtime import launch
from packattn.ops.varlen import configs

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3)]
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 128, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2),
        (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 4, 3), (32, 64, 4, 3)]
# BLOCK_D 256 (head dims 192, 256; MLA 192/128): shared memory and registers allow only smaller tiles
FWD_256 = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 1), (64, 16, 4, 3)]
DKDV_256 = [(16, 32, 8, 1), (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2), (64, 64, 8, 1), (32, 32, 8, 2), (16, 64, 4, 2),
            (32, 128, 8, 1), (64, 32, 8, 2)]
DQ_256 = [(64, 16, 8, 1), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 1), (128, 32, 8, 1), (32, 64, 4, 2), (64, 16, 4, 2),
          (128, 16, 8, 2)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2),
      (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")


def run(w, q, k, v, dout, kernel: str, cfg: tuple, fwd_only: bool) -> tuple[float, float]:
    """``(ms, TF/s)`` of workload ``w`` with ``cfg`` as the Triton ``kernel``'s config at the workload's BLOCK_D."""
    table = {**configs.HOPPER_CONFIGS, (kernel, _block_d(w)): launch.LaunchConfig(*cfg)}
    with configs.override(HOPPER_CONFIGS=table, HOPPER_LONG_FWD_CONFIGS={}):
        launch._reduced_stages.clear()
        seqs = w.varlen("cuda")  # fresh per-batch tile tables for these block sizes
        if fwd_only:
            with torch.no_grad():
                ms = bench(lambda: packattn.attention(q, k, v, seqs, backend="triton", **w.options))
            return ms, w.fwd_flops() / ms / 1e9

        def step():
            out = packattn.attention(q, k, v, seqs, backend="triton", **w.options)
            torch.autograd.grad(out, (q, k, v), dout)

        ms = bench(step)
        return ms, w.fwdbwd_flops() / ms / 1e9


def _block_d(w) -> int:
    return launch.block_d(max(w.head_dim, w.value_dim))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=["W1", "W8"])
    parser.add_argument("--kernels", default="fwd,dkdv,dq")
    parser.add_argument("--configs", default=None, help='"BLOCK_M,BLOCK_N,warps,stages;..." instead of the lists')
    args = parser.parse_args(argv)
    os.environ["PACKATTN_PORTABLE"] = "1"
    listed = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")] if args.configs else None
    table = {**varlen_workloads(), **head_dim_workloads()}
    for name in args.workloads:
        w = table[name]
        _, q, k, v = w.make_inputs("cuda", torch.bfloat16)
        dout = torch.randn(*q.shape[:2], v.shape[-1], device=q.device, dtype=q.dtype)  # out's shape
        wide = _block_d(w) == 256
        for kernel, candidates, fwd_only in (("fwd", FWD_256 if wide else FWD, True),
                                             ("dkdv", DKDV_256 if wide else DKDV, False),
                                             ("dq", DQ_256 if wide else DQ, False)):
            if kernel not in args.kernels.split(","):
                continue
            rows = []
            for cfg in listed or candidates:
                try:
                    rows.append((*run(w, q, k, v, dout, kernel, cfg, fwd_only), cfg, ""))
                except Exception as e:  # noqa: BLE001 - a config that does not fit is a row
                    rows.append((float("inf"), 0.0, cfg, f"{type(e).__name__}: {str(e)[:60]}"))
            if not listed:
                rows.sort()
            print(f"\n{name} {kernel} ({'fwd' if fwd_only else 'fwd+bwd'} time; BLOCK_M, BLOCK_N, warps, stages)")
            for ms, tf, cfg, err in rows:
                print(f"  {cfg}  {ms:8.3f} ms  {tf:6.1f} TF/s {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
