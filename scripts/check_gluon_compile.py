"""Compile the Gluon Hopper forward (`packattn.kernels.varlen_fwd_gluon`) for sm_90a on a machine
without a GPU, for every mask combination and head dim, and check what matters before a GPU run:

* shared memory (must fit the 227 KB of an H100/H200 SM) and ptxas registers / spills;
* ptxas "wgmma ... serialized" warnings (ptxas silently drops the async overlap when it cannot
  keep wgmma operands in registers);
* proof of the overlap: inside the main loop the PTX holds ``wgmma.wait_group.sync.aligned 1``
  (and the TTGIR ``warp_group_dot_wait {pendings = 1}``), i.e. a wgmma stays in flight while the
  warp group runs the softmax.

    python scripts/check_gluon_compile.py [--head-dims 64 128] [--dtypes bf16 fp16] [--masks R RT ...]
    python scripts/check_gluon_compile.py --dump /tmp/gluon_asm   # also write ttgir/ptx per variant
    python scripts/check_gluon_compile.py --config 64,64,3,4      # another block_m,block_n,stages,warps
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from packattn.backends import triton_fwd_gluon as tg  # noqa: E402
from packattn.kernels.varlen_fwd_gluon import varlen_fwd_gluon_kernel, varlen_fwd_gluon_ws_kernel  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHARED_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90
# L(eft window) R(ight window / causal) C(hunk) T(op-left); "" = no mask
MASKS = ["", "R", "RT", "L", "LR", "LRT", "C", "CR", "CRT", "LCR"]
POINTERS = ("Out", "Lse", "tiles", "cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv")


def _descriptor_type(dtype: torch.dtype, block: list[int]) -> str:
    """The signature string the JIT would give a host `TensorDescriptor` with this block."""
    dummy = torch.empty(256, 2048, dtype=dtype)  # CPU tensor: only its dtype / alignment matter
    return mangle_type(TensorDescriptor(dummy, list(dummy.shape), list(dummy.stride()), block,
                                        tg.smem_layout(block, dtype)))


def compile_variant(dtype_name: str, head_dim: int, mask: str, cfg=None):
    """``triton.compile`` of one variant (the launcher's configuration unless ``cfg``); the int and pointer
    arguments get ``tt.divisibility = 16`` where a real launch (16-aligned tensors, strides that
    are multiples of 16) would give it."""
    dtype = DTYPES[dtype_name]
    cfg = cfg or tg.config_for(head_dim)
    block_n, stages = cfg.block_n, cfg.stages
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=block_n, STAGES=stages,
                      HAS_LEFT="L" in mask, HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask, TOP_LEFT="T" in mask)
    options = {"num_stages": 1}
    if cfg.warp_specialize:  # as `gluon_fwd` launches it
        fn = varlen_fwd_gluon_ws_kernel
        res = tg.ws_resources(cfg, head_dim)
        constexprs.update(DIRECT_STORE=cfg.direct_store, CONSUMER_REGS=res["consumer_regs"],
                          PRODUCER_REGS=res["producer_regs"], num_warps=4)
        options.update(num_warps=4, maxnreg=res["maxnreg"])
    else:
        fn = varlen_fwd_gluon_kernel
        constexprs.update(num_warps=cfg.num_warps)
        options.update(num_warps=cfg.num_warps)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "q_desc":
            signature[name] = _descriptor_type(dtype, [cfg.block_m, head_dim])
        elif name in ("k_desc", "v_desc"):
            signature[name] = _descriptor_type(dtype, [block_n, head_dim])
        elif name == "Out":
            signature[name] = "*" + dtype_name
        elif name == "Lse":
            signature[name] = "*fp32"
        elif name in POINTERS:
            signature[name] = "*i32"
        elif name == "qk_scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    aligned = set(POINTERS) | {"stride_o_row", "stride_lse_head"}  # (rows, heads, d) contiguous: d | stride
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
    src = GluonASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return cfg, compiled


def ptxas_report(ptx: str) -> tuple[str, list[str]]:
    """(registers/spills line, performance warnings) from triton's bundled ptxas for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    done = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    text = done.stderr + done.stdout
    usage = " | ".join(line.split("info    : ")[-1].strip() for line in text.splitlines()
                       if "registers" in line or "spill" in line)
    warnings = [line.strip() for line in text.splitlines() if "warning" in line.lower() or "C7515" in line]
    return usage or text.strip()[-300:], warnings


def _loop_bodies(ptx: str) -> list[str]:
    """PTX between each backward branch target and the branch to it (the loops), innermost text."""
    bodies = []
    for match in re.finditer(r"^\s*@%p\d+ bra\s+\$(L__BB\d+_\d+);", ptx, re.M):
        label = match.group(1)
        start = ptx.find(f"${label}:")
        if 0 <= start < match.start():
            bodies.append(ptx[start:match.end()])
    return bodies


def overlap_proof(compiled) -> tuple[bool, str]:
    """Is a wgmma left in flight across the softmax? Checks the TTGIR (warp_group_dot_wait with
    pendings = 1 inside the scf.for) and the PTX (wgmma.wait_group 1 inside a loop that also holds
    wgmma.mma_async and ex2)."""
    ttgir = compiled.asm["ttgir"]
    ptx = compiled.asm["ptx"]
    loop_ir = ttgir[ttgir.find("scf.for"):]
    ir_ok = "pendings = 1" in loop_ir.split("scf.yield")[0] if "scf.for" in ttgir else False
    ptx_loops = [b for b in _loop_bodies(ptx) if "wgmma.mma_async" in b]
    ptx_ok = any("wgmma.wait_group.sync.aligned 1;" in b and "ex2.approx" in b for b in ptx_loops)
    counts = {}
    if ptx_loops:
        body = max(ptx_loops, key=len)
        counts = {"mma_async": body.count("wgmma.mma_async"), "wait1": body.count("wgmma.wait_group.sync.aligned 1;"),
                  "wait0": body.count("wgmma.wait_group.sync.aligned 0;"), "ex2": body.count("ex2.approx"),
                  "bar.sync": body.count("bar.sync"), "tma": body.count("cp.async.bulk.tensor")}
    detail = f"ttgir pendings=1 in loop: {ir_ok}; ptx wait_group 1 in loop with wgmma+ex2: {ptx_ok}; main loop {counts}"
    return ir_ok and ptx_ok, detail


def _root_cause(e: BaseException) -> str:
    """The innermost exception's message (Triton wraps frontend errors in CompilationErrors)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e)[-1500:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(tg.HEAD_DIMS))
    parser.add_argument("--masks", nargs="+", default=MASKS, help="subset of " + " ".join(repr(m) for m in MASKS))
    parser.add_argument("--config", default=None,
                        help="block_m,block_n,stages,num_warps instead of the launcher's table, e.g. 64,64,3,4")
    parser.add_argument("--dump", default=None, help="directory to write each variant's ttgir / ptx to")
    args = parser.parse_args()
    config = tg.GluonConfig(*(int(x) for x in args.config.split(","))) if args.config else None
    failures = 0
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for mask in args.masks:
                label = f"{dtype_name} d={head_dim} mask={mask or '-':4s}"
                try:
                    cfg, compiled = compile_variant(dtype_name, head_dim, mask, config)
                except Exception as e:  # report and go on
                    failures += 1
                    print(f"{label}: FAILED {type(e).__name__}: {str(e)[-800:]}\n    cause: {_root_cause(e)}", flush=True)
                    continue
                shared = compiled.metadata.shared
                usage, warnings = ptxas_report(compiled.asm["ptx"])
                ok, detail = overlap_proof(compiled)
                spills = re.search(r"(\d+) bytes spill stores", usage)
                bad = shared > SHARED_LIMIT or not ok or bool(warnings) or (spills and int(spills.group(1)) > 0)
                failures += bool(bad)
                print(f"{label}: BLOCK_M={cfg.block_m} BLOCK_N={cfg.block_n} STAGES={cfg.stages} "
                      f"warps={cfg.num_warps} shared={shared}"
                      f"{' OVER THE LIMIT' if shared > SHARED_LIMIT else ''} | {usage}", flush=True)
                print(f"    overlap {'OK' if ok else 'MISSING'}: {detail}", flush=True)
                for w in warnings:
                    print(f"    ptxas: {w}", flush=True)
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    stem = os.path.join(args.dump, f"{dtype_name}_d{head_dim}_{mask or 'none'}_m{cfg.block_m}_n{cfg.block_n}_s{cfg.stages}")
                    for ext in ("ttgir", "ptx"):
                        with open(f"{stem}.{ext}", "w") as f:
                            f.write(compiled.asm[ext])
    print(f"{failures} variant(s) with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
