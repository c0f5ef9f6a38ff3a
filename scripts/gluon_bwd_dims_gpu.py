"""GPU check of the warp-specialised Gluon backward at head dims in column parts and with a value head dim of its own
(`packattn.ops.varlen.bwd_dkdv_sm90_parts`, `bwd_dq_sm90_parts`): d = 96, 192, MLA 192/128 and 128/64.

The default tables (`configs.DKDV_CONFIGS` / `DQ_CONFIGS`) run these dims on the part kernels (dK/dV at d = 192: the
key-split kernel, `bwd_dkdv_sm90_ksplit`, also checked by scripts/ksplit_gpu.py); the script checks:

* the plan: `op.bwd_plan` picks the Gluon passes and `op.fuses_delta` as the dQ config says (`fused_delta`: the dQ
  computes delta);
* correctness: `packattn.attention` forward + backward against the float32 reference (tests/gpu
  `check_against_reference`: relative L2 < 1e-2 of out, lse, dq, dk, dv; lse = -inf on the same rows; no NaN) on
  lengths that are not multiples of the blocks, with empty and length-1 sequences and padding between
  sequences; bf16: causal, top-left causal with a window, a chunk, a two-sided window, no mask at GQA 32/8, and
  causal at MHA 8/8; fp16: causal at GQA;
* determinism: the ``deterministic=True`` backward run twice on W1-style lengths is bitwise the same;
* a tree (``backend="triton_tree"``, whose dK/dV follows the varlen plan: the ``TREE`` branch of the part kernel at
  96, of the key-split kernel at 192) against the float32 reference (the tree kernels refuse MLA);
* timing: forward + backward on W1-style lengths (`doc_lengths(32768, 0)`, 16384 tokens for d >= 192), heads
  16/4, bf16, causal, with the tables (Gluon backward) and under `triton_bwd_tables` (the Triton backward; the
  forward is Gluon in both), median of do_bench timings, TF/s on useful FLOPs (``2 (d + d_v) * 3.5`` per visible
  pair and head: the forward's and the backward's 2.5 times as many, as `packattn bench` counts).

    export PYTHONPATH=$PWD; python scripts/gluon_bwd_dims_gpu.py [--dims 96 192 192:128 128:64] [--no-time]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import packattn  # noqa: E402
from packattn.bench.workloads import doc_lengths  # noqa: E402
from packattn.ops.varlen import configs, op  # noqa: E402
from packattn.ops.varlen.configs import GluonBwdConfig as C  # noqa: E402
from packattn.varlen import Varlen  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_fwd_dims_gpu import median_ms  # noqa: E402  (one timing helper for both scripts)

DIMS = [(96, 96), (192, 192), (192, 128), (128, 64)]
KEYS = [d if d == dv else (d, dv) for d, dv in DIMS]
DKDV = {k: configs.DKDV_CONFIGS[k] for k in KEYS}  # the tables' configs (NOTES.md, v35)
DQ = {k: configs.DQ_CONFIGS[k] for k in KEYS}
# other configs that compile without spills (scripts/check_gluon_bwd_parts_compile.py), checked (causal, bf16) and
# timed beside the tables' ones: (pass, config) per dims; within 1% of the tables' configs on W1 lengths (v35)
ALTERNATIVES = {96: [("dkdv", C(64, 64, 2, 4))], (128, 64): [("dkdv", C(64, 64, 2, 4))]}


def triton_bwd_tables() -> dict:
    """The `configs.override` keywords under which the backward at `DIMS` runs the Triton passes (the baseline)."""
    return dict(GLUON_HEAD_DIMS=tuple(d for d in configs.GLUON_HEAD_DIMS if d not in KEYS),
                DKDV_CONFIGS={k: c for k, c in configs.DKDV_CONFIGS.items() if k not in KEYS},
                DQ_CONFIGS={k: c for k, c in configs.DQ_CONFIGS.items() if k not in KEYS})


MASKS = {"causal": {"causal": True}, "tl-window": {"causal": "top_left", "window": (100, 0)},
         "chunk": {"chunk_size": 100}, "window": {"window": (70, 30)}, "none": {}}
NASTY_Q = [300, 1, 0, 64, 65, 500, 129, 37, 1000]
NASTY_KV = [200, 5, 40, 64, 1, 500, 300, 0, 1100]


def parse_dims(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(":")]
    return parts[0], parts[-1]


def key(dims):
    return dims[0] if dims[0] == dims[1] else dims


def make_inputs(seqs: Varlen, heads, dims, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    (hq, hkv), (d, dv) = heads, dims

    def rand(rows, h, width, grad=True):
        x = torch.randn(rows, h, width, device="cuda", generator=gen).to(dtype)
        return x.requires_grad_() if grad else x

    return (rand(seqs.total_q, hq, d), rand(seqs.total_kv, hkv, d), rand(seqs.total_kv, hkv, dv),
            rand(seqs.total_q, hq, dv, grad=False))


def plan_line(dims) -> tuple[bool, str]:
    seqs = Varlen.from_lengths([1000, 300], device="cuda")
    q, k, v, _ = make_inputs(seqs, (8, 2), dims)
    plan = op.bwd_plan(q, k, v)
    want = (DKDV[key(dims)], DQ[key(dims)])
    ok = (plan.dkdv, plan.dq) == want and op.fuses_delta(plan, None) == plan.dq.fused_delta
    return ok, (f"{'ok  ' if ok else 'FAIL'} plan d={dims[0]}/{dims[1]}: dkdv {plan.dkdv} dq {plan.dq} "
                f"fuses_delta {op.fuses_delta(plan, None)}")


def correctness(all_dims, masks=MASKS, alternatives=ALTERNATIVES, plan=plan_line) -> int:
    """Per dims: the ``plan`` line, then the tables' configs against the reference (bf16 GQA 32/8 under each of
    ``masks``, name -> mask keywords with a ``"causal"``; causal at MHA 8/8 and fp16 GQA) and each ``alternatives``
    ``(pass, config)`` of ``key(dims)`` (bf16 GQA causal, under ``configs.override``); the count of failures."""
    from tests.gpu.test_triton_varlen_gpu import check_against_reference

    seqs = Varlen.from_lengths(NASTY_Q, NASTY_KV, pad_to_multiple=16, device="cuda")
    bad = 0
    for dims in all_dims:
        ok, text = plan(dims)
        bad += not ok
        print(text, flush=True)
        cases = [(torch.bfloat16, (32, 8), m, {}) for m in masks] + [(torch.bfloat16, (8, 8), "causal", {}),
                                                                     (torch.float16, (32, 8), "causal", {})]
        cases += [(torch.bfloat16, (32, 8), "causal", {name: cfg}) for name, cfg in alternatives.get(key(dims), [])]
        for dtype, heads, mask, forced in cases:
            which = " ".join(f"{name} {_cfg(cfg)}" for name, cfg in forced.items()) or "tables"
            label = f"d={dims[0]}/{dims[1]:<4d} {which:18s} {str(dtype)[6:]:8s} {heads[0]}/{heads[1]:<2d} {mask}"

            def run(dtype=dtype, heads=heads, mask=mask, forced=forced, dims=dims):
                with configs.override(**forced):
                    check_against_reference(*make_inputs(seqs, heads, dims, dtype), seqs, **masks[mask])

            bad += _case(label, run)
    return bad


def _case(label: str, fn) -> int:
    """Run one check; print ok / FAIL; return the failures (0 or 1)."""
    try:
        fn()
        print(f"ok   {label}", flush=True)
        return 0
    except Exception as e:  # an assertion, or a launch that raised: report and go on
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 1


def _cfg(cfg) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.stages}w{cfg.num_warps}{' ksplit' if cfg.key_split else ''}"


def tree_check(dims) -> tuple[bool, str]:
    """A packed trie (GRPO-style) through ``backend="triton_tree"``: its dK/dV is the varlen plan's (the ``TREE``
    branch of the tables' dK/dV kernel at ``dims``), against the float32 reference."""
    from packattn.bench.workloads import grpo_sequences
    from packattn.tree import Tree
    from tests.gpu.test_triton_varlen_gpu import rel_l2

    tree = Tree.from_sequences(grpo_sequences(2, 300, 4, 150), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tree.total, h, w, device="cuda", generator=gen).bfloat16().requires_grad_()
               for h, w in ((8, dims[0]), (2, dims[0]), (2, dims[1])))
    dout = torch.randn(tree.total, 8, dims[1], device="cuda", generator=gen).bfloat16()
    out = packattn.attention(q, k, v, tree, backend="triton_tree")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = packattn.attention(*leaves, tree, backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    errors = {name: rel_l2(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    ok = all(e < 1e-2 for e in errors.values())
    return ok, f"{'ok  ' if ok else 'FAIL'} tree d={dims[0]}/{dims[1]} (dK/dV TREE branch) " + \
        " ".join(f"{n} {e:.1e}" for n, e in errors.items())


def fwd_bwd(q, k, v, dout, seqs, **opts):
    out = packattn.attention(q, k, v, seqs, backend="triton", **opts)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def determinism(all_dims, overrides=lambda dims: {}) -> int:
    """The ``deterministic=True`` forward + backward twice per dims (under ``configs.override(**overrides(dims))``):
    bitwise the same; the count of failures."""
    bad = 0
    for dims in all_dims:
        seqs = Varlen.from_lengths(doc_lengths(8192, seed=1), pad_to_multiple=64, device="cuda")
        q, k, v, dout = make_inputs(seqs, (16, 4), dims)
        with configs.override(**overrides(dims)):
            first = fwd_bwd(q, k, v, dout, seqs, causal=True, deterministic=True)
            second = fwd_bwd(q, k, v, dout, seqs, causal=True, deterministic=True)
        same = all(torch.equal(a, b) for a, b in zip(first, second))
        bad += not same
        print(f"{'ok  ' if same else 'FAIL'} deterministic backward bitwise twice d={dims[0]}/{dims[1]}", flush=True)
    return bad




def timing(all_dims) -> list[tuple]:
    rows = []
    for dims in all_dims:
        lengths = doc_lengths(16384 if dims[0] >= 192 else 32768, 0)
        seqs = Varlen.from_lengths(lengths, device="cuda")
        q, k, v, dout = make_inputs(seqs, (16, 4), dims)
        flops = 3.5 * 2 * (dims[0] + dims[1]) * sum(n * (n + 1) // 2 for n in lengths) * 16

        def run(q=q, k=k, v=v, dout=dout, seqs=seqs):
            fwd_bwd(q, k, v, dout, seqs, causal=True)

        with configs.override(**triton_bwd_tables()):
            t_ms = median_ms(run)  # Gluon forward, Triton backward
        variants = [({}, f"{_cfg(DKDV[key(dims)])} / {_cfg(DQ[key(dims)])}")]
        variants += [({name: cfg}, f"{name} {_cfg(cfg)}") for name, cfg in ALTERNATIVES.get(key(dims), [])]
        for forced, label in variants:
            with configs.override(**forced):
                g_ms = median_ms(run)
            rows.append((dims, label, g_ms, flops / g_ms / 1e9, t_ms, flops / t_ms / 1e9))
            print(f"timed d={dims[0]}/{dims[1]} {label}: gluon bwd {g_ms:.3f} ms, triton bwd {t_ms:.3f} ms",
                  flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=parse_dims, default=DIMS)
    parser.add_argument("--no-time", action="store_true")
    args = parser.parse_args()
    started = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bad = correctness(args.dims)
    bad += determinism(args.dims)
    for dims in [d for d in args.dims if d in ((96, 96), (192, 192))]:
        ok, text = tree_check(dims)
        bad += not ok
        print(text, flush=True)
    rows = [] if args.no_time else timing(args.dims)
    print(f"\n{'dims':9s} {'config dkdv / dq':24s} {'gluon ms':>9s} {'TF/s':>6s} {'triton ms':>9s} {'TF/s':>6s} "
          f"{'ratio':>6s}  (f+b, Gluon forward in both)")
    for dims, label, g_ms, g_tf, t_ms, t_tf in rows:
        print(f"{dims[0]}/{dims[1]:<5d} {label:24s} {g_ms:9.3f} {g_tf:6.0f} {t_ms:9.3f} {t_tf:6.0f} {t_ms / g_ms:6.2f}")
    print(f"{'FAILED' if bad else 'PASSED'}: {bad} failure(s), {time.time() - started:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
