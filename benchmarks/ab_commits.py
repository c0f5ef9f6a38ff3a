"""A/B of two source trees of packattn on one GPU: old commit against new, interleaved, in rounds, medians.

    python benchmarks/ab_commits.py --old /tmp/old --new . --rounds 3 --out $OUT/ab [--host-probe]
    python benchmarks/ab_commits.py --old /tmp/old --new . --dry-run --out /tmp/ab    (CPU: checks the plumbing)

Each round runs, for each tree (old first in odd rounds, new first in even ones), one subprocess with
``PYTHONPATH=<tree>`` and ``TRITON_CACHE_DIR=<cache root>/<old|new>`` that times every workload through the
public API only (``packattn.attention(q, k, v, descriptor, backend="auto", **mask options)`` with the
descriptor of `packattn.bench.workloads` / `packattn.bench.small_seq`), so the same code runs unchanged
against either tree. Per workload it times the forward (inputs requiring grad, as `packattn bench` does) and
forward+backward (``torch.autograd.grad``): CUDA events around each call, after ``--warmup-ms`` of the same
calls, no L2 flush, median of ``--reps`` calls. A workload that a tree cannot run is a row with its error.

``--host-probe``: host work per call, per tree, forward and forward+backward, on W8's packing (64 x 512) and on
8 x 512, both with 2 heads so that the GPU work per call stays far below the host's: CPU time of ``--host-calls``
calls back to back (the backward on the calling thread; least of 5 loops), and, counted, the Python calls and GPU
kernels per call.

Afterwards the PTX of every kernel each tree compiled (its Triton cache) is compared: normalised (no
``.loc`` / ``.file`` / debug sections / comments / debug labels, the kernel's name mapped from old to new
with ``--rename OLD=NEW``), kernels matched by name, each name reported ``same`` (the same set of
normalised PTX texts in both trees) or ``DIFF`` (unified diffs under ``<out>_ptx_diffs/``).

Output: ``<out>.txt`` (the tables) and ``<out>.json`` (every sample), the tables printed last.
``--dry-run``: tiny workloads on CPU with backend ``reference`` and wall-clock timing (no GPU, no PTX).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

WORKLOADS = ("W1", "W2", "W4", "W5", "W6", "W8", "W9")
# Kernels renamed between the trees compared here (old name -> new name); --rename adds to it.
RENAMES: dict[str, str] = {}


# ----------------------------------------------------------------------------------------------- worker
def _workload(name: str, tiny: bool):
    """``(descriptor, q, k, v, mask options, signature)`` for ``name``, built with this tree's packattn.bench."""
    import torch

    from packattn.bench import workloads as wl

    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    if name.startswith("W9"):
        return _small_seq_inputs(name, tiny, device, dtype)
    if tiny:
        table = {
            "W1": wl.Workload("W1", [100, 37, 120], heads_q=2, heads_kv=2, head_dim=32, options={"causal": True}),
            "W2": wl.Workload("W2", [100, 37, 120], heads_q=4, heads_kv=2, head_dim=32, options={"causal": True}),
            "W4": wl.Workload("W4", [256], heads_q=2, heads_kv=2, head_dim=32,
                              options={"causal": True, "chunk_size": 64}),
            "W5": wl.Workload("W5", [100, 37, 120], heads_q=2, heads_kv=2, head_dim=32,
                              options={"causal": True, "window": (32, 0)}),
            "W8": wl.Workload("W8", [64] * 4, heads_q=2, heads_kv=2, head_dim=32, options={"causal": True}),
            "W8small": wl.Workload("W8small", [64] * 2, heads_q=2, heads_kv=2, head_dim=32,
                                   options={"causal": True}),
            "W8h2": wl.Workload("W8h2", [64] * 4, heads_q=2, heads_kv=2, head_dim=32, options={"causal": True}),
        }
        sequences = wl.grpo_sequences(2, 32, 2, 16)
        table["W6"] = wl.TreeWorkload("W6", [len(s) for s in sequences], heads_q=2, heads_kv=2, head_dim=32,
                                      options={"causal": True}, sequences=sequences)
    else:
        table = {**wl.varlen_workloads(), **wl.tree_workloads()}
        # host probes: W8's and an 8 x 512 packing with 2 heads, so that the GPU work per call is a few tens of us
        table["W8h2"] = wl.Workload("W8h2", table["W8"].lengths_q, heads_q=2, heads_kv=2, options={"causal": True})
        table["W8small"] = wl.Workload("W8small", [512] * 8, heads_q=2, heads_kv=2, options={"causal": True})
    w = table[name]
    desc, q, k, v = w.make_inputs(device, dtype, seed=0)
    signature = [type(desc).__name__, list(q.shape), list(k.shape), sorted(w.options.items()),
                 hashlib.sha1(repr(list(w.lengths_q)).encode()).hexdigest()[:12]]
    return desc, q, k, v, dict(w.options), signature


