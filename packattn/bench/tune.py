"""`packattn tune --out FILE`: measure the backends on a grid of shapes on this GPU and write the cost table
that ``backend="auto"`` ranks them by (`packattn.costs`; the packaged one is ``packattn/data/costs_<arch>.json``).

The grid (`tune_grid`, in priority order, so that a run cut short by its budget keeps the most useful rows):
head dims 64, 96, 128, 192, 256 and MLA 192/128, 128/64; GQA groups 4 and 1 (8 at d = 64 and 128, causal);
the ``long`` regime (W1's lengths ``doc_lengths(32768, 0)``, 16384 tokens from d = 192 up), the ``short`` one
(64 x 512 tokens, and under causal / no masks 102 x 320 too: three or four tiles, the row the sum of both), the
``mid`` one (128 x 256 tokens) and the ``tiny`` one (256 x 128 tokens): each regime of `costs.regime` on documents
as long as it allows; masks causal and none, and a window at d = 64 and 128. 156 shapes (about four and a half
minutes on an H100, compiles included).
Each shape is timed forward (under ``torch.no_grad()``: what an inference call dispatches as) and forward +
backward, bf16, on each backend of ``--backends`` that accepts it (`dispatch.reasons` for that backend; one
that refuses is recorded with its reason) through `packattn.attention` with that backend named: what auto
would run. Timing is the bench's helper (`runner.time_fwd_fwdbwd`: triton.testing.do_bench medians, the L2
cache flushed before each call, so consecutive calls do not reuse each other's inputs).

The whole run fits a budget (``--budget`` seconds, compiles included). Compiling is most of the cost on a
fresh machine (each head dim, mask and length class compiles its Triton / Gluon kernels, FA4 JITs its own),
so ``--workers`` processes first run every (backend, shape) once, in parallel, to fill the compilers' disk
caches (Triton's, and FA4's when ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``); they are stopped before any
timing starts. The file is rewritten after every shape (``complete: false`` until the grid is done), so a run
stopped by the budget leaves a valid table, and ``--resume`` times only the shapes the file lacks.

Backends timed by default: fa4, triton, torch_varlen. Not by default: flex (torch.compile of FlexAttention
per head dim and mask, tens of seconds each, beyond the budget; it measured slower than the triton backend on
every bench workload), sdpa (one SDPA call per sequence), reference (the unfused spec), small_seq and
triton_tree (they take no call of this grid). A backend the table did not measure is never auto's pick where
a row covers the call (`costs.decide`).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import queue
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import packattn
from packattn import backends, costs, dispatch, env
from packattn.bench.runner import time_fwd_fwdbwd
from packattn.bench.workloads import Workload, doc_lengths
from packattn.mask import Mask
from packattn.ops.runtime import support

DEFAULT_BACKENDS = ("fa4", "triton", "torch_varlen")
DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64))
TIMING = {"warmup": 25, "rep": 50}  # ms per do_bench: short, for the budget; `--check` measures longer
# the shapes of each length regime above small (`make_shape`): long, short, mid, tiny (documents of their bound),
# and short's three-tile end too: at 257-512 tokens the backends' tile waste differs (at d = 64 MHA with gradients
# FA4 ties the triton backend at 512 tokens and runs 12% slower at 300; NOTES.md v40)
REGIME_SHAPES = ("long", "s512", "s320", "s256", "s128")


@dataclass(frozen=True)
class Shape:
    """One measured call: bf16 THD, ``lengths`` per sequence (queries = keys), mask ``options``."""

    name: str
    head_dim: int
    head_dim_v: int
    heads_q: int
    heads_kv: int
    lengths: tuple
    label: str  # how the lengths were made, for the table
    options: tuple = ()  # attention() mask options, as (name, value) pairs

    @property
    def mask(self) -> Mask:
        return Mask.make(**dict(self.options))

    def key(self, grad: bool) -> costs.Key:
        longest = max(self.lengths)
        return costs.Key(self.head_dim, self.head_dim_v, self.heads_q // self.heads_kv,
                         costs.regime(longest, longest), costs.mask_kind(self.mask, True), grad)

    def workload(self) -> Workload:
        return Workload(self.name, list(self.lengths), heads_q=self.heads_q, heads_kv=self.heads_kv,
                        head_dim=self.head_dim, options=dict(self.options),
                        head_dim_v=None if self.head_dim_v == self.head_dim else self.head_dim_v)

    def inputs(self, device):
        """``(seqs, q, k, v)``, bf16, requiring gradients."""
        return self.workload().make_inputs(device, torch.bfloat16, seed=0)

    def params(self, seqs, grad: bool) -> dispatch.Params:
        return dispatch.call_params(seqs, device_type=seqs.cu_seqlens_q.device.type, dtype=torch.bfloat16,
                                    heads_q=self.heads_q, heads_kv=self.heads_kv, head_dim=self.head_dim,
                                    head_dim_v=self.head_dim_v, mask=self.mask, requires_grad=grad)


def _dims_name(d: int, dv: int) -> str:
    return f"d{d}" if d == dv else f"d{d}v{dv}"


def make_shape(regime: str, d: int, dv: int, group: int, mask: str, seed: int = 0) -> Shape:
    """A grid shape: ``regime`` is ``long`` (``doc_lengths(32768 or 16384 from d = 192, seed)``) or ``s<L>``
    (documents of L tokens, ~32768 in all); heads 32 q for short documents and d = 64, else 16; ``mask`` one of
    causal, none, window (1024 keys back on long documents, 128 on short ones)."""
    if regime == "long":
        total = 16384 if max(d, dv) >= 192 else 32768
        lengths, label = tuple(doc_lengths(total, seed)), f"doc_lengths({total}, {seed})"
        heads_q = 32 if d == 64 else 16
    else:
        each = int(regime[1:])
        lengths, label, heads_q = (each,) * (32768 // each), f"{32768 // each}x{each}", 32
    options = {"causal": (("causal", True),), "none": (),
               "window": (("causal", True), ("window", (1024 if regime == "long" else 128, 0)))}[mask]
    name = f"{regime} {_dims_name(d, dv)} g{group} {mask}"
    return Shape(name, d, dv, heads_q, heads_q // group, lengths, label, options)


def tune_grid() -> list[Shape]:
    """The shapes of `packattn tune`, most useful first (the issue's head-dim rows, then MHA, no mask, windows,
    group 8)."""
    out = []
    for group, mask in ((4, "causal"), (1, "causal"), (4, "none"), (1, "none")):
        for d, dv in DIMS:
            out += [make_shape(r, d, dv, group, mask) for r in REGIME_SHAPES]
    for d in (128, 64):
        out += [make_shape(r, d, d, 4, "window") for r in ("long", "s512", "s256")]
    for d in (128, 64):
        out += [make_shape(r, d, d, 8, "causal") for r in REGIME_SHAPES]
    return out


# ------------------------------------------------------------------------------------ one shape
def refusal(shape: Shape, name: str, seqs, grad: bool) -> str | None:
    """Why backend ``name`` (or auto) cannot run the shape's call, or None."""
    params = shape.params(seqs, grad)
    if name == "auto":
        return None if any(why is None for _, why in dispatch.reasons(params)) else "no backend can run it"
    return dict(dispatch.reasons(params, name))[name]


