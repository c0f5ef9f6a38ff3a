"""Compile the Triton varlen kernels for a GPU architecture on a machine without a GPU, with the
launch configurations of `packattn.ops.varlen.configs`, and print each kernel's shared memory
and ptxas register / spill counts. Catches compile errors and oversized configs before a GPU run.

    python scripts/check_triton_compile.py --arch 90 --dtypes bf16 --head-dims 128 --mask R
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the kernels must not be interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS  # noqa: E402
from packattn.ops.varlen import configs as tv  # noqa: E402
from packattn.ops.varlen.bwd_triton import bwd_dkdv_kernel, bwd_dq_kernel  # noqa: E402
from packattn.ops.tree.kernels_triton import tree_dq_kernel, tree_fwd_kernel  # noqa: E402
from packattn.ops.varlen.fwd_triton import varlen_fwd_kernel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvidia_tools import bundled_ptxas  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = {"fwd": (varlen_fwd_kernel, ("Q", "K", "V", "Out")),
           "dq": (bwd_dq_kernel, ("Q", "K", "V", "dOut", "dQ")),
           "dkdv": (bwd_dkdv_kernel, ("Q", "K", "V", "dOut", "dK", "dV")),
           "tree_fwd": (tree_fwd_kernel, ("Q", "K", "V", "Out")),  # launched with the fwd config
           "tree_dq": (tree_dq_kernel, ("Q", "K", "V", "dOut", "dQ"))}  # with the dq config
SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}


def config_for(kernel: str, head_dim: int, dtype: torch.dtype, arch: int) -> tv.LaunchConfig:
    kernel = kernel.removeprefix("tree_")
    bd = tv.block_d(head_dim)
    table = tv.FP32_CONFIGS if dtype == torch.float32 else (tv.HOPPER_CONFIGS if arch == 90 else tv.FALLBACK_CONFIGS)
    return table.get((kernel, bd)) or table[(kernel, 128 if bd <= 128 else 256)]


def compile_kernel(kernel: str, dtype_name: str, head_dim: int, arch: int, mask: str,
                   warp_specialize: bool = False):
    fn, io_names = KERNELS[kernel]
    config = config_for(kernel, head_dim, DTYPES[dtype_name], arch)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=tv.block_d(head_dim), HEAD_DIM_V=head_dim,
                      BLOCK_DV=tv.block_d(head_dim), BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, HAS_LEFT="L" in mask, HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask,
                      TOP_LEFT="T" in mask, INPUT_PRECISION="ieee" if dtype_name == "fp32" else "tf32")
    if "WARP_SPECIALIZE" in fn.arg_names:
        constexprs["WARP_SPECIALIZE"] = warp_specialize
    pointers = {name: "*" + dtype_name for name in io_names}
    pointers.update(Lse="*fp32", Delta="*fp32", tiles="*i32", cu_seqlens_q="*i32", cu_seqlens_kv="*i32",
                    row_offsets_q="*i32", row_offsets_kv="*i32", intervals="*i32", key_end="*i32")
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name) or
                 ("fp32" if name in ("qk_scale_log2", "scale") else "i32") for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages,
                                       **COMPILE_OPTIONS})
    return config, compiled


def ptxas_report(ptx: str, arch: int) -> str:
    ptxas = bundled_ptxas(arch)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    done = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if "registers" in line or "spill" in line]
    return " | ".join(lines) or done.stderr.strip()[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(tv.HEAD_DIMS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--mask", default="R", help="rules compiled in: L(eft window) R(ight/causal) C(hunk) T(op-left)")
    parser.add_argument("--no-ptxas", action="store_true", help="skip the register/spill report")
    args = parser.parse_args()
    failures = 0
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for kernel in args.kernels:
                try:
                    config, compiled = compile_kernel(kernel, dtype_name, head_dim, args.arch, args.mask)
                except Exception as e:  # report and go on
                    failures += 1
                    print(f"{dtype_name} d={head_dim} {kernel}: FAILED {type(e).__name__}: {str(e)[-400:]}", flush=True)
                    continue
                shared = compiled.metadata.shared
                over = " OVER THE SHARED MEMORY LIMIT" if shared > SHARED_LIMIT.get(args.arch, 232448) else ""
                regs = "" if args.no_ptxas else " " + ptxas_report(compiled.asm["ptx"], args.arch)
                print(f"{dtype_name} d={head_dim} {kernel}: {config} shared={shared}{over}{regs}", flush=True)
                failures += bool(over)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
