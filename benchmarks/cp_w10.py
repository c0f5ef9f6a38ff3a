"""W10 (shared/workloads.md) on several GPUs with NCCL: 32768 tokens per GPU of
``doc_lengths(32768 * world, seed=0)``, heads 32/8, causal, bf16, the all-gather strategy.
Checks the context-parallel result against one GPU on the same global inputs (rank 0 computes the
single-GPU result with the same backend), then times forward and forward+backward.

    torchrun --nproc_per_node 2 benchmarks/cp_w10.py [--backend triton]

Attention-only TF/s per GPU = useful FLOPs / (slowest rank's time x world); parallel efficiency =
that / the same backend's single-GPU TF/s on W2 (measured here on rank 0).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import triton.testing

import packattn
import packattn.cp as cp
from packattn.bench.workloads import Workload, doc_lengths


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    w = Workload("W10", doc_lengths(32768 * world, seed=0), heads_q=32, heads_kv=8, options={"causal": True})
    seqs, q, k, v = w.make_inputs(device, torch.bfloat16, seed=0)  # same global inputs on every rank
    dout = torch.randn(q.shape, device=device, dtype=q.dtype, generator=torch.Generator(device).manual_seed(1))
    p = cp.plan(seqs, strategy="allgather")
    ql, kl, vl = (p.shard(x).detach().requires_grad_() for x in (q, k, v))
    dl = p.shard(dout)

    def cp_fwd():
        return cp.attention(ql, kl, vl, p, causal=True, backend=args.backend)

    def cp_fwdbwd():
        torch.autograd.grad(cp_fwd(), (ql, kl, vl), dl)

    out_l = cp_fwd()
    grads_l = torch.autograd.grad(out_l, (ql, kl, vl), dl)
    out = p.unshard(out_l.detach())
    dq = p.unshard(grads_l[0])
    # dk, dv: each rank's local grads are already reduce-scattered to the owner rows
    dk, dv = p.unshard(grads_l[1]), p.unshard(grads_l[2])
    ref = packattn.attention(q, k, v, seqs, causal=True, backend=args.backend)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    errors = {n: rel_l2(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *ref_grads))}

    def timed(fn, reps: int = 20):
        # a fixed number of calls on every rank (do_bench picks its own count per rank: collectives would hang)
        for _ in range(3):
            fn()
        dist.barrier()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[reps // 2]
        worst = torch.tensor([ms], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return worst.item()

    fwd_ms, fwdbwd_ms = timed(cp_fwd), timed(cp_fwdbwd)
    flops = w.fwd_flops()
    if rank == 0:
        single = Workload("W2", doc_lengths(32768, seed=0), heads_q=32, heads_kv=8, options={"causal": True})
        s_seqs, sq, sk, sv = single.make_inputs(device, torch.bfloat16)
        s_dout = torch.randn_like(sq)

        def s_fwd():
            return packattn.attention(sq, sk, sv, s_seqs, causal=True, backend=args.backend)

        s_fwd_ms = triton.testing.do_bench(s_fwd, warmup=10, rep=50, return_mode="median")
        s_fb_ms = triton.testing.do_bench(lambda: torch.autograd.grad(s_fwd(), (sq, sk, sv), s_dout), warmup=10, rep=50,
                                          return_mode="median")
        s_fwd_tf, s_fb_tf = single.fwd_flops() / s_fwd_ms / 1e9, 3.5 * single.fwd_flops() / s_fb_ms / 1e9
        fwd_tf, fb_tf = flops / (fwd_ms * world) / 1e9, 3.5 * flops / (fwdbwd_ms * world) / 1e9
        print(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, backend {args.backend}, allgather")
        print(f"errors vs one GPU (rel L2): " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
        print(f"CP fwd {fwd_ms:.3f} ms = {fwd_tf:.1f} TF/s per GPU (eff {fwd_tf / s_fwd_tf:.2f}); "
              f"fwd+bwd {fwdbwd_ms:.3f} ms = {fb_tf:.1f} TF/s per GPU (eff {fb_tf / s_fb_tf:.2f}); "
              f"single GPU W2 {s_fwd_tf:.1f} / {s_fb_tf:.1f} TF/s; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        assert all(e < 2e-2 for e in errors.values()), errors
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
