"""Small-seq bandwidth sweep (issue 27): forward and forward+backward of ``packattn.attention(...,
backend="small_seq")`` as a fraction of the device's copy bandwidth, for head dims 64/128/256/512 at heads
8/8 and 8/2 (W9 items: 30720, kv lengths 1..16) and 50,000 items at 8/2, d=256; several launch configs of
`packattn.ops.small_seq.configs` per shape, timed in interleaved rounds in one process.

    export PYTHONPATH=$PWD; python benchmarks/small_seq_sweep.py --out results.json
    python benchmarks/small_seq_sweep.py --shapes d256-8/2 --variant "x=h1 c2 u8 w4 s5|h1 c1 u8 w8 s3"

Bandwidth = minimum bytes / time (`packattn.bench.small_seq.SmallSeqWorkload`: forward q, k, v read and out
written; the backward adds q, k, v, dout read and dq, dk, dv written; bf16), time = triton.testing.do_bench
median (L2 flushed before each call), the median over ``--rounds`` interleaved rounds. That time includes
the host time of a call beyond the flush's (~0.1 ms), which at d = 64 GQA (~65 us forward, ~160 us f+b at
copy bandwidth) can decide it: the ``g*`` columns time the GPU alone (`gpu_ms`: a sleep kernel queued ahead
of the start event) and ``host`` is a call's host time (`host_us`). Copy bandwidth: a
2 GiB device-to-device copy (bytes read + written), measured before and after. Each variant's out / dq / dk
/ dv are compared with the first variant's (relative L2).

Variants: ``default`` (the tables), ``alt`` (the other candidate of `ALT`), ``s3`` (the defaults with one
pipeline buffer), ``u2`` / ``u24`` (units per program: no recompile), and per shape the candidates of
`PROPOSED` for the shapes below target (``f-*``: another forward config, ``b-*``: another backward
config, the other pass at its default). ``--variant "name=FWD|BWD"`` adds one (config strings as
`SmallSeqConfig.describe` writes them; ``BWD`` omitted: the same as ``FWD``). ``--only`` picks variants
by name (``default`` always runs first: the reference of relL2), ``--proposed`` runs the default, the
`PROPOSED` ones and ``--variant`` ones only:

    python benchmarks/small_seq_sweep.py --proposed --shapes d128-8/2

The table comes last: per shape the best forward and the best forward+backward variant (bwd ms = f+b ms -
fwd ms), against the targets (fwd >= 85%, f+b >= 60% of copy), and the best by GPU time alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
import triton.testing

from packattn.bench.small_seq import SmallSeqWorkload, make_impl
from packattn.ops.small_seq import configs

SHAPES = {f"d{d}-8/{kv}": SmallSeqWorkload(f"d{d}-8/{kv}", d, items=30720, heads=8, heads_kv=kv, min_keys=1)
          for d in configs.HEAD_DIMS for kv in (8, 2)}
SHAPES["50k-d256-8/2"] = SmallSeqWorkload("50k-d256-8/2", 256, items=50000, heads=8, heads_kv=2, min_keys=1)
C = configs.SmallSeqConfig
# (head_dim, group bucket) -> the other (fwd, bwd) candidates of the compile-time analysis (configs.py):
# more or fewer warps a unit, kv heads a unit, chunks, one pipeline buffer
ALT = {
    (64, 1): (C(block_h=8), C(block_h=1, num_warps=2)),
    (64, 2): (C(block_h=1, num_warps=1), C(block_h=1, num_warps=2)),
    (128, 1): (C(block_h=1, d_chunks=2, num_warps=2), C(block_h=1, num_warps=2)),
    (128, 2): (C(block_h=1, d_chunks=2, num_warps=2), C(block_h=1, num_warps=4, num_stages=3)),
    (256, 1): (C(block_h=1, num_warps=1), C(block_h=1, num_warps=4)),
    (256, 2): (C(block_h=1, d_chunks=2, num_warps=4), C(block_h=1, num_warps=4, num_stages=3)),
    (512, 1): (C(block_h=1, d_chunks=2, num_warps=2, units=4), C(block_h=1, num_warps=2, units=4)),
    (512, 2): (C(block_h=1, d_chunks=2, num_warps=2, units=4), C(block_h=1, num_warps=4, units=4, num_stages=3)),
}
# shape -> name -> (fwd, bwd) config strings (None: the default), for the shapes below target; from
# scripts/check_small_seq_compile.py (no spills, programs per SM, KB in flight, SASS instructions per KB of
# the unit loop). ``i``: items stacked a unit (kernels_stack: the backward's dK/dV dots reduce over several
# items' query rows instead of one item's group padded to 16 rows; at group 1 dots instead of outer products)
PROPOSED = {  # the candidates still open (the sweep's winners are the defaults of configs.py: NOTES.md, v35, v36)
    "d128-8/2": {  # forward: 82 instr/KB, not issue-bound: more KB in flight; backward: fewer instr/KB
        "f-h1w1": ("h1 c1 u8 w1 s5", None), "f-i4w2": ("h1 c1 u8 w2 s5 i4", None),
        "b-w1": (None, "h1 c1 u8 w1 s5"), "b-i4w4": (None, "h1 c1 u8 w4 s5 i4"),
        "b-i4c2": (None, "h1 c2 u8 w4 s5 i4")},
}
FWD_TARGET, FWDBWD_TARGET = 0.85, 0.60
GPU_REPS = 10  # calls per GPU-only / host timing (`gpu_ms`, `host_us`)


def do_bench(fn, rep_ms: float) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


SLEEP_CYCLES = 4_000_000  # ~2.3 ms at 1.75 GHz: longer than an f+b call's host time (0.3-1 ms on the hosts)


def gpu_ms(fn, reps: int) -> float:
    """Median GPU time of ``fn`` without its host time: the L2 flushed as do_bench does, then a sleep kernel
    ahead of the start event, so that the host has queued fn's launches before the GPU reaches them (do_bench's
    time includes any host time of fn beyond the flush's ~0.1 ms)."""
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    events = []
    for _ in range(reps):
        driver.clear_cache(cache)
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def host_us(fn, reps: int) -> float:
    """Host time of one call of ``fn`` (the launches queued, the GPU not waited for)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / reps * 1e6


def copy_TBps(rep_ms: float) -> float:
    x = torch.empty(1024**3, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), rep_ms)
    return 2 * 2 * 1024**3 / (ms * 1e-3) / 1e12  # (the caller empties the cache)


def variants(w: SmallSeqWorkload, extra: dict) -> dict:
    """name -> (fwd config, bwd config) for shape ``w``."""
    group = w.heads // w.kv_heads
    f0, b0 = configs.lookup("fwd", w.head_dim, group), configs.lookup("bwd", w.head_dim, group)
    out = {"default": (f0, b0), "alt": ALT[w.head_dim, 1 if group == 1 else 2],
           "s3": (replace(f0, num_stages=3), replace(b0, num_stages=3)),
           "u2": (replace(f0, units=2), replace(b0, units=2)), "u24": (replace(f0, units=24), replace(b0, units=24))}
    for name, (f, b) in PROPOSED.get(w.name, {}).items():
        out[name] = (C.parse(f) if f else f0, C.parse(b) if b else b0)
    out.update(extra)
    unique = {}
    for name, pair in out.items():  # a variant equal to an earlier one (block_h capped by the kv heads) once
        key = tuple(effective(c, w.kv_heads) for c in pair)
        if key not in unique.values():
            unique[name] = key
    return {name: out[name] for name in unique}


def effective(c: configs.SmallSeqConfig, heads_kv: int) -> configs.SmallSeqConfig:
    """``c`` as it launches with ``heads_kv`` kv heads (block_h capped)."""
    return replace(c, block_h=configs.block_h(c, heads_kv))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_shape(w: SmallSeqWorkload, named: dict, rounds: int, rep_ms: float, copy: float) -> list[dict]:
    fn, (q, k, v) = make_impl(w, "packattn:small_seq", "cuda")
    dout = torch.randn_like(q)

    def fwd():
        return fn(q, k, v)

    def fwdbwd():
        return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    rows, live, first = [], {}, None
    for name, (f, b) in named.items():
        t0 = time.perf_counter()
        row = {"shape": w.name, "variant": name, "fwd_config": effective(f, w.kv_heads).describe(),
               "bwd_config": effective(b, w.kv_heads).describe()}
        try:
            with configs.override(fwd=f, bwd=b):
                results = (fwd(), *fwdbwd())
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a variant that cannot launch is a row, not a crash
            print(f"{w.name} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        first = first or results
        row.update(compile_s=round(time.perf_counter() - t0, 2), fwd_ms=[], fb_ms=[], gfwd_ms=[], gfb_ms=[],
                   host_fwd_us=[], host_fb_us=[],
                   rel_l2_vs_first=max(rel_l2(x, y) for x, y in zip(results, first)))
        rows.append(row)
        live[name] = (f, b)
    for _ in range(rounds):
        for row, (f, b) in zip(rows, live.values()):
            with configs.override(fwd=f, bwd=b):
                row["fwd_ms"].append(do_bench(fwd, rep_ms))
                row["fb_ms"].append(do_bench(fwdbwd, rep_ms))
                row["gfwd_ms"].append(gpu_ms(fwd, GPU_REPS))
                row["gfb_ms"].append(gpu_ms(fwdbwd, GPU_REPS))
                row["host_fwd_us"].append(host_us(fwd, GPU_REPS))
                row["host_fb_us"].append(host_us(fwdbwd, GPU_REPS))
    for row in rows:
        for key in ("gfwd_ms", "gfb_ms", "host_fwd_us", "host_fb_us"):
            row[key] = round(statistics.median(row[key]), 4 if key.endswith("ms") else 1)
        row.update(gfwd_pct=round(100 * w.bytes_fwd() / (row["gfwd_ms"] * 1e-3) / 1e12 / copy, 1),
                   gfb_pct=round(100 * w.bytes_fwdbwd() / (row["gfb_ms"] * 1e-3) / 1e12 / copy, 1),
                   gbwd_ms=round(row["gfb_ms"] - row["gfwd_ms"], 4))
        fwd_ms, fb_ms = statistics.median(row["fwd_ms"]), statistics.median(row["fb_ms"])
        fwd_tb, fb_tb = w.bytes_fwd() / (fwd_ms * 1e-3) / 1e12, w.bytes_fwdbwd() / (fb_ms * 1e-3) / 1e12
        row.update(fwd_ms=round(fwd_ms, 4), fb_ms=round(fb_ms, 4), bwd_ms=round(fb_ms - fwd_ms, 4),
                   fwd_TBps=round(fwd_tb, 3), fb_TBps=round(fb_tb, 3), fwd_pct=round(100 * fwd_tb / copy, 1),
                   fb_pct=round(100 * fb_tb / copy, 1))
    return rows  # (inputs freed on return; the caller empties the cache)


def table(rows: list[dict]) -> str:
    lines = [(f"{'shape':14} {'variant':8} {'fwd cfg':22} {'bwd cfg':22} {'fwd ms':>7} {'fwd%':>6} "
              f"{'f+b ms':>7} {'f+b%':>6} {'bwd ms':>7} {'relL2':>8} | {'gfwd%':>6} {'gf+b%':>6} {'gbwd ms':>7} "
              f"{'host f/fb us':>13}")]
    for r in rows:
        lines.append(f"{r['shape']:14} {r['variant']:8} {r['fwd_config']:22} {r['bwd_config']:22} {r['fwd_ms']:7.3f} "
                     f"{r['fwd_pct']:6.1f} {r['fb_ms']:7.3f} {r['fb_pct']:6.1f} {r['bwd_ms']:7.3f} "
                     f"{r['rel_l2_vs_first']:8.1e} | {r['gfwd_pct']:6.1f} {r['gfb_pct']:6.1f} {r['gbwd_ms']:7.3f} "
                     f"{r['host_fwd_us']:6.0f}/{r['host_fb_us']:<6.0f}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> tuple[str, dict]:
    """Per shape: the default's and the best variants' percentages against the targets."""
    lines = [(f"{'shape':14} {'default fwd% / f+b%':>20} {'best fwd (variant)':>22} {'best f+b (variant)':>22} "
              f"{'best bwd (variant)':>22}  targets {FWD_TARGET:.0%} / {FWDBWD_TARGET:.0%} | GPU only: "
              f"{'best gfwd% (variant)':>20} {'best gbwd (variant)':>20}")]
    best = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        d = mine[0]
        bf = max(mine, key=lambda r: r["fwd_pct"])
        bb = max(mine, key=lambda r: r["fb_pct"])
        bw = min(mine, key=lambda r: r["bwd_ms"])
        gf = max(mine, key=lambda r: r["gfwd_pct"])
        gb = min(mine, key=lambda r: r["gbwd_ms"])
        ok = bf["fwd_pct"] >= 100 * FWD_TARGET and bb["fb_pct"] >= 100 * FWDBWD_TARGET
        best[shape] = {"fwd": bf["variant"], "fb": bb["variant"], "bwd": bw["variant"], "meets_targets": ok,
                       "gpu_fwd": gf["variant"], "gpu_bwd": gb["variant"]}
        lines.append(f"{shape:14} {d['fwd_pct']:9.1f} / {d['fb_pct']:5.1f}   {bf['fwd_pct']:6.1f} ({bf['variant']:>6})   "
                     f"   {bb['fb_pct']:6.1f} ({bb['variant']:>6})     {bw['bwd_ms']:6.3f}ms ({bw['variant']:>6})  "
                     f"{'PASS' if ok else 'miss'} | {gf['gfwd_pct']:10.1f} ({gf['variant']:>6})  "
                     f"{gb['gbwd_ms']:8.3f}ms ({gb['variant']:>6})")
    return "\n".join(lines), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--only", nargs="+", help="variant names to run (default: all)")
    parser.add_argument("--proposed", action="store_true", help="default, PROPOSED and --variant ones only")
    parser.add_argument("--variant", action="append", default=[], help='"name=FWD CONFIG|BWD CONFIG"')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=float, default=30.0, help="do_bench rep per timing")
    args = parser.parse_args()
    extra = {}
    for spec in args.variant:
        name, _, cfgs = spec.partition("=")
        fwd, _, bwd = cfgs.partition("|")
        extra[name] = (C.parse(fwd), C.parse(bwd or fwd))
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    copy_before = copy_TBps(args.rep_ms)
    torch.cuda.empty_cache()
    print(f"{props.name} ({props.multi_processor_count} SMs) torch {torch.__version__} triton {triton.__version__}: "
          f"copy {copy_before:.3f} TB/s", flush=True)
    rows = []
    for shape in args.shapes:
        w = SHAPES[shape]
        named = variants(w, extra)
        keep = set(args.only or named) | {"default"}
        if args.proposed:
            keep = (set(args.only or []) | set(PROPOSED.get(shape, {})) | set(extra) | {"default"}) & set(named)
        named = {n: c for n, c in named.items() if n in keep}
        rows += run_shape(w, named, args.rounds, args.rep_ms, copy_before)
        torch.cuda.empty_cache()
        print(f"{shape}: done at {time.perf_counter() - start:.0f} s (compile+check "
              f"{sum(r['compile_s'] for r in rows if r['shape'] == shape):.0f} s)", flush=True)
    copy_after = copy_TBps(args.rep_ms)
    text, best = summary(rows)
    print(f"\ncopy {copy_before:.3f} TB/s before, {copy_after:.3f} after; percentages of the first; "
          f"wall {time.perf_counter() - start:.0f} s\n{table(rows)}\n\n{text}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
                       "copy_TBps": [round(copy_before, 3), round(copy_after, 3)], "rows": rows, "best": best,
                       "tables": {"FWD": {str(k): v.describe() for k, v in configs.FWD.items()},
                                  "BWD": {str(k): v.describe() for k, v in configs.BWD.items()}}}, f, indent=1)


if __name__ == "__main__":
    main()
