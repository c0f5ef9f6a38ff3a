"""`packattn bench --cp`: W10 (workloads.md) on several GPUs, launched with torchrun.

    torchrun --nproc_per_node 2 -m packattn.cli bench --cp [--strategies ...] [--balances ...] --json W10.json

32768 tokens per GPU of ``doc_lengths(32768 * world, seed=0)``, heads 32/8, head_dim 128, causal,
bf16. For every (strategy, balance): the result against one GPU on the same global inputs (rank 0
computes it: relative L2 errors of out, lse, dq, dk, dv; and against one GPU in float32, passing
when the CP error is at most 2x the bf16 single-GPU error plus 1e-4, `check_against_fp32`), the
slowest rank's forward and forward+backward time, attention-only TF/s per GPU = useful FLOPs / (time x world), parallel
efficiency = that / the same backend's single-GPU TF/s on W2, the communication time and the part
of it not hidden behind computation (from a profiler trace of one forward+backward on rank 0: NCCL
kernel time, and NCCL kernel time during which no other kernel ran), and peak memory.
``--cp-docs one``: the same tokens as one document (W10one; efficiency against one GPU on one
document of 32768 tokens), so that every strategy communicates.
``--overlap-groups 1 2 4`` runs strategy allgather once per number of kv-head groups whose
communication overlaps compute (``cp.attention(..., overlap_groups=G)``; rows ``allgather:BALANCE:GG``).
"""

from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist

import packattn
import packattn.cp as cp
from packattn import env as environment
from packattn.bench.plotting import pyplot
from packattn.bench.workloads import Workload, doc_lengths

STRATEGIES = ("allgather", "p2p", "a2a", "a2a+p2p")
BALANCES = ("zigzag", "documents")
TOKENS_PER_GPU = 32768


def w10(world: int, docs: str = "w10") -> Workload:
    """W10 (``docs="w10"``), or ``"one"``: the same tokens as one causal document (every strategy has to
    cut it across ranks and communicate)."""
    if docs == "one":
        return Workload("W10one", [TOKENS_PER_GPU * world], heads_q=32, heads_kv=8, options={"causal": True})
    return Workload("W10", doc_lengths(TOKENS_PER_GPU * world, seed=0), heads_q=32, heads_kv=8,
                    options={"causal": True})


def single_gpu_lengths(docs: str) -> list[int]:
    """The one-GPU problem of the efficiency's denominator: W2 for W10, one document of
    `TOKENS_PER_GPU` for ``"one"``."""
    return [TOKENS_PER_GPU] if docs == "one" else doc_lengths(TOKENS_PER_GPU, seed=0)


