"""Compile the small-sequence kernels for sm_90a on a machine without a GPU, with the configs of
`packattn.ops.small_seq.configs` (or one given with --config), and print per pass, head dim and GQA
group: ptxas registers / spills, shared memory, and how many programs fit on an SM by each limit.

    python scripts/check_small_seq_compile.py --head-dims 256 512 --groups 1 4
    python scripts/check_small_seq_compile.py --config "h1 c2 u4 w4 s5" --passes bwd
    python scripts/check_small_seq_compile.py --config "h1 c1 u8 w2 s5 i4" --head-dims 64 --groups 4
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the kernels must not be interpreted

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_triton_compile import ptxas_report
from nvidia_tools import cuobjdump_sass

from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS
from packattn.ops.small_seq import configs, kernels_mma, kernels_stack

SHARED_PER_SM = 233472  # sm_90: 228 KiB per SM, 227 KiB per block (1 KiB reserved per block)
REGS_PER_SM, MAX_WARPS, MAX_BLOCKS = 65536, 64, 32
FLOATS = ("qk_scale_log2", "scale")


def compile_pass(kind: str, head_dim: int, group: int, heads_kv: int, config: configs.SmallSeqConfig,
                 dtype: str = "bf16"):
    """The compiled kernel of pass ``kind`` with ``config``, strides specialised divisible by 16 as on a GPU."""
    bh = configs.block_h(config, heads_kv)
    if config.items > 1:
        fn = kernels_stack.small_seq_fwd_stack_kernel if kind == "fwd" else kernels_stack.small_seq_bwd_stack_kernel
    else:
        fn = kernels_mma.small_seq_fwd_mma_kernel if kind == "fwd" else kernels_mma.small_seq_bwd_mma_kernel
    constexprs = {"BLOCK_D": head_dim // config.d_chunks, "D_CHUNKS": config.d_chunks, "BLOCK_S": 16,
                  "BLOCK_G": configs.block_g(group, kind == "bwd", config.items), "BLOCK_H": bh,
                  "STACK": config.items, "HEAD_BLOCKS": -(-heads_kv // bh), "STAGES": config.num_stages,
                  "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    warps = bh if bh > 1 else config.num_warps
    if kind == "bwd":
        constexprs["HAS_DLSE"] = False
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name[0].isupper() or name[:2] in ("dQ", "dK", "dV", "dO", "dL"):
            signature[name] = "*fp32" if "Lse" in name else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("q_rows", "kv_starts", "kv_lens"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
            if name.startswith("stride_") and "lse" not in name:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 1, **COMPILE_OPTIONS})
    return compiled, warps


def loop_instructions(cubin: bytes) -> int:
    """SASS instructions of the kernel's largest loop (the unit loop's steady state, issued per warp per
    unit): the longest backward branch of ``cuobjdump -sass``; 0 when there is none."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = cuobjdump_sass(f.name)
    finally:
        os.unlink(f.name)
    longest = 0
    for addr, target in re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass):
        if int(target, 16) < int(addr, 16):  # a backward branch: a loop
            longest = max(longest, (int(addr, 16) - int(target, 16)) // 16 + 1)
    return longest


def occupancy(registers: int, shared: int, warps: int) -> int:
    """Programs per SM: the least of the register, shared-memory, warp and block limits."""
    regs = -(-registers * 32 // 256) * 256 * warps  # allocated per warp in units of 256
    by_regs = REGS_PER_SM // max(regs, 1)
    by_shared = SHARED_PER_SM // (shared + 1024)
    return min(by_regs, by_shared, MAX_WARPS // warps, MAX_BLOCKS)


def report(kind: str, head_dim: int, group: int, heads_kv: int, config: configs.SmallSeqConfig) -> str:
    compiled, warps = compile_pass(kind, head_dim, group, heads_kv, config)
    ptx = ptxas_report(compiled.asm["ptx"], 90)
    registers = int(ptx.split("Used ")[1].split()[0]) if "Used " in ptx else 255
    spills = ptx.split("bytes spill stores")[0].rsplit(",", 1)[-1].strip() if "spill stores" in ptx else "?"
    shared = compiled.metadata.shared
    per_sm = occupancy(registers, shared, warps)
    heads = configs.block_h(config, heads_kv)
    config = replace(config, block_h=heads, num_warps=warps)
    # loads of one unit at 8.5 keys (kv lengths 1..16): q (and dout) rows, K and V rows, bf16
    unit = heads * config.items * ((2 if kind == "bwd" else 1) * group + 2 * 8.5) * head_dim * 2
    # bytes a unit moves (the sweep's accounting: backward reads q, k, v, dout, writes dq, dk, dv)
    unit_bytes = unit + heads * config.items * (group + (2 * 8.5 if kind == "bwd" else 0)) * head_dim * 2
    loop = loop_instructions(compiled.asm["cubin"])
    return (f"{kind} d={head_dim} g={group} kv={heads_kv} [{config.describe()}]: regs {registers} spill {spills} B, "
            f"shared {shared} B, {per_sm} programs ({per_sm * warps} warps) per SM, "
            f"~{per_sm * unit / 1024:.0f} KB of loads in flight per SM at one unit a program, "
            f"unit loop {loop} SASS x {warps} warps = {loop * warps / (unit_bytes / 1024):.0f} warp instr/KB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(configs.HEAD_DIMS))
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--heads-kv", type=int, default=8, help="kv heads (8 / group by default: heads_q 8)")
    parser.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--config", help='one config for every case, e.g. "h2 c1 u8 w4 s5" or "h1 c1 u8 w2 s5 i4"')
    args = parser.parse_args()
    failures = 0
    for head_dim in args.head_dims:
        for group in args.groups:
            heads_kv = max(args.heads_kv // group, 1)
            for kind in args.passes:
                config = configs.SmallSeqConfig.parse(args.config) if args.config else configs.lookup(kind, head_dim, group)
                try:
                    print(report(kind, head_dim, group, heads_kv, config), flush=True)
                except Exception as e:  # noqa: BLE001 - report and go on
                    failures += 1
                    print(f"{kind} d={head_dim} g={group}: FAILED {type(e).__name__}: {str(e)[-400:]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
