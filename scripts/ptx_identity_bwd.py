"""Does the warp-specialised Gluon backward compile to the same PTX in two checkouts of the ``packattn/ops`` layout?

Every variant that scripts/check_gluon_bwd_compile.py and scripts/check_gluon_bwd_parts_compile.py compile, compiled
for sm_90a on the CPU in an old checkout (``--old``, e.g. ``git archive HEAD packattn scripts`` made before a change)
and in this one, each with its own ``packattn``, both through this checkout's compile functions
(`check_gluon_bwd_compile.compile_variant`, `check_gluon_bwd_parts_compile.compile_part_variant`: the constexprs,
descriptors and registers the launchers pass):

* ``plain``: dK/dV at every config of `configs.DKDV_CONFIGS` / `DKDV_GQA_CONFIGS` with a power-of-two head dim
  (one consumer, two), under every mask and the tree mask; dQ at every config of `DQ_CONFIGS` /
  `DQ_SHORT_CONFIGS` (one / two consumers, with and without carried dS), every mask, with and without
  DELTA_FROM_O; the tree dQ at `tree.configs.TREE_DQ_CONFIGS`; bf16 and fp16;
* ``parts``: the part kernels at `check_gluon_bwd_parts_compile.PROPOSED`, every mask, the dQ with DELTA_FROM_O,
  dK/dV with the tree mask, bf16 and fp16;
* ``parts-nodelta``: the part dQ without DELTA_FROM_O.

The ``key_split`` dK/dV configs (d = 192 / 256) run the key-split kernel, not these: its PTX comes from
``scripts/check_gluon_ksplit_compile.py --ptx-dir DIR`` (run in each checkout, then ``diff -r``).

PTX is normalised as `ptx_identity.normalise` does (no line info, debug sections, comments or function names).
Prints ``variant | same/DIFF``; exit status 1 on any DIFF or failed compile. Normalised PTX is left in ``--keep``
(default /tmp/ptx_identity_bwd/{old,new}); ``--reuse-old`` takes the old side's files from there.

    python scripts/ptx_identity_bwd.py --old /tmp/bwd_old [--groups plain parts parts-nodelta] [--reuse-old]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(SCRIPTS)
sys.path.insert(0, SCRIPTS)
import ptx_identity  # noqa: E402

GROUPS = ("plain", "parts", "parts-nodelta")


def _tup(cfg) -> tuple:
    """A `GluonBwdConfig` as ``(block_m, block_n, stages, num_warps)``."""
    return (cfg.block_m, cfg.block_n, cfg.stages, cfg.num_warps)


def variants(groups=GROUPS, match: str = "") -> list[dict]:
    """``{label, group, args}`` of each variant (``args``: the compile function's arguments, configs as tuples)."""
    from check_gluon_bwd_compile import DTYPES, MASKS
    from check_gluon_bwd_parts_compile import PROPOSED, dims_label

    from packattn.ops.tree.configs import TREE_DQ_CONFIGS
    from packattn.ops.varlen import configs

    def plain(table):
        return sorted({(d, _tup(c)) for d, c in table.items()
                       if isinstance(d, int) and d & (d - 1) == 0 and not c.key_split})

    def row(group, label, *args):
        return {"group": group, "label": label, "args": args}

    dkdv = plain(configs.DKDV_CONFIGS) + plain(configs.DKDV_GQA_CONFIGS)
    dq = plain(configs.DQ_CONFIGS) + plain(configs.DQ_SHORT_CONFIGS)
    out = []
    for dt in DTYPES:
        for d, cfg in dkdv:
            out += [row("plain", f"dkdv {dt} d={d} {cfg} mask={mask or '-'}", "dkdv", dt, d,
                        "" if mask == "tree" else mask, cfg, mask == "tree", False) for mask in [*MASKS, "tree"]]
        for d, cfg in dq:
            out += [row("plain", f"dq {dt} d={d} {cfg}{' delta' if delta else ''} mask={mask or '-'}", "dq", dt, d,
                        mask, cfg, False, delta) for delta in (False, True) for mask in MASKS]
        out += [row("plain", f"tree dq {dt} d={d} {cfg}", "dq", dt, d, "", cfg, True, False)
                for d, cfg in plain(TREE_DQ_CONFIGS)]
        for dims, (dkdv_cfg, dq_cfg) in PROPOSED.items():
            for kernel, cfg in [("dkdv", _tup(dkdv_cfg))] * (not dkdv_cfg.key_split) + [("dq", _tup(dq_cfg))]:
                for mask in [*MASKS] + (["tree"] if kernel == "dkdv" else []):
                    name = f"parts {kernel} {dt} d={dims_label(dims)} {cfg} mask={mask or '-'}"
                    out.append(row("parts", name + (" delta" if kernel == "dq" else ""), kernel, dt, dims,
                                   "" if mask == "tree" else mask, cfg, mask == "tree", kernel == "dq"))
                    if kernel == "dq":
                        out.append(row("parts-nodelta", name, kernel, dt, dims, mask, cfg, False, False))
    return [v for v in out if v["group"] in groups and re.search(match, v["label"])]


def _compile(v: dict) -> str:
    """Normalised PTX of one variant (`variants`)."""
    import check_gluon_bwd_compile as plain
    import check_gluon_bwd_parts_compile as parts

    from packattn.ops.varlen.configs import GluonBwdConfig

    kernel, dt, dims, mask, cfg, tree, delta = v["args"]
    cfg = GluonBwdConfig(*cfg)
    if v["group"] == "plain":
        compiled = plain.compile_variant(kernel, dt, dims, mask, cfg, tree, delta)
    else:
        compiled, _ = parts.compile_part_variant(kernel, dt, tuple(dims), mask, cfg, tree, delta)
    return ptx_identity.normalise(compiled.asm["ptx"])


def worker(side: str, keep: str, groups, match: str, shard: int, shards: int) -> int:
    """Compile every ``shards``-th variant from ``shard``, the side's packattn imported first (from
    ``PYTHONPATH``: the compile scripts' own ``sys.path`` entries come after it is loaded)."""
    import packattn  # noqa: F401

    return ptx_identity.compile_side(side, keep, [(v["label"], v) for v in variants(groups, match)[shard::shards]],
                                     _compile)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="/tmp/bwd_old")
    parser.add_argument("--keep", default="/tmp/ptx_identity_bwd")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS)
    parser.add_argument("--match", default="", help="only the variants whose label this regex finds")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--reuse-old", action="store_true", help="the old side's PTX from an earlier run in --keep")
    parser.add_argument("--worker", metavar="SIDE", help=argparse.SUPPRESS)
    parser.add_argument("--shard", nargs=2, type=int, default=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.keep, args.groups, args.match, *args.shard)
    sys.path.insert(0, ROOT)
    chosen = variants(args.groups, args.match)
    sides = [("new", ROOT)] + ([] if args.reuse_old else [("old", args.old)])
    jobs = [(side, root, i) for side, root in sides for i in range(args.jobs)]

    def run(job):
        side, root, shard = job
        return side, ptx_identity.run_worker(__file__, side, root, ["--keep", args.keep, "--match", args.match,
                                                                    "--shard", str(shard), str(args.jobs),
                                                                    "--groups", *args.groups])

    found = {"old": {}, "new": {}}
    with ThreadPoolExecutor(args.jobs) as pool:
        for side, part in pool.map(run, jobs):
            found[side].update(part)
    if args.reuse_old:
        for v in chosen:
            path = ptx_identity.ptx_path(args.keep, "old", v["label"])
            found["old"][v["label"]] = path if os.path.exists(path) else "missing"
    return ptx_identity.compare([v["label"] for v in chosen], found["old"], found["new"])


if __name__ == "__main__":
    raise SystemExit(main())
