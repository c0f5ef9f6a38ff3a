"""Compile the Gluon Hopper backward kernels (`packattn.ops.varlen.bwd_dkdv_sm90`, `bwd_dq_sm90`,
`packattn.ops.tree.dq_sm90`) for sm_90a on a machine without a GPU, for every mask combination, head dim and
dtype, and check what matters before a GPU run:

* shared memory (at most the 227 KB one CTA may use on an H100/H200) and ptxas registers / spills;
* ptxas warnings (a "wgmma ... serialized" warning, e.g. C7514, means the async overlap is gone);
* proof of the overlap: inside the main loop the PTX waits with ``wgmma.wait_group.sync.aligned 2``
  and ``... 1`` (and the TTGIR has ``warp_group_dot_wait {pendings = 2}`` / ``{pendings = 1}``) in a
  loop that also holds the ``ex2`` of P (only the ``1`` waits where the kernel does not carry dS across
  steps);
* the setmaxnreg budget of each (warp-specialised) partition against the registers its SASS touches, and the
  launcher's CTAs per SM against what the compiled shared memory allows.

    python scripts/check_gluon_bwd_compile.py [--kernels dkdv dq] [--head-dims 64 128] [--dtypes bf16 fp16]
    python scripts/check_gluon_bwd_compile.py --kernels dkdv --config 64,128,2,8 --masks R   # another config
    python scripts/check_gluon_bwd_compile.py --dump /tmp/gluon_bwd_asm                  # ttgir / ptx files
    python scripts/check_gluon_bwd_compile.py --tree --head-dims 128    # tree mask: ws dK/dV (TREE) and tree dQ
    python scripts/check_gluon_bwd_compile.py --kernels dq --delta-from-o   # dQ with DELTA_FROM_O

The configurations are those of `packattn.ops.varlen.configs` (`dkdv_config`, `dq_config`; ``--short``: the
short-batch dQ; the tree dQ: `packattn.ops.tree.configs.TREE_DQ_CONFIGS`) unless ``--config``
(``block_m,block_n,stages,num_warps``). Variants without a Gluon kernel (a head dim without a config, where the
Triton pass runs) are reported as skipped; a ``key_split`` dK/dV config (the tables' at d = 256) is checked on the
key-split kernel (scripts/check_gluon_ksplit_compile.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS  # noqa: E402
from packattn.ops.runtime.sm90 import CTA_SHARED, _smem_layout, ws_split  # noqa: E402
from packattn.ops.tree.configs import TREE_DQ_CONFIGS  # noqa: E402
from packattn.ops.tree.dq_sm90 import tree_dq_gluon_ws_kernel  # noqa: E402
from packattn.ops.tree.launch_sm90 import tree_dq_resources  # noqa: E402
from packattn.ops.varlen import configs  # noqa: E402
from packattn.ops.varlen.bwd_dkdv_sm90 import varlen_bwd_dkdv_gluon_ws_kernel  # noqa: E402
from packattn.ops.varlen.bwd_dq_sm90 import varlen_bwd_dq_gluon_ws_kernel  # noqa: E402
from packattn.ops.varlen.configs import GluonBwdConfig  # noqa: E402
from packattn.ops.varlen.launch_sm90 import dkdv_resources, dq_resources  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gluon_compile import parse_dims, ptxas_report, sass_register_regions  # noqa: E402
from ptx_identity import kernel_signature  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHARED_LIMIT = CTA_SHARED  # bytes of shared memory one CTA may use on sm_90
# L(eft window) R(ight window / causal) C(hunk) T(op-left); "" = no mask
MASKS = ["", "R", "RT", "L", "LR", "LRT", "C", "CR", "CRT", "LCR"]
KERNELS = ("dkdv", "dq")
INT_POINTERS = ("tiles", "cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv", "KeyEnd", "intervals")
# a real launch gives these tt.divisibility = 16: 16-byte aligned tensors, (rows, heads, d) contiguous
# strides (multiples of d), lse / delta rows a multiple of 16 (true of the workloads, not of every batch)
ALIGNED = set(INT_POINTERS) | {"Lse", "Delta", "dK", "dV", "dQ", "stride_dk_row", "stride_dk_head", "stride_dv_row",
                               "stride_dv_head", "stride_dq_row", "stride_dq_head", "stride_lse_head"}


def _descriptor_type(dtype: torch.dtype, block: list[int]) -> str:
    """The signature string the JIT gives a host `TensorDescriptor` with this block (the launcher's layout)."""
    dummy = torch.empty(256, 2048, dtype=dtype)  # CPU tensor: only its dtype / alignment matter
    return mangle_type(TensorDescriptor(dummy, list(dummy.shape), list(dummy.stride()), block,
                                        _smem_layout(tuple(block), dtype)))


def _ptx_loops(ptx: str) -> list[str]:
    """PTX text of each loop: from a branch target to a later conditional branch back to it."""
    bodies = []
    for match in re.finditer(r"^\s*@%p\d+ bra(?:\.uni)?\s+\$(L__BB\d+_\d+);", ptx, re.M):
        start = ptx.find(f"${match.group(1)}:")
        if 0 <= start < match.start():
            bodies.append(ptx[start:match.end()])
    return bodies


def _root_cause(e: BaseException) -> str:
    """The innermost exception's message (Triton wraps frontend errors in CompilationErrors)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e)[-1500:]}"


def parse_config(text: str) -> GluonBwdConfig:
    """``"block_m,block_n,stages,num_warps"`` as a `GluonBwdConfig`."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if len(parts) != 4 or not all(x.isdigit() for x in parts):
        raise ValueError(f"{text!r}: expected block_m,block_n,stages,num_warps")
    return GluonBwdConfig(*(int(x) for x in parts))


def default_config(kernel: str, head_dim: int, tree: bool = False, short: bool = False) -> GluonBwdConfig | None:
    """The launchers' configuration of ``kernel`` at ``head_dim`` (None: no Gluon kernel runs there)."""
    if kernel == "dkdv":
        return configs.dkdv_config(head_dim)
    if tree:
        return TREE_DQ_CONFIGS.get(head_dim)
    return configs.dq_config(head_dim, short_seqs=short)


def ws_resources(kernel: str, cfg, head_dim: int, tree: bool = False, delta_from_o: bool = False) -> dict:
    """The launcher's register split / occupancy (`ws_split` of its shared-memory estimate) of a variant."""
    if kernel == "dkdv":
        return dkdv_resources(cfg, head_dim)
    if tree:
        return tree_dq_resources(cfg, head_dim)
    return dq_resources(cfg, head_dim, delta_from_o)


def compile_variant(kernel: str, dtype_name: str, head_dim: int, mask: str, cfg, tree: bool = False,
                    delta_from_o: bool = False):
    """``triton.compile`` of one kernel variant as the launchers launch it; ``tree``: the tree-mask variant
    (``mask`` must be ""); ``delta_from_o``: the varlen dQ kernel with ``DELTA_FROM_O`` (an O descriptor of
    ``BLOCK_M`` rows; without it the dQ kernel gets ``DELTA_FROM_O=False`` and ``o_desc=None``, as
    `launch_sm90.gluon_dq` passes them)."""
    dtype = DTYPES[dtype_name]
    if delta_from_o and (kernel != "dq" or tree):
        raise ValueError("DELTA_FROM_O is a variant of the varlen dQ kernel")
    if tree and mask:
        raise ValueError("the tree variants take no other mask")
    # as `gluon_dkdv` / `gluon_dq` / `gluon_tree_dq` launch it
    res = ws_resources(kernel, cfg, head_dim, tree, delta_from_o)
    fn = (varlen_bwd_dkdv_gluon_ws_kernel if kernel == "dkdv" else
          tree_dq_gluon_ws_kernel if tree else varlen_bwd_dq_gluon_ws_kernel)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                      HAS_LEFT="L" in mask, HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask, TOP_LEFT="T" in mask,
                      TREE=tree, CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4)
    if fn is varlen_bwd_dq_gluon_ws_kernel:
        constexprs.update(DELTA_FROM_O=delta_from_o)
        if not delta_from_o:
            constexprs.update(o_desc=None)  # (a None argument is a constant: no kernel parameter)
    options = {"num_warps": 4, "num_stages": 1, "maxnreg": res["maxnreg"], **COMPILE_OPTIONS}
    signature = kernel_signature(fn, constexprs, _descriptor_type(dtype, [cfg.block_m, head_dim]),
                                 _descriptor_type(dtype, [cfg.block_n, head_dim]), "*" + dtype_name, INT_POINTERS)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in ALIGNED}
    constants = {(fn.arg_names.index(k),): v for k, v in constexprs.items() if k in fn.arg_names}
    src = GluonASTSource(fn, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _scf_for_bodies(ttgir: str) -> list[str]:
    """Text of each ``scf.for`` region of the TTGIR, from the op to its matching closing brace
    (nested ``scf.if`` regions with their own ``scf.yield`` included)."""
    bodies = []
    for match in re.finditer(r"scf\.for\b", ttgir):
        open_at = ttgir.find("{\n", match.end())  # the region's brace ends the line (attributes use "<{")
        depth, i = 0, open_at
        while i < len(ttgir):
            depth += {"{": 1, "}": -1}.get(ttgir[i], 0)
            if depth == 0:
                break
            i += 1
        bodies.append(ttgir[match.start():i + 1])
    return bodies


def overlap_proof(compiled, carries_ds: bool = True) -> tuple[bool, str]:
    """Are wgmma's left in flight across P and dS? The TTGIR main loop must wait with pendings = 2
    (S done; dP and the previous block's dK / dQ in flight during P) and pendings = 1 (dV / dQ in
    flight during dS); the PTX loop must hold ``wgmma.wait_group 2`` and ``1`` beside wgmma and ex2.
    The warp-specialised dK/dV kernel (`bwd_dkdv_sm90`) issues dK within its step (no dS^T
    carried across steps: no room in 240 registers), and so does the warp-specialised dQ kernel
    (`bwd_dq_sm90`) with 2 stages: ``carries_ds=False``, only the ``1`` waits are needed
    (dP in flight during P)."""
    waits = (2, 1) if carries_ds else (1, )
    loops = [b for b in _scf_for_bodies(compiled.asm["ttgir"]) if "ttng.warp_group_dot " in b]
    ir_ok = any(all(f"pendings = {n}" in b for n in waits) for b in loops)
    ptx_loops = [b for b in _ptx_loops(compiled.asm["ptx"]) if "wgmma.mma_async" in b]
    ptx_ok = any(all(f"wgmma.wait_group.sync.aligned {n};" in b for n in waits) and "ex2.approx" in b
                 for b in ptx_loops)
    counts = {}
    if ptx_loops:
        body = max(ptx_loops, key=len)
        counts = {"mma_async": body.count("wgmma.mma_async"),
                  **{f"wait{n}": body.count(f"wgmma.wait_group.sync.aligned {n};") for n in (2, 1, 0)},
                  "ex2": body.count("ex2.approx"), "bar.sync": body.count("bar.sync"),
                  "tma": body.count("cp.async.bulk.tensor")}
    need = " and ".join(str(n) for n in waits)
    detail = (f"ttgir pendings={need} in loop: {ir_ok}; ptx wait_group {need} in loop with wgmma+ex2: {ptx_ok}; "
              f"main loop {counts}")
    return ir_ok and ptx_ok, detail


def _parse_dims(text: str):
    """``"d"`` -> d (an int) for a power of two; ``"d:d_v"`` or a d in column parts -> ``(d, d_v)``."""
    d, dv = parse_dims(text)
    return d if d == dv and d & (d - 1) == 0 else (d, dv)


def _check_ksplit(dtype_name: str, head_dim: int, cfg, args) -> int:
    """Check the key-split dK/dV variants of a ``key_split`` config (`check_gluon_ksplit_compile.check`); returns
    the failures."""
    import check_gluon_ksplit_compile as ksplit

    failures = 0
    for mask in ["tree"] if args.tree else args.masks:
        ok, text, _row = ksplit.check(dtype_name, head_dim, mask, cfg.stages, args.tree)
        failures += not ok
        print(text, flush=True)
    return failures


def _check_parts(kernel: str, dtype_name: str, dims, args, config) -> int:
    """Check the part kernel variants of ``dims`` (`check_gluon_bwd_parts_compile.check`); returns the failures."""
    import check_gluon_bwd_parts_compile as parts

    cfg = config or parts.PROPOSED[dims][kernel == "dq"]
    if args.tree and kernel != "dkdv":
        return 0
    failures = 0
    for mask in ["tree"] if args.tree else args.masks:
        # the dQ computes delta from O where its config says so (`op.fuses_delta`)
        ok, text = parts.check(kernel, dtype_name, dims, mask, cfg, args.tree, kernel == "dq" and cfg.fused_delta)
        failures += not ok
        print(text, flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=sorted(DTYPES))
    default_dims = [_parse_dims(f"{d[0]}:{d[1]}" if isinstance(d, tuple) else str(d)) for d in configs.GLUON_HEAD_DIMS]
    parser.add_argument("--head-dims", nargs="+", type=_parse_dims, default=default_dims,
                        help="head dims d, or d:d_v; dims in column parts / MLA go to check_gluon_bwd_parts_compile "
                             "(its PROPOSED configs unless --config)")
    parser.add_argument("--masks", nargs="+", default=MASKS, help="subset of " + " ".join(repr(m) for m in MASKS))
    parser.add_argument("--config", default=None,
                        help="block_m,block_n,stages,num_warps instead of the launchers' configuration, "
                             "e.g. 64,128,2,8 (two-consumer dK/dV) or 64,64,2,4 (one-consumer dQ)")
    parser.add_argument("--short", action="store_true", help="the short-batch dQ configuration")
    parser.add_argument("--dump", default=None, help="directory to write each variant's ttgir / ptx to")
    parser.add_argument("--tree", action="store_true",
                        help="compile the tree-mask variants instead of the masks")
    parser.add_argument("--delta-from-o", action="store_true",
                        help="the varlen dQ kernel with DELTA_FROM_O (delta = rowsum(dO O) in the kernel)")
    args = parser.parse_args()
    config = parse_config(args.config) if args.config else None
    failures = 0
    for kernel in args.kernels:
        for dtype_name in args.dtypes:
            for head_dim in args.head_dims:
                if not isinstance(head_dim, int):  # the part kernels (scripts/check_gluon_bwd_parts_compile.py)
                    failures += _check_parts(kernel, dtype_name, head_dim, args, config)
                    continue
                tables_cfg = None if config else default_config(kernel, head_dim, args.tree, args.short)
                if kernel == "dkdv" and not args.delta_from_o and tables_cfg is not None and tables_cfg.key_split:
                    failures += _check_ksplit(dtype_name, head_dim, tables_cfg, args)
                    continue
                for mask in [""] if args.tree else args.masks:
                    mask_name = "tree" if args.tree else mask
                    label = f"{kernel:4s} {dtype_name} d={head_dim} mask={mask_name or '-':4s}"
                    cfg = config or default_config(kernel, head_dim, args.tree, args.short)
                    if cfg is None:
                        print(f"{label}: skipped (no Gluon kernel runs here)", flush=True)
                        continue
                    if args.delta_from_o and (kernel != "dq" or args.tree):
                        print(f"{label}: skipped (DELTA_FROM_O: the varlen dQ only)", flush=True)
                        continue
                    try:
                        compiled = compile_variant(kernel, dtype_name, head_dim, mask, cfg, args.tree,
                                                   args.delta_from_o)
                    except Exception as e:  # report and go on
                        failures += 1
                        print(f"{label}: FAILED {type(e).__name__}: {str(e)[-800:]}\n"
                              f"    cause: {_root_cause(e)}", flush=True)
                        continue
                    shared = compiled.metadata.shared
                    usage, warnings = ptxas_report(compiled.asm["ptx"])
                    # the ws dQ kernel carries dS across steps with >= 3 stages (`bwd_dq_sm90`)
                    carries = kernel == "dq" and cfg.stages >= 3
                    ok, detail = overlap_proof(compiled, carries)
                    spills = re.search(r"(\d+) bytes spill stores", usage)
                    # (setmaxnreg budget, registers touched, SASS instructions) per partition
                    regions = sass_register_regions(compiled.asm["cubin"])
                    over = [r for r in regions if r[1] > r[0]]
                    # CTAs per SM: the launcher's (its shared-memory estimate) and what the compiled size allows
                    planned = ws_resources(kernel, cfg, head_dim, args.tree, args.delta_from_o)["ctas_per_sm"]
                    fits = ws_split(cfg.num_warps, shared)["ctas_per_sm"]
                    ctas_off = fits < planned
                    occupancy = f" ctas_per_sm={planned}" + (f" BUT THE COMPILED SIZE FITS {fits}" if ctas_off else "")
                    bad = (shared > SHARED_LIMIT or not ok or bool(warnings) or bool(over) or ctas_off
                           or (spills and int(spills.group(1)) > 0))
                    failures += bool(bad)
                    print(f"{label}: BLOCK_M={cfg.block_m} BLOCK_N={cfg.block_n} STAGES={cfg.stages} "
                          f"warps={cfg.num_warps}"
                          f"{' DELTA_FROM_O' if args.delta_from_o else ''} shared={shared}"
                          f"{' OVER THE LIMIT' if shared > SHARED_LIMIT else ''}{occupancy} | {usage}", flush=True)
                    print(f"    overlap {'OK' if ok else 'MISSING'}: {detail}", flush=True)
                    if regions:
                        print("    partitions (setmaxnreg budget: registers used / SASS instructions): "
                              + "; ".join(f"{lim}: {used} / {n}" for lim, used, n in regions)
                              + (" OVER BUDGET" if over else ""), flush=True)
                    for w in warnings:
                        print(f"    ptxas: {w}", flush=True)
                    if args.dump:
                        os.makedirs(args.dump, exist_ok=True)
                        stem = os.path.join(args.dump, f"{kernel}_{dtype_name}_d{head_dim}_{mask_name or 'none'}_"
                                                       f"m{cfg.block_m}_n{cfg.block_n}_s{cfg.stages}_w{cfg.num_warps}"
                                                       f"{'_delta_from_o' if args.delta_from_o else ''}")
                        for ext in ("ttgir", "ptx"):
                            with open(f"{stem}.{ext}", "w") as f:
                                f.write(compiled.asm[ext])
    print(f"{failures} variant(s) with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