def _small_seq_inputs(name: str, tiny: bool, device, dtype):
    """W9 (W9 = W9d128): one query per item over 2..16 keys, packed (`Varlen` of q lengths 1)."""
    import torch

    from packattn.bench import small_seq
    from packattn.varlen import Varlen

    w = small_seq.small_seq_workloads()["W9d128" if name == "W9" else name]
    items, heads, dim = (64, 2, 32) if tiny else (w.items, w.heads, w.head_dim)
    lengths = w.lengths()[:items].tolist()
    seqs = Varlen.from_lengths([1] * items, lengths, device=device)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(rows):
        return torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen).requires_grad_()

    q, k, v = rand(items), rand(seqs.total_kv), rand(seqs.total_kv)
    signature = ["Varlen", list(q.shape), list(k.shape), [], hashlib.sha1(repr(lengths).encode()).hexdigest()[:12]]
    return seqs, q, k, v, {}, signature


def _timer(cuda: bool):
    """``time_calls(fn, warmup_ms, reps) -> median ms``: CUDA events around each call on a GPU (after a
    warm-up of ``warmup_ms`` of the same calls, no L2 flush), wall time per call on CPU."""
    import torch

    def time_calls(fn, warmup_ms: float, reps: int) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        end_warmup = time.perf_counter() + warmup_ms / 1e3
        while time.perf_counter() < end_warmup:
            fn()
            if cuda:
                torch.cuda.synchronize()
        if not cuda:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    return time_calls


def _host_us(fn, calls: int, cuda: bool) -> float:
    """Host CPU time (us) of one call: ``calls`` calls back to back with no synchronisation between them, on a
    batch whose GPU work per call is far below its host work, timed with this thread's CPU clock and the backward
    run on this thread (so neither waiting nor other processes count); the least of 5 such loops."""
    import torch

    best = float("inf")
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            start = time.thread_time()
            for _ in range(calls):
                fn()
            best = min(best, (time.thread_time() - start) * 1e6 / calls)
            if cuda:
                torch.cuda.synchronize()
    return best


def _host_work(fn, cuda: bool, calls: int = 10) -> dict:
    """What one call does on the host, counted rather than timed (the host's timings are noisy): Python function
    calls (cProfile, the backward run on this thread) and GPU kernel launches (torch.profiler) per call."""
    import cProfile
    import pstats

    import torch

    with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread: cProfile sees it
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
    work = {"python_calls": pstats.Stats(profile).total_calls / calls}
    if cuda:
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        work["kernels"] = len(kernels) / calls
        work["kernel_names"] = sorted({e.name for e in kernels})
    return work