def caller(shape: Shape, name: str, seqs):
    options = dict(shape.options)
    return lambda q, k, v: packattn.attention(q, k, v, seqs, backend=name, **options)


def measure(shape: Shape, names, device, timing=None) -> dict:
    """Time ``names`` (backends, or ``auto``) on one shape: ``{"fwd": {name: ms}, "fwdbwd": {...}, "refused":
    {name: why}}``, a failure being a refusal too."""
    timing = timing or TIMING
    seqs, q, k, v = shape.inputs(device)
    out = {"fwd": {}, "fwdbwd": {}, "refused": {}}
    for name in names:
        why_fwd, why_grad = refusal(shape, name, seqs, False), refusal(shape, name, seqs, True)
        if why_fwd is not None:
            out["refused"][name] = why_fwd
            continue
        try:
            fwd, fwdbwd = time_fwd_fwdbwd(caller(shape, name, seqs), q, k, v, forward_grad=False,
                                          backward=why_grad is None, **timing)
        except Exception as e:  # noqa: BLE001 - a backend that fails on the GPU is a refusal, not a crash
            out["refused"][name] = f"failed: {type(e).__name__}: {e}"[:200]
            continue
        out["fwd"][name] = round(fwd, 4)
        if fwdbwd is not None:
            out["fwdbwd"][name] = round(fwdbwd, 4)
        elif why_grad:
            out["refused"][name] = f"with gradients: {why_grad}"
    del seqs, q, k, v
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------ compile first
def _warm(task) -> tuple[str, float, list]:
    """Worker: run each shape of ``task = (backend, label, shapes, device)`` once forward and once with gradients,
    so the compilers' disk caches hold its kernels. Returns (label, seconds, errors)."""
    name, label, shapes, device = task
    start, errors = time.perf_counter(), []
    for shape in shapes:
        try:
            seqs, q, k, v = shape.inputs(device)
            fn = caller(shape, name, seqs)
            if refusal(shape, name, seqs, False) is None:
                with torch.no_grad():
                    fn(q, k, v)
            if refusal(shape, name, seqs, True) is None:
                out = fn(q, k, v)
                torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the timing pass records it
            errors.append(f"{shape.name}: {type(e).__name__}: {str(e)[:120]}")
    return label, time.perf_counter() - start, errors


