"""Compile the key-split Gluon dK/dV kernel (`packattn.ops.varlen.bwd_dkdv_sm90_ksplit`) for sm_90a on a machine
without a GPU, under every mask and the tree mask, and check registers / spills, shared memory (against the launcher's
formula, `launch_sm90_ksplit.ksplit_shared_bytes`), ptxas warnings, the partitions' setmaxnreg budgets and the
overlap (the main loop waits with a wgmma group pending while ``ex2`` runs).

    python scripts/check_gluon_ksplit_compile.py                           # 256, 192 x bf16, fp16 x masks + tree
    python scripts/check_gluon_ksplit_compile.py --dims 256 --dtypes bf16 --masks R --stages 2 3
    python scripts/check_gluon_ksplit_compile.py --ptx-dir /tmp/ksplit_old  # normalised PTX only, one file a variant

Prints one block per variant and a summary table (registers, spills, shared memory per head dim / stages / dtype).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gluon_bwd_compile import DTYPES, MASKS, SHARED_LIMIT, _root_cause
from check_gluon_bwd_parts_compile import compile_in_parts, descriptor_blocks, overlap, report_tail
from check_gluon_compile import ptxas_report, sass_register_regions

from packattn.ops.runtime.sm90 import ws_split
from packattn.ops.varlen.configs import GluonBwdConfig
from packattn.ops.varlen.launch_sm90_ksplit import KSPLIT_HEAD_DIMS, ksplit_resources, ksplit_shared_bytes

FORMULA_SLACK = 1024  # bytes the compiled kernel may use beyond `ksplit_shared_bytes`
# stages per head dim the sweep compiles (3 slots of 64 x 256 Q and dO do not fit next to K / V and the exchange)
STAGES = {256: (2, ), 192: (2, 3)}


def ksplit_config(stages: int) -> GluonBwdConfig:
    """The key-split kernel's config with ``stages`` ring slots (blocks are fixed: 64 keys, 64 queries, 8 warps)."""
    return GluonBwdConfig(64, 64, stages, 8, key_split=True)


def compile_ksplit(dtype_name: str, head_dim: int, mask: str, stages: int, tree: bool = False):
    """``triton.compile`` of one variant as `launch_sm90_ksplit.gluon_dkdv_ksplit` launches it; returns ``(compiled,
    resources)``."""
    from packattn.ops.varlen.bwd_dkdv_sm90_ksplit import (
        varlen_bwd_dkdv_ksplit_kernel as fn,
    )

    cfg = ksplit_config(stages)
    res = ksplit_resources(cfg, head_dim)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=64, BLOCK_N=64, STAGES=stages, HAS_LEFT="L" in mask,
                      HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask, TOP_LEFT="T" in mask, TREE=tree,
                      CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"], num_warps=4)
    blocks = {n: b for n, b in descriptor_blocks((head_dim, head_dim), cfg).items() if n in fn.arg_names}
    return compile_in_parts(fn, dtype_name, blocks, constexprs, res["maxnreg"]), res


