"""Do the Gluon kernels that dispatch selects compile to the same PTX in two checkouts?

Compiles, for sm_90a on the CPU (no GPU needed), every selected sm90 kernel configuration in the old
checkout (``--old``, default /tmp/old: kernels under ``packattn/kernels``) and in this one (kernels under
``packattn/ops``), with the constexprs the launchers pass, normalises the PTX (no ``.loc`` / ``.file`` lines,
debug sections, debug labels or comments; ``.entry`` / ``.func`` names replaced by fixed ones) and prints
``kernel config | same/DIFF``; exit status 1 on any DIFF or failed compile.

    python scripts/ptx_identity.py [--old /tmp/old] [--jobs 2] [--only fwd dkdv dq tree] [--keep DIR]

The constexprs are written out here (not read from either checkout's launchers), so both sides get the same
ones; the new kernels take no ``DIRECT_STORE`` / ``PINGPONG`` / ``PERSISTENT`` (always True / False / False
in every selected configuration), which are dropped from the new side's constexprs. Each checkout compiles in
its own subprocess (``PYTHONPATH`` = that checkout), ``--jobs`` of them at a time. Normalised PTX files are
left in ``--keep`` (default /tmp/ptx_identity/{old,new}) for ``diff``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOVED = ("DIRECT_STORE", "PINGPONG", "PERSISTENT")  # constexprs the new kernels no longer take
MASKS = {"causal": "R", "none": "", "window+chunk": "LCR"}

# kernel key -> (old module, new module, function name)
KERNELS = {
    "fwd": ("packattn.kernels.varlen_fwd_gluon_ws", "packattn.ops.varlen.fwd_sm90", "varlen_fwd_gluon_ws_kernel"),
    "dkdv": ("packattn.kernels.varlen_bwd_gluon_ws", "packattn.ops.varlen.bwd_dkdv_sm90",
             "varlen_bwd_dkdv_gluon_ws_kernel"),
    "dq_ws": ("packattn.kernels.varlen_bwd_gluon_dq_ws", "packattn.ops.varlen.bwd_dq_sm90",
              "varlen_bwd_dq_gluon_ws_kernel"),
    "tree_fwd": ("packattn.kernels.tree_fwd_gluon", "packattn.ops.tree.fwd_sm90", "tree_fwd_gluon_kernel"),
    "tree_dq": ("packattn.kernels.tree_dq_gluon_ws", "packattn.ops.tree.dq_sm90", "tree_dq_gluon_ws_kernel"),
}

# ---------------------------------------------------------------- register split (as the launchers compute it)
SM_SHARED, SM_REGISTERS, PRODUCER_REGS, MIN_CONSUMER_REGS = 233472, 65536, 24, 200


def ws_split(consumer_warps: int, cta_shared_bytes: int) -> dict:
    """The launchers' `ws_split` (occupancy and setmaxnreg split of a warp-specialised kernel)."""
    warps = 4 * ((consumer_warps + 1 + 3) // 4)
    consumers = consumer_warps // 4
    best = None
    for ctas in range(1, max(1, SM_SHARED // (cta_shared_bytes + 1024)) + 1):
        maxnreg = min(256, SM_REGISTERS // (ctas * warps * 32)) // 8 * 8
        idle = warps // 4 - consumers
        consumer_regs = min(256, (maxnreg * warps - PRODUCER_REGS * 4 * idle) // (4 * consumers)) // 8 * 8
        if best is None or consumer_regs >= MIN_CONSUMER_REGS:
            best = {"maxnreg": maxnreg, "consumer_regs": consumer_regs}
    return best


def fwd_shared(bm, bn, stages, d, tree=False):
    return (bm + 2 * stages * bn) * d * 2 + 8 * (2 + 2 * stages) + (4 * stages * bn if tree else 0)


def dkdv_shared(bm, bn, stages, d):
    c = bn // 64
    return (2 * bn + 2 * stages * bm) * d * 2 + 4 * (2 * stages * bm + c * bm) + 8 * (c + 2 * stages)


def dq_shared(bm, bn, stages, d, delta=False, tree=False):
    c = bm // 64
    return ((3 if delta else 2) * bm + 2 * stages * bn) * d * 2 + 8 * (c + 2 * stages) + (
        4 * stages * bn if tree else 0)


# ---------------------------------------------------------------- the selected configurations
def _ws(constexprs: dict, warps: int, shared: int) -> tuple[dict, dict]:
    res = ws_split(warps, shared)
    constexprs.update(CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return constexprs, {"num_warps": 4, "maxnreg": res["maxnreg"], "num_stages": 1}


def _masks(mask: str) -> dict:
    return dict(HAS_LEFT="L" in mask, HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask, TOP_LEFT="T" in mask)


def specs() -> list[dict]:
    """Every (kernel, constexprs, options, blocks) that a launcher selects on some GPU (bf16)."""
    out = []
    # forward (varlen): (label, d, block_m, block_n, stages, warps, trim); long batches take the default tiles
    fwd = [("default", 64, 128, 128, 4, 8, False), ("long", 64, 128, 128, 4, 8, False),
           ("default", 128, 128, 128, 3, 8, False), ("long", 128, 128, 128, 3, 8, False),
           ("short", 128, 64, 64, 3, 4, False), ("short-trim", 128, 128, 64, 4, 8, True)]
    for name, d, bm, bn, st, w, trim in fwd:
        for mname, mask in MASKS.items():
            c, o = _ws(dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=st, **_masks(mask), DIRECT_STORE=True,
                            PINGPONG=False, TRIM=trim), w, fwd_shared(bm, bn, st, d))
            out.append(dict(group="fwd", kernel="fwd", label=f"fwd {name} d={d} {bm}x{bn}x{st} {mname}",
                            constexprs=c, options=o, bm=bm, bn=bn, d=d))
    # dK/dV (warp-specialised, d = 128): one consumer (64 keys per tile) and two (GQA groups >= 4); varlen and tree
    for name, bm, bn, st, w in (("one-consumer", 64, 64, 2, 4), ("two-consumer", 64, 128, 2, 8)):
        for mname, mask in [*MASKS.items(), ("tree", "")]:
            c, o = _ws(dict(HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, STAGES=st, **_masks(mask), TREE=mname == "tree",
                            PERSISTENT=False), w, dkdv_shared(bm, bn, st, 128))
            out.append(dict(group="dkdv", kernel="dkdv", label=f"dkdv {name} d=128 {bm}x{bn}x{st} {mname}",
                            constexprs=c, options=o, bm=bm, bn=bn, d=128))
    # dQ (warp-specialised, d = 128): two consumers (default) and one (short batches), with and without delta
    for name, bm, bn, st, w in (("two-consumer", 128, 64, 4, 8), ("one-consumer", 64, 64, 2, 4)):
        for delta in (True, False):
            for mname, mask in MASKS.items():
                c, o = _ws(dict(HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, STAGES=st, **_masks(mask), PERSISTENT=False,
                                DELTA_FROM_O=delta), w, dq_shared(bm, bn, st, 128, delta))
                if not delta:
                    c["o_desc"] = None
                out.append(dict(group="dq", kernel="dq_ws", constexprs=c, options=o, bm=bm, bn=bn, d=128,
                                label=f"dq {name}{' delta' if delta else ''} d=128 {bm}x{bn}x{st} {mname}"))
    # tree forward (the varlen forward's default tiles) and tree dQ (the two-consumer dQ tiles, d = 128)
    for d, st in ((64, 4), (128, 3)):
        c, o = _ws(dict(HEAD_DIM=d, BLOCK_M=128, BLOCK_N=128, STAGES=st, DIRECT_STORE=True), 8,
                   fwd_shared(128, 128, st, d, tree=True))
        out.append(dict(group="tree", kernel="tree_fwd", label=f"tree fwd d={d} 128x128x{st}", constexprs=c,
                        options=o, bm=128, bn=128, d=d))
    c, o = _ws(dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, STAGES=4), 8, dq_shared(128, 64, 4, 128, tree=True))
    out.append(dict(group="tree", kernel="tree_dq", label="tree dq d=128 128x64x4", constexprs=c, options=o,
                    bm=128, bn=64, d=128))
    return out


# ---------------------------------------------------------------- PTX normalisation
_DEBUG_LABEL = re.compile(r"^\$L(?:tmp\d+|__func_begin\d+|__func_end\d+|__tmp\d+):$")


def normalise(ptx: str) -> str:
    """PTX without debug info, comments and names: ``.loc`` / ``.file`` lines, ``.section .debug_*`` blocks,
    debug labels and ``//`` comments go; every ``.entry`` / ``.func`` name becomes ``F<n>`` (order of
    appearance); blank lines and trailing spaces go."""
    lines, skip = [], False
    for line in ptx.splitlines():
        s = line.split("//", 1)[0].rstrip()
        st = s.strip()
        if skip:
            if st == "}":
                skip = False
            continue
        if st.startswith(".section") and ".debug" in st:
            skip = True
            continue
        if not st or st.startswith((".loc", ".file")) or _DEBUG_LABEL.match(st):
            continue
        lines.append(s)
    text = "\n".join(lines) + "\n"
    names = []
    for m in re.finditer(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$.]*)", text):
        if m.group(1) not in names:
            names.append(m.group(1))
    for i, name in sorted(enumerate(names), key=lambda x: -len(x[1])):
        text = re.sub(r"(?<![\w$.])" + re.escape(name) + r"(?![\w$.])", f"F{i}", text)
    return text


# ---------------------------------------------------------------- compiling (in a worker subprocess)
INT_POINTERS = ("tiles", "cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv", "KeyEnd", "key_end",
                "intervals")
OUT_POINTERS = ("Out", "dK", "dV", "dQ")


def kernel_signature(fn, constexprs: dict, q_desc: str, kv_desc: str, out: str,
                     int_pointers: tuple[str, ...] = INT_POINTERS) -> dict:
    """``triton.compile`` signature of a Gluon sm90 kernel ``fn``, by argument name: ``constexpr`` for the
    names in ``constexprs``, ``q_desc`` for the Q / dO / O descriptors, ``kv_desc`` for K / V, ``out`` for
    the output pointers (`OUT_POINTERS`), float32 pointers for lse / delta, int32 pointers for the tables
    (``int_pointers``), float32 scales and int32 for every other argument."""
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("q_desc", "do_desc", "o_desc"):
            signature[arg] = q_desc
        elif arg in ("k_desc", "v_desc"):
            signature[arg] = kv_desc
        elif arg in OUT_POINTERS:
            signature[arg] = out
        elif arg in ("Lse", "Delta"):
            signature[arg] = "*fp32"
        elif arg in int_pointers:
            signature[arg] = "*i32"
        elif arg in ("qk_scale_log2", "scale"):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
    return signature


def _compile(spec: dict, new: bool):
    import importlib

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    old_mod, new_mod, name = KERNELS[spec["kernel"]]
    fn = getattr(importlib.import_module(new_mod if new else old_mod), name)
    constexprs = dict(spec["constexprs"])
    if new:
        for k in REMOVED:
            if k not in fn.arg_names:
                constexprs.pop(k, None)
    missing = [k for k in constexprs if k not in fn.arg_names]
    if missing:
        raise ValueError(f"{name} takes no {missing}")

    def desc(rows):
        dummy = torch.empty(256, 2048, dtype=torch.bfloat16)
        layout = gl.NVMMASharedLayout.get_default_for([rows, spec["d"]], gl.bfloat16)
        return mangle_type(TensorDescriptor(dummy, list(dummy.shape), list(dummy.stride()), [rows, spec["d"]], layout))

    signature = kernel_signature(fn, constexprs, desc(spec["bm"]), desc(spec["bn"]), "*bf16")
    aligned = set(INT_POINTERS) | set(OUT_POINTERS) | {"Lse", "Delta"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if arg in aligned or arg.startswith("stride_")}
    src = GluonASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(spec["options"]))


def ptx_path(keep: str, side: str, label: str) -> str:
    """Where a worker leaves the normalised PTX of ``label``: ``keep/side/<label, odd characters as _>.ptx``."""
    return os.path.join(keep, side, re.sub(r"[^\w.-]+", "_", label) + ".ptx")


def compile_side(side: str, keep: str, items, compile_one) -> int:
    """A worker's body: compile each ``(label, item)`` of ``items`` with ``compile_one(item)`` (normalised PTX),
    write it to `ptx_path` and print one JSON line ``{label: path or "FAILED ..."}`` with ``packattn``: the folder
    of the package it imported (`run_worker` checks it)."""
    import packattn

    results = {"packattn": os.path.dirname(os.path.abspath(packattn.__file__))}
    os.makedirs(os.path.join(keep, side), exist_ok=True)
    for label, item in items:
        try:
            text = compile_one(item)
        except Exception as e:  # report and go on
            results[label] = f"FAILED {type(e).__name__}: {str(e)[-400:]}"
            continue
        path = ptx_path(keep, side, label)
        with open(path, "w") as f:
            f.write(text)
        results[label] = path
    print(json.dumps(results))
    return 0


def run_worker(script: str, side: str, root: str, args: list[str]) -> dict:
    """Run ``script --worker side *args`` in a subprocess that imports the checkout ``root`` (``PYTHONPATH``, cwd;
    compiling for real: no ``TRITON_INTERPRET``) and return its `compile_side` results; raises if the worker
    failed or imported another checkout's packattn."""
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, os.path.abspath(script), "--worker", side, *args], cwd=root, env=env,
                          capture_output=True, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            found = json.loads(line)
            if os.path.realpath(found.pop("packattn")) != os.path.realpath(os.path.join(root, "packattn")):
                raise RuntimeError(f"{side}: imported packattn from the wrong checkout")
            return found
    raise RuntimeError(f"{side} worker {args} failed:\n{done.stderr[-3000:]}")


def worker(side: str, group: str, keep: str) -> int:
    """Compile the specs of ``group`` with the packattn on sys.path; write normalised PTX to keep/side/."""
    return compile_side(side, keep, [(spec["label"], spec) for spec in specs() if spec["group"] == group],
                        lambda spec: normalise(_compile(spec, side == "new").asm["ptx"]))


def run_side(side: str, root: str, group: str, keep: str) -> dict:
    return run_worker(__file__, side, root, [group, "--keep", keep])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="/tmp/old")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=["fwd", "dkdv", "dq", "tree"])
    parser.add_argument("--keep", default="/tmp/ptx_identity")
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "GROUP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker, args.keep)
    jobs = [(side, root, group) for group in args.only for side, root in (("old", args.old), ("new", ROOT))]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda j: (j, run_side(j[0], j[1], j[2], args.keep)), jobs))
    results = {(side, label): path for (side, _, _), found in done for label, path in found.items()}
    labels = [s["label"] for s in specs() if s["group"] in args.only]
    old = {label: results.get(("old", label), "missing") for label in labels}
    new = {label: results.get(("new", label), "missing") for label in labels}
    return compare(labels, old, new)


def compare(labels: list[str], old: dict, new: dict) -> int:
    """Print ``label | same/DIFF/FAILED`` for each label (``old`` / ``new``: label -> normalised PTX file, or a
    FAILED message), then the count; 1 if any is not the same."""
    width = max(map(len, labels), default=0)
    bad = 0
    for label in labels:
        a, b = old.get(label, "missing"), new.get(label, "missing")
        if a.startswith(("FAILED", "missing")) or b.startswith(("FAILED", "missing")):
            verdict = f"FAILED (old: {a[:200]}; new: {b[:200]})"
        else:
            with open(a) as fa, open(b) as fb:
                verdict = "same" if fa.read() == fb.read() else "DIFF"
        bad += verdict != "same"
        print(f"{label:{width}s} | {verdict}", flush=True)
    print(f"{len(labels) - bad} of {len(labels)} the same" + (f", {bad} DIFF or failed" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