def warm_tasks(shapes, names, device: str = "cuda") -> list:
    """One task per backend, head dims, mask and regime (the kernels one compile serves), in the order the shapes
    are timed (a compile phase cut short leaves the last ones to compile while timing); torch_varlen, which
    compiles nothing, last."""
    groups: dict = {}
    for shape in shapes:
        key = shape.key(False)
        for name in names:
            label = f"{name} {_dims_name(key.head_dim, key.head_dim_v)} {key.mask} {key.regime}"
            groups.setdefault((name, label), []).append(shape)
    tasks = [(name, label, members, device) for (name, label), members in groups.items()]
    return sorted(tasks, key=lambda t: (t[0] == "torch_varlen", shapes.index(t[2][0])))


def compile_first(shapes, names, workers: int, seconds: float, log, device: str = "cuda") -> int:
    """Run `warm_tasks` in ``workers`` spawned processes for at most ``seconds``, then stop them (a worker still
    compiling would share the GPU with the timing). Returns the number of tasks that finished."""
    if workers <= 0 or seconds <= 0:
        return 0
    if "fa4" in names and env.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        names = [n for n in names if n != "fa4"]
        log("FA4 compiles in the timing process: set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 so the workers' "
            "compiles are reused")
    tasks = warm_tasks(shapes, names, device)
    if not tasks:
        return 0
    workers = min(workers, len(tasks))
    log(f"compiling first: {len(tasks)} tasks in {workers} processes, at most {seconds:.0f} s")
    end = time.perf_counter() + seconds
    pool = multiprocessing.get_context("spawn").Pool(workers)
    done = 0
    try:
        results = pool.imap_unordered(_warm, tasks)
        while done < len(tasks):
            try:
                label, took, errors = results.next(timeout=max(0.0, end - time.perf_counter()))
            except (multiprocessing.TimeoutError, queue.Empty, StopIteration):
                log(f"compile budget spent after {done} of {len(tasks)} tasks: the rest compile while timing")
                break
            done += 1
            log(f"compiled {done}/{len(tasks)} {label} in {took:.0f} s" + (f" ({errors[0]})" if errors else ""))
    finally:
        pool.terminate()
        pool.join()
    return done


# ------------------------------------------------------------------------------------ the table
def rows_from(measurements: list[dict]) -> list[dict]:
    """Table rows: one per key and gradients; a backend's time is its sum over the key's shapes, for the
    backends measured on every one of them."""
    by_key: dict = {}
    for m in measurements:
        for grad, part in ((False, "fwd"), (True, "fwdbwd")):
            key = costs.Key(m["head_dim"], m["head_dim_v"], m["group"], m["regime"], m["mask"], grad)
            by_key.setdefault(key, []).append((m, m[part]))
    rows = []
    for key, parts in by_key.items():
        common = set.intersection(*(set(times) for _, times in parts))
        if not common:
            continue
        ms = {name: round(sum(times[name] for _, times in parts), 4) for name in sorted(common)}
        refused = {name: why for m, _ in parts for name, why in m["refused"].items()}
        rows.append({"head_dim": key.head_dim, "head_dim_v": key.head_dim_v, "group": key.group,
                     "regime": key.regime, "mask": key.mask, "grad": key.grad, "ms": ms,
                     "shapes": [{"lengths": m["lengths"], "heads": m["heads"], "ms": times} for m, times in parts],
                     "refused": refused})
    return rows


def record(shape: Shape, times: dict) -> dict:
    key = shape.key(False)
    return {"shape": shape.name, "head_dim": key.head_dim, "head_dim_v": key.head_dim_v, "group": key.group,
            "regime": key.regime, "mask": key.mask, "lengths": shape.label, "heads": [shape.heads_q, shape.heads_kv],
            "tokens": sum(shape.lengths), **times}


def fa4_version() -> str | None:
    if backends.get("fa4").unavailable():
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "installed (version unknown)"