def check(dtype_name, head_dim, mask_name, stages, tree) -> tuple[bool, str, dict]:
    """Compile one variant and judge it: ``(ok, report lines, summary row)``."""
    label = f"ksplit {dtype_name} d={head_dim:<7d} x{stages} mask={mask_name or '-':4s}"
    try:
        compiled, res = compile_ksplit(dtype_name, head_dim, "" if tree else mask_name, stages, tree)
    except Exception as e:  # report and go on
        return False, f"{label}: FAILED {type(e).__name__}: {str(e)[-600:]}\n    cause: {_root_cause(e)}", {}
    shared = compiled.metadata.shared
    formula = ksplit_shared_bytes(ksplit_config(stages), head_dim)
    usage, warnings = ptxas_report(compiled.asm["ptx"])
    warnings = [w for w in warnings if "Too many maxnreg" not in w]  # maxnreg 256 capped at 255 (as on main)
    ok, detail = overlap(compiled)
    spills = re.search(r"(\d+) bytes spill stores", usage)
    nspill = int(spills.group(1)) if spills else 0
    regions = sass_register_regions(compiled.asm["cubin"])
    over = [r for r in regions if r[1] > r[0]]
    fits = ws_split(8, shared)["ctas_per_sm"]
    # the compiler adds a few hundred bytes (warp-specialisation captures, alignment) to the formula's buffers
    off = not formula <= shared <= formula + FORMULA_SLACK
    bad = (shared > SHARED_LIMIT or off or fits < res["ctas_per_sm"] or not ok or bool(warnings) or bool(over)
           or nspill > 0)
    lines = [(f"{label}: shared={shared} (formula {formula}{' OFF' if off else ''})"
              f"{' OVER' if shared > SHARED_LIMIT else ''} ctas_per_sm={res['ctas_per_sm']} (fits {fits}) "
              f"consumer_regs={res['consumer_regs']} | {usage}"),
             f"    overlap {'OK' if ok else 'MISSING'}: {detail}"]
    lines += report_tail(regions, over, warnings)
    regs = max((used for _lim, used, _n in regions), default=-1)
    row = dict(dims=str(head_dim), stages=stages, dtype=dtype_name, mask=mask_name or "-", shared=shared,
               regs=regs, spills=nspill, ok=not bad)
    return not bad, "\n".join(lines), row


def dump_ptx(ptx_dir: str, dtype_name, head_dim, mask_name, stages, tree) -> tuple[bool, str]:
    """Compile one variant and write its PTX, normalised as `ptx_identity.normalise` does (no line info), to
    ``ptx_dir``; no judging. Returns ``(ok, report line)``."""
    from ptx_identity import normalise

    name = f"ksplit_{dtype_name}_d{head_dim}_x{stages}_{mask_name or 'none'}.ptx"
    try:
        compiled, _res = compile_ksplit(dtype_name, head_dim, "" if tree else mask_name, stages, tree)
    except Exception as e:  # report and go on
        return False, f"{name}: FAILED {type(e).__name__}: {str(e)[-300:]}"
    with open(os.path.join(ptx_dir, name), "w") as f:
        f.write(normalise(compiled.asm["ptx"]))
    return True, f"{name}: written"


def summary(rows: list[dict]) -> str:
    """One line per (head dim, stages, dtype): the masks compiled, max registers used by a partition, spills,
    shared."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["dims"], r["stages"], r["dtype"]), []).append(r)
    out = ["d        stages dtype variants  max_regs  spill_B  shared_B  all_ok"]
    for (dims, stages, dtype), rs in groups.items():
        out.append(f"{dims:8s} {stages:6d} {dtype:5s} {len(rs):8d} {max(r['regs'] for r in rs):9d} "
                   f"{max(r['spills'] for r in rs):8d} {max(r['shared'] for r in rs):9d}  "
                   f"{all(r['ok'] for r in rs)}")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=sorted(DTYPES))
    parser.add_argument("--dims", nargs="+", type=int, default=sorted(KSPLIT_HEAD_DIMS, reverse=True),
                        choices=KSPLIT_HEAD_DIMS, help="head dims (d_v = d)")
    parser.add_argument("--masks", nargs="+", default=MASKS)
    parser.add_argument("--stages", nargs="+", type=int, default=None, help="instead of STAGES[d]")
    parser.add_argument("--no-tree", action="store_true", help="skip the tree-mask variants")
    parser.add_argument("--ptx-dir", default=None, help="only write each variant's normalised PTX here")
    args = parser.parse_args()
    if args.ptx_dir:
        os.makedirs(args.ptx_dir, exist_ok=True)
    failures, rows = 0, []
    for d in args.dims:
        for stages in args.stages or STAGES[d]:
            for dtype_name in args.dtypes:
                for mask in args.masks + ([] if args.no_tree else ["tree"]):
                    if args.ptx_dir:
                        ok, text = dump_ptx(args.ptx_dir, dtype_name, d, mask, stages, mask == "tree")
                        failures += not ok
                        print(text, flush=True)
                        continue
                    ok, text, row = check(dtype_name, d, mask, stages, mask == "tree")
                    failures += not ok
                    rows += [row] if row else []
                    print(text, flush=True)
    if rows:
        print(summary(rows))
    print(f"{failures} variant(s) with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
