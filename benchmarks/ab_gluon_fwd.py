"""A/B of the Gluon Hopper forward (`packattn.ops.varlen.launch_sm90_fwd`) against the Triton forward
(``packattn.attention(..., backend="triton")``, i.e. ``torch.ops.packattn.varlen_fwd``), on one GPU,
for every configuration of ``tg.ab_variants(head_dim)`` (the launcher's default, the other tile
shapes, and the warp-specialised kernel: plain, ``direct``, ``persistent``, ``persistent,direct``).

    python3 benchmarks/ab_gluon_fwd.py [W1 W2 W4 W8] [--jobs N] [--skip-nasty] [--variants LABEL ...]   (workloads first)

LABEL is a configuration in the format of ``$PACKATTN_GLUON_FWD_CONFIG`` (`tg.parse_config`), e.g.
``128,128,3,8`` or ``128,128,3,8,ws,persistent,direct``; ``--variants`` replaces the list (labels
are used at every head dim they fit).

1. Correctness, in ``--jobs`` processes (one per (variant, head dim), so the compiles run in
   parallel; a process that runs past ``--job-timeout`` s is killed and its variant reported as
   hung -- a warp-specialised pipeline that deadlocks shows up here): the small nasty cases
   (lengths [1, 0, 17, 37, 100, 129, 300], GQA, causal both alignments, windows, chunks, cross
   lengths, padding with NaN in the padding rows, d 64/128, fp16/bf16) and, at d 128, the
   workloads: max |out| and |lse| differences to the Triton forward. Both kernels round P to 16
   bits before the PV product and accumulate in a different order, so out differs by a few bf16
   ulps (tolerance 2e-2 absolute at |out| <= ~3) and lse by float32 noise (tolerance 1e-3).
2. Timing, in this process, after the correctness phase (the compiled kernels are in Triton's
   disk cache by then): the median forward time (``torch.no_grad``, ``triton.testing.do_bench``,
   tile tables cached as in real use) and TF/s on the workload's useful FLOPs, per workload and
   variant; variants that failed or hung in phase 1 are not timed.
A failing case is reported and the script goes on; the summary table comes last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback

import torch
import triton.testing

import packattn
from packattn.ops.varlen import launch_sm90_fwd as tg
from packattn.backends.triton_varlen import tile_table
from packattn.bench.workloads import varlen_workloads
from packattn.mask import Mask
from packattn.varlen import Varlen

NASTY_LENGTHS = [1, 0, 17, 37, 100, 129, 300]
OUT_TOL, LSE_TOL = 2e-2, 1e-3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def gluon_attention(q, k, v, seqs: Varlen, scale: float | None = None, config: tg.GluonConfig | None = None,
                    max_programs: int | None = None, **options):
    """``(out, lse)`` through `gluon_fwd`, set up as `TritonVarlenBackend.run` sets up the Triton
    forward (mask, tile table with the Gluon kernel's block sizes, physical row offsets);
    ``config`` None: `tg.config_for` (the table, or ``$PACKATTN_GLUON_FWD_CONFIG``)."""
    mask = Mask.make(**options)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if scale < 0:
        q, scale = -q, -scale
    cfg = config or tg.config_for(q.shape[-1])
    q_tiles = tile_table(seqs, mask, False, cfg.block_m, cfg.block_n)
    rows_q = seqs.cu_seqlens_q_padded if seqs.cu_seqlens_q_padded is not None else seqs.cu_seqlens_q
    rows_kv = seqs.cu_seqlens_kv_padded if seqs.cu_seqlens_kv_padded is not None else seqs.cu_seqlens_kv
    return tg.gluon_fwd(q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_kv, rows_q, rows_kv, q_tiles, scale,
                        mask.left, mask.right, mask.chunk_size or 0, mask.align == "top_left",
                        seqs.cu_seqlens_q_padded is not None, config=cfg, max_programs=max_programs)


def triton_attention(q, k, v, seqs: Varlen, **options):
    return packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **options)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| where equal infinities (lse = -inf rows) count as 0 and any NaN as inf."""
    a, b = a.float(), b.float()
    same = (a == b)
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return float(diff.max()) if diff.numel() else 0.0


def _padding_rows(total: int, cu: torch.Tensor, cu_padded: torch.Tensor | None) -> torch.Tensor:
    """Boolean (total,) mask of the rows that belong to no sequence (padding between sequences)."""
    in_seq = torch.zeros(total, dtype=torch.bool)
    if cu_padded is None:
        return in_seq
    cu, cu_padded = cu.cpu().tolist(), cu_padded.cpu().tolist()
    for i in range(len(cu) - 1):
        in_seq[cu_padded[i]:cu_padded[i] + cu[i + 1] - cu[i]] = True
    return ~in_seq


def nasty_cases():
    """(name, lengths_q, lengths_kv, heads_q, heads_kv, head_dim, dtype, options, pad_to_multiple)."""
    L = NASTY_LENGTHS
    cross = [5, 3, 40, 0, 130, 129, 257]
    cases = []
    for dtype in ("bf16", "fp16"):
        for d in (128, 64):
            cases += [
                (f"{dtype} d{d} causal", L, None, 4, 4, d, dtype, {"causal": True}, None),
                (f"{dtype} d{d} no mask", L, None, 4, 4, d, dtype, {}, None),
            ]
    cases += [
        ("bf16 d128 GQA 4/2 causal", L, None, 4, 2, 128, "bf16", {"causal": True}, None),
        ("bf16 d128 causal top-left", L, None, 4, 4, 128, "bf16", {"causal": "top_left"}, None),
        ("bf16 d128 window (16,0)", L, None, 4, 4, 128, "bf16", {"window": (16, 0)}, None),
        ("bf16 d128 causal window (16,0)", L, None, 4, 4, 128, "bf16", {"causal": True, "window": (16, 0)}, None),
        ("bf16 d128 window (8,8)", L, None, 4, 4, 128, "bf16", {"window": (8, 8)}, None),
        ("bf16 d128 chunk 32 causal", L, None, 4, 4, 128, "bf16", {"causal": True, "chunk_size": 32}, None),
        ("bf16 d128 chunk 32", L, None, 4, 4, 128, "bf16", {"chunk_size": 32}, None),
        ("bf16 d64 window (8,8) GQA 4/1", L, None, 4, 1, 64, "bf16", {"window": (8, 8)}, None),
        ("bf16 d128 cross causal", L, cross, 4, 2, 128, "bf16", {"causal": True}, None),
        ("bf16 d128 cross causal top-left", L, cross, 4, 2, 128, "bf16", {"causal": "top_left"}, None),
        ("bf16 d128 cross no mask", L, cross, 4, 2, 128, "bf16", {}, None),
        ("bf16 d128 padded(8) causal NaN pads", L, None, 4, 4, 128, "bf16", {"causal": True}, 8),
        ("bf16 d128 padded(8) no mask NaN pads", L, None, 4, 2, 128, "bf16", {}, 8),
        ("bf16 d64 padded(8) chunk 32 NaN pads", L, None, 4, 4, 64, "bf16", {"causal": True, "chunk_size": 32}, 8),
        ("bf16 d128 padded(8) cross window(8,8)", L, cross, 4, 2, 128, "bf16", {"window": (8, 8)}, 8),
    ]
    return cases


def run_nasty(case, config: tg.GluonConfig | None = None, max_programs: int | None = None
              ) -> tuple[str, float, float, bool]:
    name, lq, lk, hq, hkv, d, dtype_name, options, pad = case
    dtype = DTYPES[dtype_name]
    seqs = Varlen.from_lengths(lq, lk, pad_to_multiple=pad, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seqs.total_q, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(seqs.total_kv, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(seqs.total_kv, hkv, d, device="cuda", dtype=dtype, generator=gen)
    pad_q = _padding_rows(seqs.total_q, seqs.cu_seqlens_q, seqs.cu_seqlens_q_padded).cuda()
    pad_kv = _padding_rows(seqs.total_kv, seqs.cu_seqlens_kv, seqs.cu_seqlens_kv_padded).cuda()
    q[pad_q] = float("nan")  # padding rows may be uninitialised memory: nothing may leak from them
    k[pad_kv] = float("nan")
    v[pad_kv] = float("nan")
    with torch.no_grad():
        ref_out, ref_lse = triton_attention(q, k, v, seqs, **options)
        out, lse = gluon_attention(q, k, v, seqs, config=config, max_programs=max_programs, **options)
    torch.cuda.synchronize()
    d_out, d_lse = _max_diff(out, ref_out), _max_diff(lse, ref_lse)
    return name, d_out, d_lse, d_out <= OUT_TOL and d_lse <= LSE_TOL


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def check_workload(w, cfg: tg.GluonConfig) -> tuple[float, float, bool]:
    """(max |dout|, max |dlse|, ok) of the Gluon forward with ``cfg`` against the Triton forward."""
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=False)
    with torch.no_grad():
        ref_out, ref_lse = triton_attention(q, k, v, seqs, **w.options)
        out, lse = gluon_attention(q, k, v, seqs, config=cfg, **w.options)
    torch.cuda.synchronize()
    d_out, d_lse = _max_diff(out, ref_out), _max_diff(lse, ref_lse)
    return d_out, d_lse, d_out <= OUT_TOL and d_lse <= LSE_TOL


def correctness_job(label: str, head_dim: int, workloads: list[str], path: str) -> None:
    """Phase 1 for one (variant, head dim), in its own process: nasty cases of that head dim, then
    (d = 128) the workloads. Appends one JSON line per result to ``path`` as it goes, so a
    process killed for hanging still leaves what it finished."""
    cfg = tg.parse_config(label)
    table = varlen_workloads()

    def emit(**row):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    # a persistent grid also runs on 3 programs, so that every program walks many tiles (long and
    # short, empty ones, several heads) through the same ring / Q barriers
    grids = [None, 3] if cfg.persistent else [None]
    for case in nasty_cases():
        if case[5] != head_dim:
            continue
        for max_programs in grids:
            name = case[0] + ("" if max_programs is None else f" [{max_programs} programs]")
            emit(kind="start", name=name)
            try:
                _, d_out, d_lse, ok = run_nasty(case, cfg, max_programs)
                emit(kind="nasty", name=name, d_out=d_out, d_lse=d_lse, ok=ok)
            except Exception as e:  # noqa: BLE001 -- report and go on
                emit(kind="nasty", name=name, d_out=float("nan"), d_lse=float("nan"), ok=False,
                     error=f"{type(e).__name__}: {str(e)[:300]}")
    for name in workloads:
        w = table[name]
        if w.head_dim != head_dim:
            continue
        emit(kind="start", name=name)
        try:
            d_out, d_lse, ok = check_workload(w, cfg)
            emit(kind="workload", name=name, d_out=d_out, d_lse=d_lse, ok=ok)
        except Exception as e:  # noqa: BLE001
            emit(kind="workload", name=name, d_out=float("nan"), d_lse=float("nan"), ok=False,
                 error=f"{type(e).__name__}: {str(e)[:300]}")
    emit(kind="done")


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_correctness(jobs: list[tuple[str, int]], workloads: list[str], n_procs: int, timeout: float
                    ) -> dict[tuple[str, int], dict]:
    """Run `correctness_job` for every (label, head_dim) in ``n_procs`` spawned processes; returns
    ``{(label, d): {"rows": [...], "status": "ok" | "hung" | "crashed"}}``."""
    ctx = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="ab_gluon_")
    pending = list(jobs)
    running: dict[tuple[str, int], tuple] = {}
    results: dict[tuple[str, int], dict] = {}
    while pending or running:
        while pending and len(running) < n_procs:
            label, d = pending.pop(0)
            path = os.path.join(tmp, f"{label.replace(',', '_')}_d{d}.jsonl")
            proc = ctx.Process(target=correctness_job, args=(label, d, workloads, path), daemon=True)
            proc.start()
            running[(label, d)] = (proc, path, time.time())
        time.sleep(0.5)
        for key, (proc, path, t0) in list(running.items()):
            hung = proc.is_alive() and time.time() - t0 > timeout
            if proc.is_alive() and not hung:
                continue
            if hung:
                proc.kill()
            proc.join()
            rows = _read_rows(path)
            done = any(r["kind"] == "done" for r in rows)
            status = "ok" if done else ("hung" if hung else f"crashed (exit {proc.exitcode})")
            if not done:  # the case it was running when it died
                started = [r["name"] for r in rows if r["kind"] == "start"]
                finished = {r["name"] for r in rows if r["kind"] in ("nasty", "workload")}
                if started and started[-1] not in finished:
                    rows.append({"kind": "nasty", "name": started[-1], "d_out": float("nan"),
                                 "d_lse": float("nan"), "ok": False, "error": status})
            results[key] = {"rows": [r for r in rows if r["kind"] in ("nasty", "workload")], "status": status}
            del running[key]
            _print_job(key, results[key])
    return results


def _print_job(key, result) -> None:
    label, d = key
    rows = result["rows"]
    bad = [r for r in rows if not r["ok"]]
    print(f"  [{label} d={d}] {result['status']}: {len(rows) - len(bad)}/{len(rows)} ok", flush=True)
    for r in rows:
        if not r["ok"] or os.environ.get("AB_VERBOSE"):
            print(f"    {'ok  ' if r['ok'] else 'FAIL'} {r['kind']:8s} {r['name']:42s} out {r['d_out']:.3e} "
                  f"lse {r['d_lse']:.3e} {r.get('error', '')}", flush=True)


def time_workload(name: str, w, configs: list[tg.GluonConfig]) -> list[dict]:
    """Median forward time of the Triton forward and of the Gluon one per config."""
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=False)
    flops = w.fwd_flops()
    rows = []
    with torch.no_grad():
        triton_ms = bench(lambda: triton_attention(q, k, v, seqs, **w.options))
        for cfg in configs:
            row = {"name": name, "config": cfg.label(), "triton_ms": triton_ms, "triton_tf": flops / triton_ms / 1e9}
            try:
                row["gluon_ms"] = bench(lambda: gluon_attention(q, k, v, seqs, config=cfg, **w.options))
                row["gluon_tf"] = flops / row["gluon_ms"] / 1e9
            except Exception as e:  # noqa: BLE001 -- report and go on
                row.update(gluon_ms=float("nan"), gluon_tf=0.0, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=["W1", "W2", "W4", "W8"])
    parser.add_argument("--variants", nargs="+", default=None, help="configuration labels instead of tg.ab_variants")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="correctness processes in parallel (each compiles its variant's kernels)")
    parser.add_argument("--job-timeout", type=float, default=420.0, help="seconds before a correctness process "
                        "counts as hung (compiles included)")
    parser.add_argument("--skip-nasty", action="store_true", help="no correctness phase (time everything)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs an sm_90 (Hopper) GPU")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    table = varlen_workloads()
    variants: dict[int, list[tg.GluonConfig]] = {}
    for d in tg.HEAD_DIMS:
        if args.variants:
            cfgs = [tg.parse_config(x) for x in args.variants]
            cfgs = [c for c in cfgs if tg.shared_bytes(c, d) <= tg.SM_SHARED - 1024]
        else:
            cfgs = tg.ab_variants(d)
        variants[d] = cfgs
        print(f"d={d}: default {tg.config_for(d).label()}; variants: " + "  ".join(c.label() for c in cfgs))
    failures = 0
    broken: set[tuple[str, int]] = set()

    if not args.skip_nasty:
        jobs = [(c.label(), d) for d in tg.HEAD_DIMS for c in variants[d]]
        print(f"\n== correctness: nasty cases (+ workloads at d=128) vs the Triton forward, {len(jobs)} jobs in "
              f"{args.jobs} processes ==", flush=True)
        t0 = time.time()
        results = run_correctness(jobs, args.workloads, args.jobs, args.job_timeout)
        print(f"  ({time.time() - t0:.0f} s)")
        for key, res in results.items():
            bad = res["status"] != "ok" or any(not r["ok"] for r in res["rows"])
            failures += bad
            if bad:
                broken.add(key)

    rows = []
    print("\n== timing (bf16; variants with a correctness failure are skipped) ==", flush=True)
    for name in args.workloads:
        w = table[name]
        cfgs = [c for c in variants[w.head_dim] if (c.label(), w.head_dim) not in broken]
        try:
            for row in time_workload(name, w, cfgs):
                rows.append(row)
                failures += "error" in row
                print(f"  {name} {row['config']:32s} triton {row['triton_ms']:.3f} ms, gluon {row['gluon_ms']:.3f} ms "
                      f"{row.get('error', '')}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"  {name}: ERR {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)

    if broken:
        print("\nvariants with correctness problems (not timed): "
              + ", ".join(f"{label} d={d}" for label, d in sorted(broken)))
    print("\nworkload gluon config                      triton ms  TF/s  gluon ms  TF/s  speedup")
    for r in rows:
        print(f"{r['name']:8s} {r['config']:32s} {r['triton_ms']:8.3f}  {r['triton_tf']:4.0f}  {r['gluon_ms']:8.3f}"
              f"  {r['gluon_tf']:4.0f}  {r['triton_ms'] / r['gluon_ms']:6.2f}x")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
