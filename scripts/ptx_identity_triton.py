"""Do the portable Triton varlen kernels compile to the same PTX in two checkouts?

The Triton twin of `ptx_identity.py` (which covers the sm_90 Gluon kernels): compiles, for sm_90a on the CPU,
the forward, dQ, dK/dV (also with ``TREE``) and backward-preprocess kernels at bf16, head dims 64, 128, 256,
masks causal and window+chunk, with the Hopper launch configs, in the old checkout (``--old``, default
/tmp/pre_mla, kernels under ``packattn/ops/varlen``) and in this one; normalises the PTX with
`ptx_identity.normalise` and prints ``kernel config | same/DIFF`` (exit status 1 on any DIFF or failed
compile). Constexprs a side's kernel does not take are dropped (the value head dim ``HEAD_DIM_V`` /
``BLOCK_DV`` of the MLA kernels is passed equal to ``HEAD_DIM`` / ``BLOCK_D``, as the launchers do for
equal head dims).

    python scripts/ptx_identity_triton.py [--old /tmp/pre_mla] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASKS = {"causal": "R", "window+chunk": "LCR"}
HEAD_DIMS = (64, 128, 256)
POINTERS = dict(Lse="*fp32", dLse="*fp32", Delta="*fp32", tiles="*i32", cu_seqlens_q="*i32", cu_seqlens_kv="*i32",
                row_offsets_q="*i32", row_offsets_kv="*i32", key_end="*i32")
TENSORS = ("Q", "K", "V", "Out", "dOut", "dQ", "dK", "dV")


def specs() -> list[tuple[str, str, int]]:
    """``(kernel, mask, head dim)`` rows: varlen fwd / dq / dkdv under each mask, tree dkdv, preprocess."""
    rows = [(kernel, mask, d) for d in HEAD_DIMS for kernel in ("fwd", "dq", "dkdv") for mask in MASKS]
    rows += [("tree_dkdv", "tree", d) for d in HEAD_DIMS] + [("preprocess", "-", d) for d in HEAD_DIMS]
    return rows


def _compile(kernel: str, mask: str, d: int) -> str:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from packattn.ops.runtime.launch import block_d
    from packattn.ops.varlen import bwd_triton, configs, fwd_triton

    if kernel == "preprocess":
        fn, warps, stages = bwd_triton.bwd_preprocess_kernel, 4, 3
        constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=configs.PREPROCESS_BLOCK_M, HAS_DLSE=False)
    else:
        fn = {"fwd": fwd_triton.varlen_fwd_kernel, "dq": bwd_triton.bwd_dq_kernel}.get(kernel, bwd_triton.bwd_dkdv_kernel)
        bd = block_d(d)
        config = configs.HOPPER_CONFIGS.get((kernel.removeprefix("tree_"), bd)) or \
            configs.HOPPER_CONFIGS[(kernel.removeprefix("tree_"), 128 if bd <= 128 else 256)]
        warps, stages = config.num_warps, config.num_stages
        rules = MASKS.get(mask, "")
        constexprs = dict(HEAD_DIM=d, BLOCK_D=bd, HEAD_DIM_V=d, BLOCK_DV=bd, BLOCK_M=config.block_m,
                          BLOCK_N=config.block_n, HAS_LEFT="L" in rules, HAS_RIGHT="R" in rules,
                          HAS_CHUNK="C" in rules, TOP_LEFT=False, INPUT_PRECISION="tf32")
        if kernel == "tree_dkdv":
            constexprs["TREE"] = True
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in constexprs else ("*bf16" if name in TENSORS else POINTERS.get(name))
                 or ("fp32" if name in ("qk_scale_log2", "scale") else "i32") for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["ptx"]


def worker(side: str, keep: str) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ptx_identity import normalise

    os.makedirs(os.path.join(keep, side), exist_ok=True)
    results = {}
    for kernel, mask, d in specs():
        key = f"{kernel} {mask} d={d}"
        try:
            text = normalise(_compile(kernel, mask, d))
        except Exception as e:  # report and go on
            results[key] = f"FAILED {type(e).__name__}: {str(e)[-300:]}"
            continue
        with open(os.path.join(keep, side, key.replace(" ", "_").replace("+", "_") + ".ptx"), "w") as f:
            f.write(text)
        results[key] = "ok"
    print(json.dumps(results))
    return 0


def run_side(side: str, root: str, keep: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", side, "--keep", keep],
                          env=env, capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{side} worker failed: {done.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="/tmp/pre_mla")
    parser.add_argument("--keep", default="/tmp/ptx_identity_triton")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.keep)
    old, new = run_side("old", args.old, args.keep), run_side("new", ROOT, args.keep)
    bad = 0
    for key in old:
        verdict = old[key] if old[key] != "ok" else new.get(key, "missing")
        if verdict == "ok":
            name = key.replace(" ", "_").replace("+", "_") + ".ptx"
            with open(os.path.join(args.keep, "old", name)) as a, open(os.path.join(args.keep, "new", name)) as b:
                verdict = "same" if a.read() == b.read() else "DIFF"
        bad += verdict != "same"
        print(f"{key:32s} | {verdict}")
    print(f"{len(old) - bad}/{len(old)} same")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