def _kernel_us(fn, calls: int = 10) -> float:
    """GPU time (us) of one call as the sum of its kernels' durations (torch.profiler): free of the host's noise,
    so a row whose wall time moved can be told apart from one whose kernels did."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / calls


def _calls(name: str, tiny: bool, backend: str):
    """``(forward, forward+backward, signature)`` closures for workload ``name``."""
    import torch

    import packattn

    desc, q, k, v, options, signature = _workload(name, tiny)
    dout = torch.randn_like(q)

    def forward():
        return packattn.attention(q, k, v, desc, backend=backend, **options)

    def forward_backward():
        torch.autograd.grad(forward(), (q, k, v), dout)

    return forward, forward_backward, signature


def worker(spec: dict) -> dict:
    """Run in a subprocess with PYTHONPATH set to one tree: time every workload of ``spec``."""
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 2:
        os.sched_setaffinity(0, {2, 3})  # the same two cores in both trees (host probe)
    import torch

    import packattn

    tree = os.path.realpath(spec["tree"])
    where = os.path.realpath(packattn.__file__)
    if where != os.path.join(tree, "packattn", "__init__.py"):
        raise SystemExit(f"packattn imported from {where}, not from {tree}: check PYTHONPATH")
    tiny, backend = spec["tiny"], spec["backend"]
    cuda = not tiny
    time_calls = _timer(cuda)
    result = {"packattn": where, "torch": torch.__version__, "rows": {}, "host": {}}
    if cuda:
        result["device"] = torch.cuda.get_device_name()
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    for name in spec["workloads"]:
        row = result["rows"][name] = {}
        try:
            forward, forward_backward, row["signature"] = _calls(name, tiny, backend)
            row["fwd_ms"] = time_calls(forward, spec["warmup_ms"], spec["reps"])
            row["fb_ms"] = time_calls(forward_backward, spec["warmup_ms"], spec["reps"])
            if cuda and spec.get("kernel_time"):
                row["fwd_kernel_us"], row["fb_kernel_us"] = _kernel_us(forward), _kernel_us(forward_backward)
        except Exception as e:  # noqa: BLE001 - a workload this tree cannot run is a row, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        if cuda:
            torch.cuda.empty_cache()
    for name in spec["host_probe"]:
        try:
            forward, forward_backward, _ = _calls(name, tiny, backend)
            for _ in range(20):
                forward_backward()
            result["host"][name] = {"fwd_us": _host_us(forward, spec["host_calls"], cuda),
                                    "fb_us": _host_us(forward_backward, spec["host_calls"], cuda),
                                    "fwd_work": _host_work(forward, cuda), "fb_work": _host_work(forward_backward, cuda)}
        except Exception as e:  # noqa: BLE001
            result["host"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return result


# ------------------------------------------------------------------------------------------------- PTX
_DROP = re.compile(r"^\s*(\.loc\b|\.file\b|//|\$L__tmp\d+:|\$L__func_(begin|end)\d+:|@@DWARF)")


def normalise_ptx(text: str, renames: dict[str, str]) -> str:
    """PTX without debug info and comments, with old kernel names replaced by new ones."""
    out, depth = [], 0
    for line in text.splitlines():
        stripped = line.strip()
        if depth == 0 and stripped.startswith(".section") and ".debug" in stripped:
            depth = 1 if "{" in stripped else -1  # -1: the brace is on the next line
            continue
        if depth:
            if depth < 0 and stripped.startswith("{"):
                depth = 1
            elif stripped.startswith("}"):
                depth = 0
            continue
        if not stripped or _DROP.match(line):
            continue
        out.append(re.sub(r"\s*//.*$", "", line.rstrip()))
    text = "\n".join(out) + "\n"
    for old, new in renames.items():
        text = re.sub(rf"\b{re.escape(old)}(?=\b|_param_)", new, text)
    return text


def collect_ptx(cache: Path, renames: dict[str, str]) -> dict[str, list[str]]:
    """``{kernel name (after renames): [normalised PTX of each compiled specialisation]}``."""
    kernels: dict[str, list[str]] = defaultdict(list)
    for path in sorted(cache.rglob("*.ptx")):
        name = renames.get(path.stem, path.stem)
        kernels[name].append(normalise_ptx(path.read_text(errors="replace"), renames))
    return kernels


def compare_ptx(old_cache: Path, new_cache: Path, renames: dict[str, str], diff_dir: Path | None) -> list[dict]:
    """One row per kernel name: compiled counts in each tree and ``same`` / ``DIFF`` / ``old only`` / ``new only``."""
    old, new = collect_ptx(old_cache, renames), collect_ptx(new_cache, {})
    rows = []
    for name in sorted(set(old) | set(new)):
        a, b = sorted(old.get(name, [])), sorted(new.get(name, []))
        digest = lambda texts: sorted(hashlib.sha1(t.encode()).hexdigest() for t in texts)  # noqa: E731
        if not a or not b:
            status = "old only" if a else "new only"
        else:
            status = "same" if digest(a) == digest(b) else "DIFF"
        rows.append({"kernel": name, "old": len(a), "new": len(b), "status": status})
        if status == "DIFF" and diff_dir is not None:
            diff_dir.mkdir(parents=True, exist_ok=True)
            unmatched_a = [t for t in a if t not in b] or a
            unmatched_b = [t for t in b if t not in a] or b
            lines = []
            for x, y in zip(unmatched_a, unmatched_b):
                lines.extend(difflib.unified_diff(x.splitlines(), y.splitlines(), "old", "new", lineterm="", n=2))
            (diff_dir / f"{name}.diff").write_text("\n".join(lines[:4000]) + "\n")
    return rows


# ------------------------------------------------------------------------------------------------ driver
def run_tree(label: str, tree: str, spec: dict, cache: Path, timeout: float) -> dict:
    """One worker subprocess on ``tree``; its result, or ``{"error": ...}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TRITON_CACHE_DIR"] = str(cache / label)
    if spec["tiny"]:
        env.pop("TRITON_INTERPRET", None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(spec, tree=tree), f)
        spec_path = f.name
    result_path = spec_path + ".out"
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", spec_path, result_path],
                              env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(result_path):
            return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
        with open(result_path) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        for path in (spec_path, result_path):
            if os.path.exists(path):
                os.unlink(path)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(old: float | None, new: float | None) -> str:
    if old is None or new is None or old == 0:
        return "-"
    r = new / old
    return f"{r:.3f}" + (" *" if abs(r - 1) > 0.02 else "")


