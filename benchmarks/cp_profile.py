"""Where a CP strategy's time goes on W10: torch.profiler over a few forward (or forward+backward)
calls on every rank, rank 0 prints the top GPU kernels and the top host-side ops, and the wall
time against the GPU busy time (host-bound when the GPU idles).

    torchrun --nproc_per_node 2 benchmarks/cp_profile.py --strategy p2p --balance zigzag [--mode fb]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import packattn.cp as cp
from packattn.bench.cp import _union, profiled_kernels, w10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="p2p")
    parser.add_argument("--balance", default="zigzag")
    parser.add_argument("--mode", choices=("fwd", "fb"), default="fwd")
    parser.add_argument("--docs", choices=("w10", "one"), default="w10")
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    w = w10(dist.get_world_size(), args.docs)
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, seed=0)
    plan = cp.plan(seqs, None, strategy=args.strategy, balance=args.balance)
    ql, kl, vl = (plan.shard(x).detach().requires_grad_() for x in (q, k, v))
    dl = torch.randn_like(ql)

    def step():
        out = cp.attention(ql, kl, vl, plan, causal=True, backend="triton")
        if args.mode == "fb":
            torch.autograd.grad(out, (ql, kl, vl), dl)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    reps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # inside the profiler: a rank whose profiler starts late must not stall the first step
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / reps
    kernels = profiled_kernels(prof)
    busy = sum(b - a for a, b in _union([(s, e) for _, s, e in kernels])) / 1e3 / reps
    if rank == 0:
        print(f"{args.strategy}:{args.balance} {args.mode} on {w.name}: wall {wall:.3f} ms per call, "
              f"GPU busy {busy:.3f} ms ({100 * busy / wall:.0f}%), local rows {plan.num_local}")
        table = prof.key_averages()
        print(table.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
