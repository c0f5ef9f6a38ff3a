"""`packattn bench`: time each workload on each implementation, print a table, write JSON and a plot."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time

import torch

import packattn
from packattn.bench import small_seq
from packattn.bench.anchors import ANCHORS, EXPANDED_ANCHORS, IMPLS, Unavailable
from packattn.bench.plotting import pyplot
from packattn.bench.workloads import TreeWorkload, Workload, all_workloads, head_dim_workloads


def _do_bench(fn, warmup: int = 250, rep: int = 100) -> float:
    """Median ms of ``fn`` over ``rep`` ms of calls, after ``warmup`` ms of the same calls (triton.testing.do_bench,
    which flushes the L2 cache before every timed call). The long warm-up: a GPU at its power limit runs a
    kernel at clocks that depend on what ran before it, so the warm-up lets them settle at this call's own
    level; the remaining drift is averaged out by measuring every row in several rounds (`run_bench`'s
    ``rounds``; benchmarks/NOTES.md has the measurements behind both)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_fwd_fwdbwd(fn, q, k, v, *, warmup: int = 250, rep: int = 100, forward_grad: bool = True,
                    backward: bool = True) -> tuple[float, float | None]:
    """``(forward ms, forward+backward ms)`` of ``fn(q, k, v) -> out`` (`_do_bench` medians): the backward takes
    a ``dout`` of the output's shape and returns the gradients of q, k, v. ``forward_grad=False`` times the forward
    under ``torch.no_grad()`` (what an inference call dispatches as); ``backward=False`` skips the second time
    (None). The one timing helper of `packattn bench` and `packattn tune`."""
    dout = q.new_empty(*q.shape[:-1], v.shape[-1]).normal_()  # the output has the value head dim

    def forward():
        if forward_grad:
            return fn(q, k, v)
        with torch.no_grad():
            return fn(q, k, v)

    def fwdbwd():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    fwd_ms = _do_bench(forward, warmup, rep)
    return fwd_ms, (_do_bench(fwdbwd, warmup, rep) if backward else None)


def _copy_TBps(x: torch.Tensor) -> float:
    y = torch.empty_like(x)
    ms = _do_bench(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e12


def _ceilings(device) -> dict:
    """Measured device-to-device copy bandwidth (read + write) and bf16 matmul rate."""
    copy = _copy_TBps(torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device))  # 2 GiB, freed after
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = _do_bench(lambda: a @ b)
    return {"copy_TBps": round(copy, 3), "matmul_tflops": round(2 * 8192**3 / (ms * 1e-3) / 1e12, 1)}


def _gpu_state(device) -> dict:
    """SM clock (MHz), temperature (C) and power (W) of ``device`` now, through NVML (torch.cuda.clock_rate
    etc.); {} where NVML is missing. Recorded after each row: a GPU that heats up over a long run clocks down,
    and rows measured later then run slower than the same work measured cold."""
    try:
        return {"sm_mhz": torch.cuda.clock_rate(device), "temp_c": torch.cuda.temperature(device),
                "power_w": round(torch.cuda.power_draw(device) / 1000)}
    except Exception:  # noqa: BLE001 - pynvml missing or not supported: no state, not a failed row
        return {}


def _heat_up(device, seconds: float) -> dict:
    """Run bf16 matmuls for ``seconds`` so the rows that follow start at the clocks a long run settles at
    (not a cold GPU's boost); the GPU state after it."""
    if seconds <= 0:
        return {}
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)
    return _gpu_state(device)


def _inputs_for(w: Workload, impl: str, device):
    """Anchors that cannot take padding run on the unpadded data (workloads.md: W3's anchors);
    the varlen anchors of a tree workload run on its expanded batch (every sequence in full)."""
    if isinstance(w, TreeWorkload) and impl in EXPANDED_ANCHORS:
        w = w.expanded()
    if w.pad_to_multiple and not impl.startswith("packattn:"):
        w = dataclasses.replace(w, pad_to_multiple=None)
    seqs, q, k, v = w.make_inputs(device, torch.bfloat16, seed=0)
    return w, seqs, q, k, v