def _timed(fn, reps: int = 20) -> float:
    """Median ms of ``fn`` over a fixed number of calls (the same on every rank: collectives inside),
    the slowest rank's."""
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
    worst = torch.tensor([sorted(times)[reps // 2]], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def exposed_communication(kernels: list[tuple[str, float, float]]) -> tuple[float, float]:
    """``(communication_ms, exposed_ms)`` from ``(name, start_us, end_us)`` GPU kernels: the time
    covered by NCCL kernels, and the part of it during which no other kernel ran."""
    comm = _union([(s, e) for n, s, e in kernels if "nccl" in n.lower()])
    busy = _union([(s, e) for n, s, e in kernels if "nccl" not in n.lower()])
    total = sum(e - s for s, e in comm)
    hidden = 0.0
    for s, e in comm:
        for bs, be in busy:
            hidden += max(0.0, min(e, be) - max(s, bs))
    return total / 1e3, (total - hidden) / 1e3


def _profile_kernels(fn) -> list[tuple[str, float, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # The barrier runs inside the profiler: ranks leave it together after each one's profiler has
        # started (a rank whose profiler starts late would make the other's NCCL kernels wait, and that
        # wait would count as communication: the first profile of a process takes ~0.5 s to start).
        dist.barrier()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    return profiled_kernels(prof)


def profiled_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the GPU kernels of a profile whose first NCCL kernel is the
    barrier that aligned the ranks (`after_first_nccl`)."""
    return after_first_nccl([(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0])


def after_first_nccl(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The kernels that start after the first NCCL kernel (the barrier's all-reduce) has ended; all
    of them when there is no NCCL kernel."""
    nccl_ends = [e for n, s, e in sorted(kernels, key=lambda k: k[1]) if "nccl" in n.lower()]
    if not nccl_ends:
        return kernels
    return [k for k in kernels if k[1] >= nccl_ends[0]]


def _group_for(strategy: str, world: int):
    """The process group, or for a2a+p2p a 2-D DeviceMesh (outer, inner) with inner = 2 where possible."""
    if strategy != "a2a+p2p":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    inner = 2 if world % 2 == 0 else 1
    return init_device_mesh("cuda", (world // inner, inner), mesh_dim_names=("cp_outer", "cp_inner"))


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    return float((a[finite] - b[finite]).norm() / b[finite].norm().clamp_min(1e-30))


def _single_gpu(backend: str, docs: str) -> tuple[float, float]:
    import triton.testing

    w = Workload("W2", single_gpu_lengths(docs), heads_q=32, heads_kv=8, options={"causal": True})
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16)
    dout = torch.randn_like(q)

    def fwd():
        return packattn.attention(q, k, v, seqs, causal=True, backend=backend)

    f = triton.testing.do_bench(fwd, warmup=10, rep=50, return_mode="median")
    fb = triton.testing.do_bench(lambda: torch.autograd.grad(fwd(), (q, k, v), dout), warmup=10, rep=50,
                                 return_mode="median")
    return w.fwd_flops() / f / 1e9, 3.5 * w.fwd_flops() / fb / 1e9


def run_cp_bench(strategies=None, balances=None, backend: str = "triton", json_path: str | None = None,
                 check: bool = True, overlap_groups: list[int] | None = None, docs: str = "w10",
                 plot_path: str | None = None) -> int:
    if environment.get("RANK") is None:
        print("packattn bench --cp runs under torchrun, e.g.\n"
              "  torchrun --nproc_per_node 2 -m packattn.cli bench --cp --json W10.json")
        return 2
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(environment.get("LOCAL_RANK", str(rank))))
    w = w10(world, docs)
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, seed=0)  # the same global inputs on every rank
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator("cuda").manual_seed(1))
    single = _single_gpu(backend, docs) if rank == 0 else (0.0, 0.0)
    ref = None
    if check and rank == 0:
        ref = _references(q, k, v, seqs, dout, backend, fp32=docs == "w10")
    flops = w.fwd_flops()
    rows = []
    for strategy in strategies or STRATEGIES:
        group = _group_for(strategy, world)
        for balance in balances or BALANCES:
            for groups in (overlap_groups or [None]) if strategy == "allgather" else [None]:
                options = {} if groups is None else {"overlap_groups": groups}
                rows.append(_run_strategy(w.name, strategy, balance, group, seqs, q, k, v, dout, ref, flops, single,
                                          backend, check, options))
                if rank == 0:
                    print(_format_row(rows[-1]), flush=True)
    if rank == 0:
        env = {"gpu": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
               "triton": __import__("triton").__version__, "packattn": packattn.__version__,
               "date": datetime.date.today().isoformat(), "backend": backend,
               "workload": w.name, "single_gpu": "W2" if docs == "w10" else f"one document of {TOKENS_PER_GPU}",
               "single_gpu_W2_tflops": {"fwd": round(single[0], 1), "fwdbwd": round(single[1], 1)}}
        print(f"\n{env['gpu']} x{world}, torch {env['torch']}, triton {env['triton']}, backend {backend}; "
              f"{w.name}; single GPU ({env['single_gpu']}) {single[0]:.1f} / {single[1]:.1f} TF/s")
        for row in rows:
            print(_format_row(row))
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)
        if plot_path:
            plot_rows(rows, f"{w.name} on {world}x {env['gpu']}", plot_path)
    dist.destroy_process_group()
    return 0


GRADS = ("out", "lse", "dq", "dk", "dv")


def _one_gpu(q, k, v, seqs, dout, backend: str) -> list[torch.Tensor]:
    out, lse = packattn.attention(q, k, v, seqs, causal=True, backend=backend, return_lse=True)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _references(q, k, v, seqs, dout, backend: str, fp32: bool = True) -> dict:
    """One GPU on the global inputs: in bf16 (``"bf16"``) and, from the same inputs upcast, in
    float32 (``"fp32"``), with the bf16 result's relative L2 errors against the float32 one
    (``"single_errors"``): the yardstick of the acceptance test (`check_against_fp32`). Without
    ``fp32`` (too slow in IEEE float32 for one 64k-token document) only the bf16 result."""
    bf16 = _one_gpu(q, k, v, seqs, dout, backend)
    if not fp32:
        return {"bf16": bf16}
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    fp32 = _one_gpu(*leaves, seqs, dout.float(), backend)
    return {"bf16": bf16, "fp32": fp32, "single_errors": {n: _rel_l2(a, b) for n, a, b in zip(GRADS, bf16, fp32)}}


def check_against_fp32(cp_errors: dict, single_errors: dict, atol: float = 1e-4) -> bool:
    """The CP result is as accurate as one GPU in the same dtype: for out, lse, dq, dk and dv, its
    relative L2 error against the float32 result is at most twice the single-GPU error plus ``atol``."""
    return all(cp_errors[n] <= 2 * single_errors[n] + atol for n in GRADS)


def _run_strategy(workload, strategy, balance, group, seqs, q, k, v, dout, ref, flops, single, backend, check,
                  options: dict) -> dict:
    """One row; ``options``: more keywords of ``cp.attention`` (``overlap_groups``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    suffix = f":G{options['overlap_groups']}" if "overlap_groups" in options else ""
    row = {"workload": workload, "impl": f"packattn:cp:{strategy}:{balance}{suffix}", "world": world, **options}
    try:
        torch.cuda.reset_peak_memory_stats()
        p = cp.plan(seqs, group, strategy=strategy, balance=balance)
        ql, kl, vl = (p.shard(x).detach().requires_grad_() for x in (q, k, v))
        dl = p.shard(dout)

        def fwd():
            return cp.attention(ql, kl, vl, p, causal=True, backend=backend, return_lse=True, **options)

        def fwdbwd():
            out, _ = fwd()
            torch.autograd.grad(out, (ql, kl, vl), dl)

        if check:  # every rank unshards (a collective); rank 0 compares
            out_l, lse_l = fwd()
            grads = torch.autograd.grad(out_l, (ql, kl, vl), dl)
            got = [p.unshard(out_l.detach()), p.unshard(lse_l.detach().t().contiguous()).t()] + [p.unshard(g) for g in grads]
            if rank == 0 and ref is not None:
                row["errors"] = {n: round(_rel_l2(a, b), 8) for n, a, b in zip(GRADS, got, ref["bf16"])}
            if rank == 0 and ref is not None and "fp32" in ref:
                fp32_errors = {n: _rel_l2(a, b) for n, a, b in zip(GRADS, got, ref["fp32"])}
                row["errors_vs_fp32"] = {n: round(e, 8) for n, e in fp32_errors.items()}
                row["single_errors_vs_fp32"] = {n: round(e, 8) for n, e in ref["single_errors"].items()}
                row["accuracy_ok"] = check_against_fp32(fp32_errors, ref["single_errors"])
            row["deterministic_bitwise"] = _bitwise_repeatable(ql, kl, vl, dl, p, backend, options)
        fwd_ms, fwdbwd_ms = _timed(lambda: fwd()), _timed(fwdbwd)
        comm, exposed = exposed_communication(_profile_kernels(fwdbwd))
        fwd_tf, fb_tf = flops / (fwd_ms * world) / 1e9, 3.5 * flops / (fwdbwd_ms * world) / 1e9
        row.update(fwd_ms=round(fwd_ms, 3), fwdbwd_ms=round(fwdbwd_ms, 3), fwd_tflops=round(fwd_tf, 1),
                   fwdbwd_tflops=round(fb_tf, 1), comm_ms_fwdbwd=round(comm, 3), exposed_comm_ms_fwdbwd=round(exposed, 3),
                   peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), local_rows=p.num_local)
        if single[0]:
            row.update(eff_fwd=round(fwd_tf / single[0], 3), eff_fwdbwd=round(fb_tf / single[1], 3))
    except Exception as e:  # noqa: BLE001 -- report and go on with the next strategy (every rank fails alike)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def _bitwise_repeatable(q, k, v, dout, plan, backend, options: dict) -> bool:
    """Two forward+backward runs with ``deterministic=True`` give bitwise-equal out, lse and
    gradients on every rank."""
    runs = []
    for _ in range(2):
        out, lse = cp.attention(q, k, v, plan, causal=True, backend=backend, return_lse=True, deterministic=True,
                                **options)
        runs.append([out, lse, *torch.autograd.grad(out, (q, k, v), dout)])
    same = torch.tensor([all(torch.equal(a, b) for a, b in zip(*runs))], device="cuda", dtype=torch.int32)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def _format_row(row: dict) -> str:
    name = f"{row['impl'].removeprefix('packattn:cp:'):22s}"
    if "error" in row:
        return f"{name} ERROR {row['error']}"
    errors = row.get("errors", {})
    worst = f"{max(errors.values()):.1e}" if errors else "unchecked"
    repeatable = {True: "bitwise", False: "DIFFERS", None: "unchecked"}[row.get("deterministic_bitwise")]
    return (f"{name} fwd {row['fwd_ms']:7.3f} ms {row['fwd_tflops']:6.1f} TF/s/GPU eff {row.get('eff_fwd', 0):.2f} | "
            f"fwd+bwd {row['fwdbwd_ms']:7.3f} ms {row['fwdbwd_tflops']:6.1f} TF/s/GPU eff {row.get('eff_fwdbwd', 0):.2f} | "
            f"comm {row['comm_ms_fwdbwd']:.3f} ms, exposed {row['exposed_comm_ms_fwdbwd']:.3f} ms | "
            f"peak {row['peak_mem_gib']:.1f} GiB | max rel err {worst} | "
            f"vs fp32 {_accuracy_word(row)} | "
            f"deterministic {repeatable}")


def _accuracy_word(row: dict) -> str:
    if "accuracy_ok" not in row:
        return "unchecked"
    worst = max(row["errors_vs_fp32"][n] / max(row["single_errors_vs_fp32"][n], 1e-30) for n in GRADS)
    return f"{'OK' if row['accuracy_ok'] else 'FAIL'} ({worst:.2f}x one GPU)"


def plot_rows(rows: list[dict], title: str, png: str) -> None:
    """Parallel efficiency, forward and forward+backward, one pair of bars per strategy row of one
    `run_cp_bench` run (failed rows left out), with the issue's 0.85 line."""
    plt = pyplot()
    if plt is None:
        return

    done = [r for r in rows if "eff_fwd" in r]
    names = [r["impl"].removeprefix("packattn:cp:") for r in done]
    y = range(len(done))
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.45 * len(done)))
    ax.barh([i - 0.2 for i in y], [r["eff_fwd"] for r in done], height=0.4, label="fwd")
    ax.barh([i + 0.2 for i in y], [r["eff_fwdbwd"] for r in done], height=0.4, label="fwd+bwd")
    ax.axvline(0.85, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.1)
    ax.set_xlabel("parallel efficiency (one GPU = 1)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_scaling(json_paths: list[str], png: str) -> None:
    """Parallel efficiency (forward+backward) against world size, one line per strategy:balance,
    from `run_cp_bench` JSON files of several world sizes."""
    plt = pyplot()
    if plt is None:
        return

    lines: dict[str, list[tuple[int, float]]] = {}
    gpu = ""
    for path in json_paths:
        with open(path) as f:
            data = json.load(f)
        gpu = data["env"]["gpu"]
        for row in data["rows"]:
            if "eff_fwdbwd" in row:
                lines.setdefault(row["impl"].removeprefix("packattn:cp:"), []).append((row["world"], row["eff_fwdbwd"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(lines.items()):
        points.sort()
        ax.plot([w for w, _ in points], [e for _, e in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (world size)")
    ax.set_ylabel("parallel efficiency, fwd+bwd")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"W10 weak scaling (32768 tokens per GPU), {gpu}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
