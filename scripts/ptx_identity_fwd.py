"""Does the warp-specialised Gluon forward compile to the same PTX in two checkouts of the ``packattn/ops`` layout?

`ptx_identity.py`'s forward specs (the selected configurations at d = 64 / 128, masks causal / none / window+chunk)
and `part_specs` (d = 256, 96, 192, MLA 192/128 and 128/64 at their table configs, same masks) compiled for sm_90a on
the CPU in an old checkout (``--old``, e.g. a ``git archive HEAD packattn`` made before a change) and in this one,
both importing ``packattn.ops.varlen.fwd_sm90`` (`ptx_identity.py` reads its old side from the ``packattn/kernels``
layout). Parameters a side's kernel does not take are dropped; those it takes that the specs do not name get what the
launcher passes at d = d_v (``HEAD_DIM_V = HEAD_DIM``, the second-column-part descriptors ``*_lo_desc`` None, lazy
rescaling off; other constexprs with a default take it). Prints ``config | same/DIFF``; exit status 1 on any DIFF or
failed compile. Normalised PTX is left in ``--keep`` (default /tmp/ptx_identity_fwd/{old,new}).

    python scripts/ptx_identity_fwd.py [--old /tmp/old_fwd] [--keep DIR]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ptx_identity  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE, NAME = "packattn.ops.varlen.fwd_sm90", "varlen_fwd_gluon_ws_kernel"
LO_DESCS = ("q_lo_desc", "k_lo_desc", "v_lo_desc")
# lazy rescaling (`configs.GluonConfig.rescale_threshold`) as the launcher passes it off
OPT_IN_OFF = {"RESCALE_THRESHOLD": None}


# d = 256 and the dims in column parts / with a value head dim of their own (`fwd_sm90_parts`), their table configs:
# (label, d, d_v, block_m, block_n, stages)
PART_DIMS = [("d=256", 256, 256, 128, 32, 3), ("d=96", 96, 96, 128, 128, 3), ("d=192", 192, 192, 128, 64, 3),
             ("mla 192/128", 192, 128, 128, 64, 4), ("mla 128/64", 128, 64, 128, 128, 4)]


def part_specs() -> list[dict]:
    """Specs of `PART_DIMS` under `ptx_identity.MASKS` (``blocks``: each descriptor's TMA block, None for a second
    column part the dim does not have; registers from the side's `launch_sm90.fwd_resources`)."""
    out = []
    for label, d, dv, bm, bn, st in PART_DIMS:
        blocks = {}
        for name, rows, dim in (("q", bm, d), ("k", bn, d), ("v", bn, dv)):
            hi = 1 << (dim.bit_length() - 1)
            blocks[f"{name}_desc"], blocks[f"{name}_lo_desc"] = [rows, hi], ([rows, dim - hi] if dim > hi else None)
        for mname, mask in ptx_identity.MASKS.items():
            c = {"HEAD_DIM": d, "HEAD_DIM_V": dv, "BLOCK_M": bm, "BLOCK_N": bn, "STAGES": st, "TRIM": False,
                 **ptx_identity._masks(mask)}
            out.append(dict(group="fwd", kernel="fwd", label=f"fwd {label} {bm}x{bn}x{st} {mname}", constexprs=c,
                            options={"num_warps": 4, "num_stages": 1}, bm=bm, bn=bn, d=d, blocks=blocks,
                            cfg=(bm, bn, st, 8), dv=dv))
    return out


def fwd_specs() -> list[dict]:
    return [s for s in ptx_identity.specs() if s["group"] == "fwd"] + part_specs()


def _compile(spec: dict) -> str:
    import importlib

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    fn = getattr(importlib.import_module(MODULE), NAME)
    constexprs = {k: v for k, v in spec["constexprs"].items() if k in fn.arg_names}
    options = dict(spec["options"])
    if "blocks" in spec:  # registers as the side's launcher splits them
        from packattn.ops.varlen.configs import GluonConfig
        from packattn.ops.varlen.launch_sm90 import fwd_resources

        res = fwd_resources(GluonConfig(*spec["cfg"]), spec["d"], spec["dv"])
        constexprs.update(CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4)
        options["maxnreg"] = res["maxnreg"]
    if "HEAD_DIM_V" in fn.arg_names:
        constexprs.setdefault("HEAD_DIM_V", constexprs["HEAD_DIM"])
    constexprs.update({name: None for name in LO_DESCS if name in fn.arg_names})
    constexprs.update({name: value for name, value in OPT_IN_OFF.items() if name in fn.arg_names})
    # a constexpr with a default that nothing above names (an option one side's kernel has, the other's not): off
    constexprs.update({p.name: p.default for p in fn.params
                       if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty})

    def desc(rows, width=spec["blocks"]["q_desc"][1] if "blocks" in spec else spec["d"]):
        dummy = torch.empty(256, 2048, dtype=torch.bfloat16)
        layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
        return mangle_type(TensorDescriptor(dummy, list(dummy.shape), list(dummy.stride()), [rows, width], layout))

    for name, block in spec.get("blocks", {}).items():
        if block is None:
            constexprs[name] = None
        else:  # a descriptor argument (the second column part of a dim that has one)
            constexprs.pop(name, None)
    signature = ptx_identity.kernel_signature(fn, constexprs, desc(spec["bm"]), desc(spec["bn"]), "*bf16")
    for name, block in spec.get("blocks", {}).items():
        if block is not None:
            signature[name] = desc(*block)
    aligned = set(ptx_identity.INT_POINTERS) | set(ptx_identity.OUT_POINTERS) | {"Lse"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if arg in aligned or arg.startswith("stride_")}
    src = GluonASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return ptx_identity.normalise(compiled.asm["ptx"])


def worker(side: str, keep: str) -> int:
    """Compile every forward spec with the packattn on sys.path; normalised PTX to keep/side/."""
    return ptx_identity.compile_side(side, keep, [(spec["label"], spec) for spec in fwd_specs()], _compile)


def run_side(side: str, root: str, keep: str) -> dict:
    return ptx_identity.run_worker(__file__, side, root, ["--keep", keep])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="/tmp/old_fwd")
    parser.add_argument("--keep", default="/tmp/ptx_identity_fwd")
    parser.add_argument("--worker", metavar="SIDE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.keep)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        old, new = pool.map(lambda side: run_side(side[0], side[1], args.keep), [("old", args.old), ("new", ROOT)])
    return ptx_identity.compare([spec["label"] for spec in fwd_specs()], old, new)


if __name__ == "__main__":
    raise SystemExit(main())
