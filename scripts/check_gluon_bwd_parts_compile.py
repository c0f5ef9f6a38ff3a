"""Compile the Gluon backward part kernels (`packattn.ops.varlen.bwd_dkdv_sm90_parts`, `bwd_dq_sm90_parts`: head
dims in two column parts, a value head dim of its own) for sm_90a on a machine without a GPU, under every mask and
the tree mask (dK/dV), and check registers / spills, shared memory, ptxas warnings, the partitions' setmaxnreg
budgets, and the overlap (the main loop waits with wgmma groups pending while ``ex2`` runs).

    python scripts/check_gluon_bwd_parts_compile.py                        # PROPOSED configs, every dims/mask
    python scripts/check_gluon_bwd_parts_compile.py --dims 192 192:128 --kernels dkdv --config 32,64,3,8
    python scripts/check_gluon_bwd_parts_compile.py --tree                 # dK/dV with the tree mask

`PROPOSED` holds the configs the GPU script (scripts/gluon_bwd_dims_gpu.py) enables with `configs.override`; the
dQ compiles with DELTA_FROM_O where its config fuses delta (as `op.fuses_delta` runs it) unless ``--no-delta``. A
``key_split`` dK/dV config (the table's at d = 192) is checked on the key-split kernel
(scripts/check_gluon_ksplit_compile.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gluon_bwd_compile import (ALIGNED, DTYPES, INT_POINTERS, MASKS, SHARED_LIMIT,  # noqa: E402
                                     _descriptor_type, _ptx_loops, _root_cause, _scf_for_bodies, parse_config)
from check_gluon_compile import parse_dims, ptxas_report, sass_register_regions  # noqa: E402
from ptx_identity import kernel_signature  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS  # noqa: E402
from packattn.ops.runtime.sm90 import ws_split  # noqa: E402
from packattn.ops.varlen.fwd_sm90_parts import part_hi  # noqa: E402
from packattn.ops.varlen.launch_sm90_bwd_parts import dkdv_parts_resources, dq_parts_resources  # noqa: E402

from gluon_bwd_dims_gpu import DKDV, DQ  # noqa: E402

# (d, d_v) -> (dK/dV config, dQ config): those the GPU check (scripts/gluon_bwd_dims_gpu.py) enables
PROPOSED = {((k, k) if isinstance(k, int) else k): (DKDV[k], DQ[k]) for k in DKDV}


def dims_label(dims) -> str:
    return str(dims[0]) if dims[0] == dims[1] else f"{dims[0]}:{dims[1]}"


def descriptor_blocks(dims, cfg) -> dict:
    """Descriptor argument -> TMA block (None: no second part), as `launch_sm90.part_descriptors` builds them."""
    d, dv = dims
    blocks = {}
    for name, rows, dim in (("q", cfg.block_m, d), ("k", cfg.block_n, d), ("v", cfg.block_n, dv),
                            ("do", cfg.block_m, dv), ("o", cfg.block_m, dv)):
        hi = part_hi(dim)
        blocks[f"{name}_desc"] = [rows, hi]
        blocks[f"{name}_lo_desc"] = [rows, dim - hi] if dim > hi else None
    return blocks


def compile_part_variant(kernel: str, dtype_name: str, dims, mask: str, cfg, tree: bool = False,
                         delta_from_o: bool = True):
    """``triton.compile`` of one part kernel variant as `launch_sm90_bwd_parts` launches it; returns
    ``(compiled, resources)``."""
    d, dv = dims
    if kernel == "dkdv":
        from packattn.ops.varlen.bwd_dkdv_sm90_parts import varlen_bwd_dkdv_parts_kernel

        fn, res = varlen_bwd_dkdv_parts_kernel, dkdv_parts_resources(cfg, d, dv)
        extra = dict(TREE=tree)
    else:
        from packattn.ops.varlen.bwd_dq_sm90_parts import varlen_bwd_dq_parts_kernel

        fn, res = varlen_bwd_dq_parts_kernel, dq_parts_resources(cfg, d, dv, delta_from_o)
        extra = dict(DELTA_FROM_O=delta_from_o)
    constexprs = dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                      HAS_LEFT="L" in mask, HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask, TOP_LEFT="T" in mask,
                      CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4, **extra)
    blocks = descriptor_blocks(dims, cfg)
    if kernel == "dq" and not delta_from_o:
        blocks["o_desc"] = blocks["o_lo_desc"] = None
    return compile_in_parts(fn, dtype_name, blocks, constexprs, res["maxnreg"]), res


def compile_in_parts(fn, dtype_name: str, blocks: dict, constexprs: dict, maxnreg: int):
    """``triton.compile`` for sm_90a of a kernel taking descriptors in column parts, as the launchers launch it
    (``num_warps`` 4, ``maxnreg``): ``constexprs``, each descriptor argument of ``blocks`` with its own TMA block
    (None: a part the dims lack, passed as a None constexpr), the other arguments typed by
    `ptx_identity.kernel_signature`, the aligned ones (`ALIGNED`) with ``tt.divisibility`` 16."""
    constexprs = dict(constexprs, **{n: None for n, b in blocks.items() if b is None and n in fn.arg_names})
    signature = kernel_signature(fn, constexprs, None, None, "*" + dtype_name, INT_POINTERS)
    signature.update({name: _descriptor_type(DTYPES[dtype_name], block) for name, block in blocks.items()
                      if name in signature and name not in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in ALIGNED}
    constants = {(fn.arg_names.index(k),): v for k, v in constexprs.items() if k in fn.arg_names}
    options = {"num_warps": 4, "num_stages": 1, "maxnreg": maxnreg, **COMPILE_OPTIONS}
    return triton.compile(GluonASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def overlap(compiled) -> tuple[bool, str]:
    """Is a wgmma group left in flight across the softmax? Some ``scf.for`` with a ``warp_group_dot`` waits with
    ``pendings`` >= 1, and some PTX loop holds ``wgmma.wait_group n`` (n >= 1) beside wgmma and ex2."""
    loops = [b for b in _scf_for_bodies(compiled.asm["ttgir"]) if "ttng.warp_group_dot " in b]
    ir_ok = any(re.search(r"pendings = [1-9]", b) for b in loops)
    ptx_loops = [b for b in _ptx_loops(compiled.asm["ptx"]) if "wgmma.mma_async" in b]
    ptx_ok = any(re.search(r"wgmma\.wait_group\.sync\.aligned [1-9];", b) and "ex2.approx" in b for b in ptx_loops)
    counts = {}
    if ptx_loops:
        body = max(ptx_loops, key=len)
        counts = {"mma_async": body.count("wgmma.mma_async"),
                  **{f"wait{n}": body.count(f"wgmma.wait_group.sync.aligned {n};") for n in (2, 1, 0)},
                  "ex2": body.count("ex2.approx")}
    return ir_ok and ptx_ok, f"ttgir pendings>=1: {ir_ok}; ptx: {ptx_ok}; main loop {counts}"


def check(kernel, dtype_name, dims, mask_name, cfg, tree, delta_from_o) -> tuple[bool, str]:
    """Compile one variant and judge it: ``(ok, report lines)``; a ``key_split`` dK/dV config on the key-split
    kernel (`check_gluon_ksplit_compile.check`, d_v = d)."""
    if kernel == "dkdv" and cfg.key_split:
        import check_gluon_ksplit_compile

        ok, text, _row = check_gluon_ksplit_compile.check(dtype_name, dims[0], mask_name, cfg.stages, tree)
        return ok, text
    label = f"{kernel:4s} {dtype_name} d={dims_label(dims):7s} mask={mask_name or '-':4s}"
    try:
        compiled, res = compile_part_variant(kernel, dtype_name, dims, "" if tree else mask_name, cfg, tree,
                                             delta_from_o)
    except Exception as e:  # report and go on
        return False, f"{label}: FAILED {type(e).__name__}: {str(e)[-600:]}\n    cause: {_root_cause(e)}"
    shared = compiled.metadata.shared
    usage, warnings = ptxas_report(compiled.asm["ptx"])
    ok, detail = overlap(compiled)
    spills = re.search(r"(\d+) bytes spill stores", usage)
    regions = sass_register_regions(compiled.asm["cubin"])
    over = [r for r in regions if r[1] > r[0]]
    fits = ws_split(cfg.num_warps, shared)["ctas_per_sm"]
    bad = (shared > SHARED_LIMIT or not ok or bool(warnings) or bool(over) or fits < res["ctas_per_sm"]
           or (spills is not None and int(spills.group(1)) > 0))
    lines = [(f"{label}: {cfg.block_m}x{cfg.block_n}x{cfg.stages} w{cfg.num_warps}"
              f"{' DELTA_FROM_O' if kernel == 'dq' and delta_from_o else ''} shared={shared}"
              f"{' OVER' if shared > SHARED_LIMIT else ''} ctas_per_sm={res['ctas_per_sm']} (fits {fits}) | {usage}"),
             f"    overlap {'OK' if ok else 'MISSING'}: {detail}"]
    return not bad, "\n".join(lines + report_tail(regions, over, warnings))


def report_tail(regions, over, warnings) -> list[str]:
    """A variant's last report lines: each partition's register budget, registers used and instructions, and the
    ptxas warnings."""
    lines = []
    if regions:
        lines.append("    partitions (budget: used / instructions): "
                     + "; ".join(f"{lim}: {used} / {n}" for lim, used, n in regions) + (" OVER" if over else ""))
    return lines + [f"    ptxas: {w}" for w in warnings]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=["dkdv", "dq"], choices=["dkdv", "dq"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=sorted(DTYPES))
    parser.add_argument("--dims", nargs="+", type=parse_dims, default=list(PROPOSED))
    parser.add_argument("--masks", nargs="+", default=MASKS)
    parser.add_argument("--config", default=None, help="block_m,block_n,stages,num_warps instead of PROPOSED")
    parser.add_argument("--tree", action="store_true", help="the dK/dV kernel with the tree mask")
    parser.add_argument("--no-delta", action="store_true", help="the dQ without DELTA_FROM_O")
    args = parser.parse_args()
    failures = 0
    for kernel in ["dkdv"] if args.tree else args.kernels:
        for dims in args.dims:
            cfg = parse_config(args.config) if args.config else PROPOSED[dims][kernel == "dq"]
            for dtype_name in args.dtypes:
                for mask in ["tree"] if args.tree else args.masks:
                    ok, text = check(kernel, dtype_name, dims, mask, cfg, args.tree,
                                     cfg.fused_delta and not args.no_delta)
                    failures += not ok
                    print(text, flush=True)
    print(f"{failures} variant(s) with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
