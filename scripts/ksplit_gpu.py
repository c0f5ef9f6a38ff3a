"""GPU check of the key-split Gluon dK/dV kernel (`packattn.ops.varlen.bwd_dkdv_sm90_ksplit`), the dK/dV tables'
kernel at d = 256 and 192 (`configs.DKDV_CONFIGS`; the plan builds the key tile table with its 64 x 64 blocks), and of
the other key-split configs in ``ALTERNATIVES`` (enabled with ``configs.override(dkdv=cfg)``: every Gluon dK/dV pass
of the process, the tree's included). It checks:

* the plan: `op.bwd_plan` picks the tables' key-split config;
* correctness: `packattn.attention` forward + backward against the float32 reference (tests/gpu
  `check_against_reference`: relative L2 < 1e-2 of out, lse, dq, dk, dv; lse = -inf on the same rows; no NaN) on
  lengths that are not multiples of the blocks, with empty and length-1 sequences and padding between sequences
  (`gluon_bwd_dims_gpu.NASTY_Q` / `NASTY_KV`); bf16 at GQA 32/8 under causal (bottom-right), top-left causal, a
  top-left window, a chunk, a two-sided window, a chunk with a window, no mask; MHA 8/8 causal; fp16 GQA causal;
  every ``ALTERNATIVES`` config causal;
* determinism: the ``deterministic=True`` backward run twice on W1-style lengths is bitwise the same;
* a tree (``backend="triton_tree"``: its dK/dV is the varlen plan's, here the key-split ``TREE`` branch) against the
  float32 reference;
* timing: forward + backward on W1-style lengths (`doc_lengths(16384, 0)`), heads 16/4, bf16, causal: the tables'
  config vs each ``ALTERNATIVES`` config, interleaved (A B A B), median of do_bench timings, TF/s on useful FLOPs
  (``2 (d + d_v) * 3.5`` per visible pair and head, as `packattn bench` counts). A short table last.

    export PYTHONPATH=$PWD; python scripts/ksplit_gpu.py [--dims 256 192] [--no-time] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gluon_bwd_dims_gpu import (
    _case,
    _cfg,
    correctness,
    determinism,
    fwd_bwd,
    make_inputs,
    tree_check,
)
from gluon_fwd_dims_gpu import median_ms

from packattn.bench.workloads import doc_lengths
from packattn.ops.varlen import configs, op
from packattn.ops.varlen.configs import GluonBwdConfig as C
from packattn.varlen import Varlen

# other key-split configs that compile without spills (scripts/check_gluon_ksplit_compile.py), checked (causal, bf16)
# and timed beside the tables' one (the most stages that fit); at 256 no other fits (3 stages: over the shared
# memory), and the two-consumer dK/dV at 192 (32 x 128) spills
ALTERNATIVES = {192: [("dkdv", C(64, 64, 2, 8, key_split=True))]}
MASKS = {"causal": {"causal": True}, "tl-causal": {"causal": "top_left"},
         "tl-window": {"causal": "top_left", "window": (100, 0)}, "chunk": {"chunk_size": 100},
         "window": {"window": (70, 30)}, "chunk-window": {"chunk_size": 128, "window": (50, 0)}, "none": {}}


def table_config(dims) -> C:
    """The dK/dV tables' config at ``dims`` (d_v = d): a key-split one."""
    return configs.DKDV_CONFIGS[dims[0]]


def plan_line(dims) -> tuple[bool, str]:
    seqs = Varlen.from_lengths([1000, 300], device="cuda")
    q, k, v, _ = make_inputs(seqs, (8, 2), dims)
    plan = op.bwd_plan(q, k, v)
    ok = plan.dkdv == table_config(dims) and plan.dkdv.key_split and plan.dkdv_choice == (64, 64, True)
    return ok, f"{'ok  ' if ok else 'FAIL'} plan d={dims[0]}/{dims[1]}: dkdv {plan.dkdv} choice {plan.dkdv_choice}"


def trees(all_dims) -> int:
    bad = 0
    for dims in all_dims:
        def run(dims=dims):
            ok, text = tree_check(dims)
            print(f"     {text}", flush=True)
            assert ok, text

        bad += _case(f"tree d={dims[0]}/{dims[1]} (dK/dV: the key-split TREE branch)", run)
    return bad


def timing(all_dims, repeat: int) -> list[tuple]:
    """f+b ms of the tables' config and of each ``ALTERNATIVES`` one, interleaved ``repeat`` times (median each)."""
    rows = []
    for dims in all_dims:
        lengths = doc_lengths(16384, 0)
        seqs = Varlen.from_lengths(lengths, device="cuda")
        q, k, v, dout = make_inputs(seqs, (16, 4), dims)
        flops = 3.5 * 2 * (dims[0] + dims[1]) * sum(n * (n + 1) // 2 for n in lengths) * 16

        def run(q=q, k=k, v=v, dout=dout, seqs=seqs):
            fwd_bwd(q, k, v, dout, seqs, causal=True)

        variants = [("tables " + _cfg(table_config(dims)), {})]
        variants += [(_cfg(cfg), {name: cfg}) for name, cfg in ALTERNATIVES.get(dims[0], [])]
        times = {label: [] for label, _ in variants}
        for _ in range(repeat):
            for label, forced in variants:
                with configs.override(**forced):
                    times[label].append(median_ms(run))
        base = min(times[variants[0][0]])
        for label, _ in variants:
            ms = min(times[label])
            rows.append((dims, label, ms, flops / ms / 1e9, base / ms))
            print(f"timed d={dims[0]}/{dims[1]} {label}: {' '.join(f'{t:.3f}' for t in times[label])} ms", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[256, 192], choices=[256, 192],
                        help="head dims (d_v = d)")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved timing rounds")
    args = parser.parse_args()
    dims = [(d, d) for d in args.dims]
    started = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bad = correctness(dims, MASKS, ALTERNATIVES, plan_line) + determinism(dims) + trees(dims)
    rows = [] if args.no_time else timing(dims, args.repeat)
    print(f"\n{'dims':9s} {'dK/dV config':26s} {'f+b ms':>8s} {'TF/s':>6s} {'vs tables':>10s}  (W1 16384 tokens, "
          "16/4 heads, causal, bf16; best of the interleaved medians)")
    for d, label, ms, tf, ratio in rows:
        print(f"{d[0]}/{d[1]:<5d} {label:26s} {ms:8.3f} {tf:6.0f} {ratio:10.3f}")
    print(f"{'FAILED' if bad else 'PASSED'}: {bad} failure(s), {time.time() - started:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
