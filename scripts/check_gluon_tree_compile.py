"""Compile the warp-specialised Gluon tree forward (`packattn.ops.tree.fwd_sm90`) for sm_90a on a
machine without a GPU, per head dim and dtype, with the checks of scripts/check_gluon_compile.py:
shared memory, ptxas registers / spills / warnings, the overlap proof (a wgmma in flight across the
softmax in each consumer's main loop), the setmaxnreg budget of every partition against the
registers its SASS touches, and the barriers / TMA of each loop.

    python scripts/check_gluon_tree_compile.py [--head-dims 64 128] [--dtypes bf16 fp16]
    python scripts/check_gluon_tree_compile.py --config 128,128,3,8             # another configuration
    python scripts/check_gluon_tree_compile.py --dump /tmp/gluon_tree_asm       # also write ttgir / ptx

The configurations are `packattn.ops.tree.configs.TREE_FWD_CONFIGS` unless ``--config``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS  # noqa: E402
from packattn.ops.tree.configs import GLUON_HEAD_DIMS, TREE_FWD_CONFIGS  # noqa: E402
from packattn.ops.tree.fwd_sm90 import tree_fwd_gluon_kernel  # noqa: E402
from packattn.ops.tree.launch_sm90 import tree_fwd_resources, tree_fwd_shared_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gluon_compile import (DTYPES, compile_forward_kernel, compiled_report, failure_report, label_of,  # noqa: E402
                                 parse_config)

INT_POINTERS = ("key_end", "tiles", "intervals")
# a real launch gives these tt.divisibility = 16 (16-byte aligned tensors; (total, heads, d) contiguous)
ALIGNED = set(INT_POINTERS) | {"Out", "Lse", "stride_o_row", "stride_o_head"}


def compile_tree(dtype_name: str, head_dim: int, cfg):
    """``triton.compile`` of the tree kernel as `packattn.ops.tree.launch_sm90.gluon_tree_fwd` launches it."""
    fn = tree_fwd_gluon_kernel
    res = tree_fwd_resources(cfg, head_dim)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                      CONSUMER_REGS=res["consumer_regs"],
                      PRODUCER_REGS=res["producer_regs"], num_warps=4)
    return compile_forward_kernel(fn, dtype_name, head_dim, cfg.block_m, cfg.block_n, constexprs,
                                  {"num_stages": 1, "num_warps": 4, "maxnreg": res["maxnreg"], **COMPILE_OPTIONS},
                                  INT_POINTERS, ALIGNED)


def check_tree(dtype_name: str, head_dim: int, config_text: str | None, dump: str | None) -> tuple[bool, str]:
    """Compile and check one variant: ``(problem, report text)`` (`check_gluon_compile.compiled_report`)."""
    cfg = parse_config(config_text) if config_text else TREE_FWD_CONFIGS[head_dim]
    label = f"tree {dtype_name} d={head_dim} [{label_of(cfg)}]"
    try:
        compiled = compile_tree(dtype_name, head_dim, cfg)
    except Exception as e:  # report and go on
        return True, failure_report(label, e)
    res = tree_fwd_resources(cfg, head_dim)
    bad, text = compiled_report(compiled, label, f"tree_{dtype_name}_d{head_dim}_{label_of(cfg).replace(',', '_')}",
                                dump)
    expected = tree_fwd_shared_bytes(cfg, head_dim)
    return bad, (f"{text}\n    launcher: shared_bytes={expected} ctas_per_sm={res['ctas_per_sm']} "
                 f"maxnreg={res['maxnreg']} consumer_regs={res['consumer_regs']} producer_regs={res['producer_regs']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(GLUON_HEAD_DIMS))
    parser.add_argument("--config", action="append", default=None,
                        help="a configuration instead of the launcher's (repeatable): "
                             "block_m,block_n,stages,num_warps")
    parser.add_argument("--dump", default=None, help="directory to write each variant's ttgir / ptx to")
    args = parser.parse_args()
    failures = count = 0
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for config_text in args.config or [None]:
                bad, text = check_tree(dtype_name, head_dim, config_text, args.dump)
                failures += bad
                count += 1
                print(text, flush=True)
    print(f"{failures} of {count} variant(s) with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