def summarise(samples: dict, workloads: list[str], host_names: list[str], ptx: list[dict]) -> str:
    """The text report: timing table (medians over rounds), host table, PTX table, errors."""
    lines = ["workload | old fwd ms | new fwd ms | ratio | old f+b ms | new f+b ms | ratio",
             "---|---|---|---|---|---|---"]
    errors, signatures = [], defaultdict(set)
    for name in workloads:
        med = {}
        for label in ("old", "new"):
            rows = [r["rows"].get(name, {}) for r in samples[label] if "rows" in r]
            for key in ("fwd_ms", "fb_ms"):
                med[label, key] = _median([row[key] for row in rows if key in row])
            errors += [f"{label} {name}: {row['error']}" for row in rows if "error" in row]
            signatures[name] |= {json.dumps(row["signature"]) for row in rows if "signature" in row}
        lines.append(f"{name} | {_fmt(med['old', 'fwd_ms'])} | {_fmt(med['new', 'fwd_ms'])} | "
                     f"{_ratio(med['old', 'fwd_ms'], med['new', 'fwd_ms'])} | {_fmt(med['old', 'fb_ms'])} | "
                     f"{_fmt(med['new', 'fb_ms'])} | {_ratio(med['old', 'fb_ms'], med['new', 'fb_ms'])}")
    lines.append("(medians over the rounds; ratio = new / old, * where it moves more than 2%)")
    kernel_rows = []
    for name in workloads:
        med = {(label, key): _median([r["rows"].get(name, {}).get(key) for r in samples[label]
                                      if r.get("rows", {}).get(name, {}).get(key) is not None])
               for label in ("old", "new") for key in ("fwd_kernel_us", "fb_kernel_us")}
        if med["old", "fwd_kernel_us"] is not None and med["new", "fwd_kernel_us"] is not None:
            kernel_rows.append(
                f"{name} | {_fmt(med['old', 'fwd_kernel_us'], 1)} | {_fmt(med['new', 'fwd_kernel_us'], 1)} | "
                f"{_ratio(med['old', 'fwd_kernel_us'], med['new', 'fwd_kernel_us'])} | "
                f"{_fmt(med['old', 'fb_kernel_us'], 1)} | {_fmt(med['new', 'fb_kernel_us'], 1)} | "
                f"{_ratio(med['old', 'fb_kernel_us'], med['new', 'fb_kernel_us'])}")
    if kernel_rows:
        lines += ["", "kernel us per call (summed durations) | old fwd | new fwd | ratio | old f+b | new f+b | ratio",
                  "---|---|---|---|---|---|---", *kernel_rows]
    if host_names:
        lines += ["", "host CPU us per call | old fwd | new fwd | ratio | old f+b | new f+b | ratio", "---|---|---|---|---|---|---"]
        for name in host_names:
            med = {}
            for label in ("old", "new"):
                rows = [r["host"].get(name, {}) for r in samples[label] if "host" in r]
                for key in ("fwd_us", "fb_us"):
                    med[label, key] = _median([row[key] for row in rows if key in row])
                errors += [f"{label} host {name}: {row['error']}" for row in rows if "error" in row]
            lines.append(f"{name} | {_fmt(med['old', 'fwd_us'], 1)} | {_fmt(med['new', 'fwd_us'], 1)} | "
                         f"{_ratio(med['old', 'fwd_us'], med['new', 'fwd_us'])} | {_fmt(med['old', 'fb_us'], 1)} | "
                         f"{_fmt(med['new', 'fb_us'], 1)} | {_ratio(med['old', 'fb_us'], med['new', 'fb_us'])}")
    if host_names:
        lines += ["", "host work per call (counted) | old fwd | new fwd | old f+b | new f+b",
                  "---|---|---|---|---"]
        for name in host_names:
            work = {label: next((r["host"][name] for r in samples[label] if "fwd_work" in r["host"].get(name, {})),
                                None) for label in ("old", "new")}
            if None in work.values():
                continue
            for key, what in (("python_calls", "Python calls"), ("kernels", "GPU kernels")):
                cells = [work[label][part].get(key) for part in ("fwd_work", "fb_work") for label in ("old", "new")]
                lines.append(f"{name} {what} | " + " | ".join("-" if c is None else f"{c:g}" for c in cells))
            for part in ("fwd_work", "fb_work"):
                old_k, new_k = (set(work[label][part].get("kernel_names", [])) for label in ("old", "new"))
                if old_k != new_k:
                    lines.append(f"{name} {part} kernels only old: {sorted(old_k - new_k)}; only new: "
                                 f"{sorted(new_k - old_k)}")
    lines += ["", "kernel | old PTX | new PTX | status", "---|---|---|---"]
    lines += [f"{r['kernel']} | {r['old']} | {r['new']} | {r['status']}" for r in ptx] or ["(no compiled kernels)"]
    lines.append(f"PTX: {sum(r['status'] == 'same' for r in ptx)} same, {sum(r['status'] == 'DIFF' for r in ptx)} DIFF, "
                 f"{sum(r['status'].endswith('only') for r in ptx)} in one tree only")
    mismatched = [name for name, sigs in signatures.items() if len(sigs) > 1]
    if mismatched:
        lines.append(f"WARNING: the trees built different inputs for {', '.join(mismatched)}")
    for label in ("old", "new"):
        errors += [f"{label} round {i + 1}: {r['error']}" for i, r in enumerate(samples[label]) if "error" in r]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in dict.fromkeys(errors)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        with open(argv[1]) as f:
            result = worker(json.load(f))
        with open(argv[2], "w") as f:
            json.dump(result, f)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="root of the old source tree (holds packattn/)")
    parser.add_argument("--new", required=True, help="root of the new source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True, help="output prefix: writes OUT.txt and OUT.json")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--backend", default=None, help='default "auto" ("reference" with --dry-run)')
    parser.add_argument("--host-probe", action="store_true", help="also host us per call on W8 and W8small")
    parser.add_argument("--host-calls", type=int, default=200)
    parser.add_argument("--kernel-time", action="store_true",
                        help="also each workload's summed kernel durations per call (torch.profiler)")
    parser.add_argument("--warmup-ms", type=float, default=250.0)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of idle GPU before each subprocess")
    parser.add_argument("--timeout", type=float, default=580.0, help="seconds per subprocess")
    parser.add_argument("--cache-root", default=None, help="parent of the old/ and new/ Triton caches "
                        "(default: a fresh temporary folder; reuse one to skip the compiles)")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="kernel renamed old -> new")
    parser.add_argument("--dry-run", action="store_true", help="tiny workloads on CPU, backend reference")
    args = parser.parse_args(argv)

    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for label, tree in trees.items():
        if not os.path.isdir(os.path.join(tree, "packattn")):
            parser.error(f"--{label} {tree} has no packattn/ folder")
    cache = Path(args.cache_root or tempfile.mkdtemp(prefix="ab_commits_cache_"))
    renames = dict(RENAMES, **dict(r.split("=", 1) for r in args.rename))
    host_names = ["W8h2", "W8small"] if args.host_probe else []
    spec = {"workloads": args.workloads, "tiny": args.dry_run, "backend": args.backend or
            ("reference" if args.dry_run else "auto"), "warmup_ms": 5.0 if args.dry_run else args.warmup_ms,
            "reps": 3 if args.dry_run else args.reps, "host_probe": host_names,
            "host_calls": 5 if args.dry_run else args.host_calls, "kernel_time": args.kernel_time}
    samples: dict[str, list[dict]] = {"old": [], "new": []}
    for round_index in range(args.rounds):
        for label in (("old", "new") if round_index % 2 == 0 else ("new", "old")):
            time.sleep(args.pause)
            started = time.perf_counter()
            result = run_tree(label, trees[label], spec, cache, args.timeout)
            samples[label].append(result)
            status = result.get("error", "ok")[:200]
            print(f"round {round_index + 1} {label}: {time.perf_counter() - started:.1f} s, {status}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ptx = compare_ptx(cache / "old", cache / "new", renames, out.parent / f"{out.name}_ptx_diffs")
    first = next((r for r in samples["new"] + samples["old"] if "rows" in r), {})
    header = (f"# ab_commits: old {trees['old']} vs new {trees['new']}, {args.rounds} rounds, backend {spec['backend']}, "
              f"{first.get('device', 'cpu (dry run)')}, torch {first.get('torch', '?')}, "
              f"triton {first.get('triton', '?')}, {time.strftime('%Y-%m-%d %H:%M')}")
    text = header + "\n\n" + summarise(samples, args.workloads, host_names, ptx) + "\n"
    Path(f"{out}.txt").write_text(text)
    Path(f"{out}.json").write_text(json.dumps({"trees": trees, "spec": spec, "samples": samples, "ptx": ptx,
                                               "renames": renames}, indent=1))
    if not args.cache_root:
        shutil.rmtree(cache, ignore_errors=True)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