def device_meta(command: str) -> tuple[str, dict]:
    """``(arch, meta)`` of this process's GPU and packages."""
    import triton

    major, minor = torch.cuda.get_device_capability()
    try:
        # the checkout's commit, "-dirty" when the tree differs from it (a copied tree with an older .git says so)
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude", "*"],
                                capture_output=True, text=True, timeout=10, check=False,
                                cwd=Path(packattn.__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    meta = {"device": torch.cuda.get_device_name(), "capability": [major, minor], "torch": torch.__version__,
            "triton": triton.__version__, "fa4": fa4_version(), "packattn": packattn.__version__, "commit": commit,
            "date": datetime.date.today().isoformat(), "command": command, "dtype": "bfloat16",
            "sm90_kernels": support.sm90_kernels_off() or "on",
            "timing": f"triton.testing.do_bench median, warmup {TIMING['warmup']} ms, rep {TIMING['rep']} ms, L2 "
                      "flushed before each call; forward under torch.no_grad()"}
    return f"sm{major}{minor}", meta


def write_table(path, arch: str, meta: dict, measurements: list[dict], pending: list[str]) -> dict:
    """The table as JSON at ``path`` (written whole, then renamed over the old file); validated first."""
    data = {"schema": costs.SCHEMA, "arch": arch,
            "meta": {**meta, "complete": not pending, "unmeasured": pending},
            "rows": rows_from(measurements), "measurements": measurements}
    costs.validate(data, str(path))
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return data


# ------------------------------------------------------------------------------------ the run
def default_workers() -> int:
    """Compile processes: every core but two (a compile is one busy process), at most 14."""
    return max(1, min(14, (os.cpu_count() or 4) - 2))


def start_clock():
    """``(seconds since the start, log)``: ``log`` prints a line prefixed with that time."""
    start = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - start

    def log(message: str) -> None:
        print(f"[{elapsed():5.0f} s] {message}", flush=True)

    return elapsed, log


def usable(names, log) -> list[str]:
    """The backends of ``names`` available in this process (the others logged with why)."""
    known = {b.name for b in backends.registry()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    out = []
    for name in names:
        why = backends.get(name).unavailable()
        if why:
            log(f"{name}: unavailable ({why})")
        else:
            out.append(name)
    return out


def _resumed(out, meta: dict) -> list[dict]:
    path = Path(out)
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if data.get("meta", {}).get("device") != meta["device"]:
        raise ValueError(f"--resume: {path} was measured on {data.get('meta', {}).get('device')!r}, "
                         f"this is {meta['device']!r}")
    return list(data.get("measurements", []))


def _progress(shape: Shape, times: dict) -> str:
    def part(kind):
        return " ".join(f"{n} {ms:.3f}" for n, ms in sorted(times[kind].items(), key=lambda t: t[1])) or "-"

    refused = f" (refused: {', '.join(sorted(times['refused']))})" if times["refused"] else ""
    return f"{shape.name} [{shape.label}, {shape.heads_q}/{shape.heads_kv}]: fwd {part('fwd')} | f+b " \
           f"{part('fwdbwd')} ms{refused}"


def run_tune(out, *, budget: float = 290.0, resume: bool = False, names=None, workers: int | None = None,
             only: str | None = None, command: str = "packattn tune") -> int:
    """Measure `tune_grid` (the shapes matching ``only``, a regex) within ``budget`` seconds and write the table
    to ``out`` after every shape. 0 when the grid is complete, 3 when the budget stopped it (the file is valid
    either way: ``--resume`` continues it)."""
    elapsed, log = start_clock()
    if not torch.cuda.is_available():
        print("packattn tune needs a CUDA GPU")
        return 1
    names = usable(names or DEFAULT_BACKENDS, log)
    shapes = [s for s in tune_grid() if only is None or re.search(only, s.name)]
    arch, meta = device_meta(command)
    measurements = _resumed(out, meta) if resume else []
    done = {m["shape"] for m in measurements}
    todo = [s for s in shapes if s.name not in done]
    log(f"{meta['device']} ({arch}), torch {meta['torch']}, triton {meta['triton']}, FA4 {meta['fa4']}: "
        f"{len(todo)} shapes ({len(done)} kept from {out}) x {', '.join(names)}; budget {budget:.0f} s")
    timing_estimate = 0.35 * len(todo) * len(names)
    compile_first(todo, names, default_workers() if workers is None else workers,
                  budget - timing_estimate - elapsed(), log)
    pending = [s.name for s in todo]
    write_table(out, arch, {**meta, "seconds": round(elapsed())}, measurements, pending)
    for number, shape in enumerate(todo, 1):
        if elapsed() > budget:
            log(f"budget of {budget:.0f} s spent: {len(pending)} shapes left (--resume continues)")
            break
        times = measure(shape, names, "cuda")
        measurements.append(record(shape, times))
        pending.remove(shape.name)
        write_table(out, arch, {**meta, "seconds": round(elapsed())}, measurements, pending)
        log(f"{number}/{len(todo)} {_progress(shape, times)}")
    log(f"wrote {out}: {len(rows_from(measurements))} rows" + (f", {len(pending)} shapes unmeasured" if pending else ""))
    return 3 if pending else 0