def run_one(w: Workload, impl: str, device) -> dict:
    row = {"workload": w.name.split()[0], "impl": impl}
    try:
        w_used, seqs, q, k, v = _inputs_for(w, impl, device)
        fn = IMPLS[impl](w_used, seqs)
        group = getattr(fn, "expand_kv", 1)
        if group > 1:
            k = k.detach().repeat_interleave(group, dim=1).requires_grad_()
            v = v.detach().repeat_interleave(group, dim=1).requires_grad_()
        fwd_ms, fwdbwd_ms = time_fwd_fwdbwd(fn, q, k, v)
        flops = getattr(fn, "flops", None) or w.fwd_flops()
        row.update(
            fwd_ms=round(fwd_ms, 4), fwdbwd_ms=round(fwdbwd_ms, 4),
            fwd_tflops=round(flops / (fwd_ms * 1e-3) / 1e12, 1),
            fwdbwd_tflops=round(3.5 * flops / (fwdbwd_ms * 1e-3) / 1e12, 1),
        )
        row.update(_gpu_state(device))
    except Unavailable as e:
        row["error"] = f"unavailable: {e}"
    except Exception as e:  # noqa: BLE001 - a failed run is a row, not a crash
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    torch.cuda.empty_cache()
    return row


def run_bench(workloads: list[str] | None = None, impls: list[str] | None = None, json_path=None, plot_path=None,
              autograd_threads: bool = True, heat_up_seconds: float = 0.0, pause_seconds: float = 0.0,
              rounds: int = 1) -> int:
    """Time ``workloads`` x ``impls`` (table, JSON, plot). ``autograd_threads=False`` runs every
    implementation's backward on the calling thread (`torch.autograd.set_multithreading_enabled`)
    instead of autograd's CUDA device thread, whose hand-off costs a few hundred microseconds of host time
    per backward on some hosts (benchmarks/NOTES.md, "Host: autograd's CUDA device thread"): what a host-bound
    call measures. ``heat_up_seconds``: matmuls first, so that early rows do not run on a cold GPU (`_heat_up`); every
    row records the SM clock, temperature and power after it (`_gpu_state`). ``pause_seconds``: the GPU idles
    this long before each row, so that every row starts from a similar temperature, not from the heat
    the row before it left (a dense-SDPA row, the hottest, is followed by the next workload's rows).
    ``rounds``: every row is measured this many times, one full pass over the rows per round, and the table
    shows the median of each time (`merge_rounds`): a row then does not hang on the state (clocks, heat,
    host) of the one moment it was measured in."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not torch.cuda.is_available():
        print("packattn bench needs a CUDA GPU")
        return 1
    import triton

    device = torch.device("cuda")
    env = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "packattn": packattn.__version__, "date": datetime.date.today().isoformat(), **_ceilings(device),
        "autograd_threads": autograd_threads, "rounds": rounds,
    }
    print(f"{env['gpu']} torch {env['torch']} triton {env['triton']}: copy {env['copy_TBps']} TB/s, bf16 matmul "
          f"{env['matmul_tflops']} TF/s, autograd device threads {'on' if autograd_threads else 'off'}")
    env["heat_up"] = {"seconds": heat_up_seconds, **_heat_up(device, heat_up_seconds)}
    env["pause_seconds"] = pause_seconds
    if heat_up_seconds > 0:
        print(f"heated up for {heat_up_seconds:g} s: {env['heat_up']}")
    torch.autograd.set_multithreading_enabled(autograd_threads)
    try:
        return _run_jobs(workloads, impls, json_path, plot_path, device, env, pause_seconds, rounds)
    finally:
        torch.autograd.set_multithreading_enabled(True)


def _run_jobs(workloads, impls, json_path, plot_path, device, env, pause_seconds: float = 0.0,
              rounds: int = 1) -> int:
    table = {**all_workloads(), **head_dim_workloads()}
    names = workloads or [*all_workloads(), *small_seq.small_seq_workloads()]
    impls = impls or list(IMPLS)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x
    bandwidth = small_seq.small_seq_workloads()
    unknown = [n for n in names if n not in table and n not in bandwidth]
    if unknown:
        print(f"unknown workloads {unknown}; known: {', '.join([*table, *bandwidth])}")
        return 2
    jobs = [(n, i) for n in names if n in table for i in impls]
    jobs += [(n, i) for n in names if n in bandwidth for i in small_seq.IMPLS]  # W9 has its own implementations
    jobs = [(n, i) for n, i in jobs if not (i == "sdpa_dense" and n not in ("W1", "W2"))]
    samples: dict[tuple[str, str], list[dict]] = {job: [] for job in jobs}
    for name, impl in tqdm(jobs * rounds, desc="bench", mininterval=5):
        if pause_seconds > 0:
            torch.cuda.synchronize(device)
            time.sleep(pause_seconds)
        if name in bandwidth:
            samples[name, impl].append(small_seq.run_one(bandwidth[name], impl, device, _do_bench))
        else:
            samples[name, impl].append(run_one(table[name], impl, device))
    rows = [merge_rounds(s) for s in samples.values()]
    print_table(rows, env)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        plot(rows, plot_path, env)
    return 0


_TIMES = (("fwd_ms", ("fwd_tflops", "fwd_TBps")), ("fwdbwd_ms", ("fwdbwd_tflops", "fwdbwd_TBps")))


def merge_rounds(samples: list[dict]) -> dict:
    """One row from the rounds of one (workload, impl): each time (forward, forward+backward) is the median
    of the rounds that ran (the lower median for an even count, so that it is a measured value), with the
    rate measured with it; ``rounds_ms`` keeps every round's times and the GPU state is that of the last
    round. A row that failed in every round is the first failure; rounds that failed while others ran are
    counted in ``failed_rounds``."""
    ran = [s for s in samples if "error" not in s]
    if len(samples) == 1 or not ran:
        return samples[0]
    row = dict(ran[-1])
    row["rounds_ms"] = {}
    for time_key, rate_keys in _TIMES:
        ordered = sorted(ran, key=lambda s: s[time_key])
        median = ordered[(len(ordered) - 1) // 2]
        row[time_key] = median[time_key]
        row.update({k: median[k] for k in rate_keys if k in median})
        row["rounds_ms"][time_key] = [s[time_key] for s in ran]
    if len(ran) < len(samples):
        row["failed_rounds"] = [s["error"] for s in samples if "error" in s]
    return row


def _spread(row: dict, time_key: str) -> str:
    times = row["rounds_ms"][time_key]
    return f"{(max(times) - min(times)) / row[time_key]:.0%}"


def print_table(rows: list[dict], env: dict | None = None) -> None:
    by_wl: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_wl.setdefault(r["workload"], {})[r["impl"]] = r
    bandwidth = {wl: impls for wl, impls in by_wl.items() if any("fwd_TBps" in r for r in impls.values())}
    if bandwidth:
        copy = (env or {}).get("copy_TBps")
        print(f"{'workload':<8} {'impl':<26} {'fwd ms':>8} {'fwd TB/s':>9} {'f+b ms':>8} {'f+b TB/s':>9}"
              f"  (device-to-device copy: {copy} TB/s)")
        for wl, impls in bandwidth.items():
            for impl, r in impls.items():
                if "error" in r:
                    print(f"{wl:<8} {impl:<26} {r['error'][:90]}")
                    continue
                print(f"{wl:<8} {impl:<26} {r['fwd_ms']:>8.3f} {r['fwd_TBps']:>9.3f} {r['fwdbwd_ms']:>8.3f} "
                      f"{r['fwdbwd_TBps']:>9.3f}")
        by_wl = {wl: impls for wl, impls in by_wl.items() if wl not in bandwidth}
        if not by_wl:
            return
    if (env or {}).get("rounds", 1) > 1:
        print(f"times: median of {env['rounds']} rounds; spread (fwd / f+b) = (slowest - fastest) / median")
    header = f"{'workload':<6} {'impl':<16} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9}  ratios (fwd / f+b) vs anchors"
    print(header)
    for wl, impls in by_wl.items():
        for impl, r in impls.items():
            if "error" in r:
                print(f"{wl:<6} {impl:<16} {r['error'][:90]}")
                continue
            ratios = []
            for a in ANCHORS:
                ar = impls.get(a)
                if a != impl and ar and "error" not in ar and not impl in ANCHORS:
                    ratios.append(f"{a} {r['fwd_tflops'] / ar['fwd_tflops']:.2f}/{r['fwdbwd_tflops'] / ar['fwdbwd_tflops']:.2f}")
            state = f"  [{r['sm_mhz']} MHz {r['temp_c']} C]" if "sm_mhz" in r else ""
            if "rounds_ms" in r:
                state += f"  spread {_spread(r, 'fwd_ms')}/{_spread(r, 'fwdbwd_ms')}"
            print(f"{wl:<6} {impl:<16} {r['fwd_ms']:>8.3f} {r['fwd_tflops']:>9.1f} {r['fwdbwd_ms']:>8.3f} {r['fwdbwd_tflops']:>9.1f}  {', '.join(ratios)}{state}")


def plot(rows: list[dict], path, env) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if "fwd_TBps" not in r]  # bandwidth workloads (W9) are in the table only
    wls = sorted({r["workload"] for r in rows})
    impls = [i for i in IMPLS if any(r["impl"] == i and "error" not in r for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(1, len(impls))
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwdbwd_tflops", "forward+backward")):
        for j, impl in enumerate(impls):
            vals = [next((r.get(key, math.nan) for r in rows if r["workload"] == w and r["impl"] == impl), math.nan) for w in wls]
            ax.bar([i + j * width for i in range(len(wls))], vals, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(wls))], wls)
        ax.set_ylabel("TF/s (useful FLOPs)")
        ax.set_title(f"{title}: {env['gpu']}, torch {env['torch']}, {env['date']}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
