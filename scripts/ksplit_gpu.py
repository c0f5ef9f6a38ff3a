"""GPU check of the key-split Gluon dK/dV kernel (`packattn.ops.varlen.bwd_dkdv_sm90_ksplit`, opt-in) at d = 256 and
192 (``--mla``: and 192/128), enabled with ``configs.override(dkdv=KSPLIT[dims])`` (every Gluon dK/dV pass of the
process, the tree's included; the plan builds the key tile table with its 64 x 64 blocks). It checks:

* the plan: `op.bwd_plan` picks the key-split config;
* correctness: `packattn.attention` forward + backward against the float32 reference (tests/gpu
  `check_against_reference`: relative L2 < 1e-2 of out, lse, dq, dk, dv; lse = -inf on the same rows; no NaN) on
  lengths that are not multiples of the blocks, with empty and length-1 sequences and padding between sequences
  (`gluon_bwd_dims_gpu.NASTY_Q` / `NASTY_KV`); bf16 at GQA 32/8 under causal (bottom-right), top-left causal, a
  top-left window, a chunk, a two-sided window, a chunk with a window, no mask; MHA 8/8 causal; fp16 GQA causal;
  every ``ALTERNATIVES`` config causal; and dK / dV against the default kernel's (relative L2, informative);
* determinism: the ``deterministic=True`` backward run twice on W1-style lengths is bitwise the same;
* a tree (``backend="triton_tree"``: its dK/dV is the varlen plan's, here the key-split ``TREE`` branch) against the
  float32 reference;
* timing: forward + backward on W1-style lengths (`doc_lengths(16384, 0)`), heads 16/4, bf16, causal: the default
  tables vs the key split, interleaved (A B A B), median of do_bench timings, TF/s on useful FLOPs (``2 (d + d_v)
  * 3.5`` per visible pair and head, as `packattn bench` counts). A short table last.

    export PYTHONPATH=$PWD; python scripts/ksplit_gpu.py [--dims 256 192] [--mla] [--no-time] [--repeat 2]
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
    NASTY_KV,
    NASTY_Q,
    determinism,
    fwd_bwd,
    make_inputs,
    parse_dims,
    tree_check,
)
from gluon_fwd_dims_gpu import median_ms

from packattn.bench.workloads import doc_lengths
from packattn.ops.varlen import configs, op
from packattn.ops.varlen.configs import GluonBwdConfig as C
from packattn.varlen import Varlen

# the key-split config per dims (the most stages that fit: scripts/check_gluon_ksplit_compile.py) and others that
# compile without spills, checked (causal, bf16) and timed beside it
KSPLIT = {(256, 256): C(64, 64, 2, 8, key_split=True), (192, 192): C(64, 64, 3, 8, key_split=True),
          (192, 128): C(64, 64, 3, 8, key_split=True)}
ALTERNATIVES = {(192, 192): [C(64, 64, 2, 8, key_split=True)], (192, 128): [C(64, 64, 2, 8, key_split=True)]}
MASKS = {"causal": {"causal": True}, "tl-causal": {"causal": "top_left"},
         "tl-window": {"causal": "top_left", "window": (100, 0)}, "chunk": {"chunk_size": 100},
         "window": {"window": (70, 30)}, "chunk-window": {"chunk_size": 128, "window": (50, 0)}, "none": {}}


def _cfg(cfg) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.stages}w{cfg.num_warps}{' ksplit' if cfg.key_split else ''}"


def _key(dims):
    return dims[0] if dims[0] == dims[1] else dims


def _case(label: str, fn) -> int:
    """Run one check; print ok / FAIL; return the failures (0 or 1)."""
    try:
        fn()
        print(f"ok   {label}", flush=True)
        return 0
    except Exception as e:  # an assertion, or a launch that raised: report and go on
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 1


def plan_line(dims, cfg) -> tuple[bool, str]:
    seqs = Varlen.from_lengths([1000, 300], device="cuda")
    q, k, v, _ = make_inputs(seqs, (8, 2), dims)
    with configs.override(dkdv=cfg):
        plan = op.bwd_plan(q, k, v)
    ok = plan.dkdv == cfg and plan.dkdv_choice == (64, 64, True)
    return ok, f"{'ok  ' if ok else 'FAIL'} plan d={dims[0]}/{dims[1]}: dkdv {plan.dkdv} choice {plan.dkdv_choice}"


def against_default(seqs, dims) -> str:
    """Relative L2 of the key split's dK / dV against the default kernel's on the same inputs (bf16 both)."""
    from tests.gpu.test_triton_varlen_gpu import rel_l2

    q, k, v, dout = make_inputs(seqs, (32, 8), dims, seed=3)
    base = fwd_bwd(q, k, v, dout, seqs, causal=True)
    with configs.override(dkdv=KSPLIT[dims]):
        new = fwd_bwd(q, k, v, dout, seqs, causal=True)
    return f"dk {rel_l2(new[2], base[2]):.1e} dv {rel_l2(new[3], base[3]):.1e}"


def correctness(all_dims) -> int:
    from tests.gpu.test_triton_varlen_gpu import check_against_reference

    seqs = Varlen.from_lengths(NASTY_Q, NASTY_KV, pad_to_multiple=16, device="cuda")
    bad = 0
    for dims in all_dims:
        ok, text = plan_line(dims, KSPLIT[dims])
        bad += not ok
        print(text, flush=True)
        cases = [(KSPLIT[dims], torch.bfloat16, (32, 8), m) for m in MASKS]
        cases += [(KSPLIT[dims], torch.bfloat16, (8, 8), "causal"), (KSPLIT[dims], torch.float16, (32, 8), "causal")]
        cases += [(cfg, torch.bfloat16, (32, 8), "causal") for cfg in ALTERNATIVES.get(dims, [])]
        for cfg, dtype, heads, mask in cases:
            label = f"d={dims[0]}/{dims[1]:<4d} {_cfg(cfg)} {str(dtype)[6:]:8s} {heads[0]}/{heads[1]:<2d} {mask}"

            def run(cfg=cfg, dtype=dtype, heads=heads, mask=mask, dims=dims):
                with configs.override(dkdv=cfg):
                    check_against_reference(*make_inputs(seqs, heads, dims, dtype), seqs, **MASKS[mask])

            bad += _case(label, run)
        print(f"info d={dims[0]}/{dims[1]} key split vs default dK/dV (causal, 32/8): {against_default(seqs, dims)}",
              flush=True)
    return bad


def trees(all_dims) -> int:
    bad = 0
    for dims in [d for d in all_dims if d[0] == d[1]]:  # the tree kernels refuse MLA
        def run(dims=dims):
            with configs.override(dkdv=KSPLIT[dims]):
                ok, text = tree_check(dims)
            print(f"     {text}", flush=True)
            assert ok, text

        bad += _case(f"tree d={dims[0]}/{dims[1]} (dK/dV: the key-split TREE branch)", run)
    return bad


def timing(all_dims, repeat: int) -> list[tuple]:
    """f+b ms of the default tables and of each key-split config, interleaved ``repeat`` times (median each)."""
    rows = []
    for dims in all_dims:
        lengths = doc_lengths(16384, 0)
        seqs = Varlen.from_lengths(lengths, device="cuda")
        q, k, v, dout = make_inputs(seqs, (16, 4), dims)
        flops = 3.5 * 2 * (dims[0] + dims[1]) * sum(n * (n + 1) // 2 for n in lengths) * 16

        def run(q=q, k=k, v=v, dout=dout, seqs=seqs):
            fwd_bwd(q, k, v, dout, seqs, causal=True)

        variants = [("default " + _cfg(configs.DKDV_CONFIGS[_key(dims)]), {})]
        variants += [(_cfg(cfg), {"dkdv": cfg}) for cfg in [KSPLIT[dims], *ALTERNATIVES.get(dims, [])]]
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
    parser.add_argument("--dims", nargs="+", type=parse_dims, default=[(256, 256), (192, 192)])
    parser.add_argument("--mla", action="store_true", help="also 192/128")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved timing rounds")
    args = parser.parse_args()
    dims = args.dims + ([(192, 128)] if args.mla else [])
    started = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bad = correctness(dims) + determinism(dims, lambda d: {"dkdv": KSPLIT[d]}) + trees(dims)
    rows = [] if args.no_time else timing(dims, args.repeat)
    print(f"\n{'dims':9s} {'dK/dV config':26s} {'f+b ms':>8s} {'TF/s':>6s} {'vs default':>10s}  (W1 16384 tokens, "
          "16/4 heads, causal, bf16; best of the interleaved medians)")
    for d, label, ms, tf, ratio in rows:
        print(f"{d[0]}/{d[1]:<5d} {label:26s} {ms:8.3f} {tf:6.0f} {ratio:10.3f}")
    print(f"{'FAILED' if bad else 'PASSED'}: {bad} failure(s), {time.time() - started:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
