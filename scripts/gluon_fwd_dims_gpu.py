"""GPU check of the warp-specialised Gluon forward at the head dims it runs in column parts or with a value head
dim of its own (`packattn.ops.varlen.fwd_sm90_parts`): d = 96, 192, MLA 192/128 and 128/64.

Correctness: `launch_sm90.gluon_fwd` called directly (no dispatch gating involved) on outputs poisoned with NaN,
against a float64 reference on the GPU whose visibility matrix is the oracle's (tests/oracle.py `oracle_mask`;
the reference itself is checked against `oracle_attention` on a small case first). Lengths not multiples of the
blocks, an empty query sequence, a length-1 one, sequences with fewer / more keys than queries (so top-left and
bottom-right causal differ, and some rows see no key); bf16: causal both alignments, no mask, a window, GQA 32/8
and MHA 8/8; fp16: causal. Checks: no NaN left (every row of a sequence written), lse = -inf exactly where the
reference's is, relative L2 error of out and max |lse error| within bounds; under the causal mask the Triton
forward's errors on the same inputs are printed beside them. The table config (`configs.CONFIGS`) is checked
first, each dim's other candidate configs (causal, bf16) after it, before they are timed. Expect ~1-2 minutes on
an H100, most of it compiling (~25 Gluon variants).

Timing: W1-style lengths (`doc_lengths(32768, 0)`, 16384 tokens for d >= 192), heads 16/4, bf16, causal: each
candidate config of `CANDIDATES` against the Triton forward (`launch_triton.triton_fwd`, its Hopper config) at
the same dims, median of CUDA-event timings, TF/s on useful FLOPs (``2 (d + d_v)`` per visible pair and head).
Last: whether the dispatch plan (`op.forward_plan`) picks the Gluon forward at these dims yet (the gating change
proposed with this script), and if so that ``packattn.attention`` gives the direct call's output bit for bit.

    export PYTHONPATH=$PWD; python scripts/gluon_fwd_dims_gpu.py [--dims 96 192 192:128 128:64] [--no-time]

``--opt-in``: instead, the variants of `OPT_IN` (lazy rescaling, `GluonConfig.rescale_threshold`; separate K / V
barriers, `GluonConfig.split_kv`; Q in registers, `q_in_regs`; 16-byte output stores, `vec_store`; other tiles) on
each dim's table config, at the forward head dims each names (64, 96, 128, 192, 256, MLA) and masks (causal both
alignments, none, window, chunk), on plain inputs and on "ramp" inputs whose scores grow along the keys (q x 2, key
t of a sequence x (1 + 3 t / len): the running max moves by more than the threshold, so the rescale branch runs
both ways), fp16 causal too; each line gives the table config's errors beside. ``--only`` names variants of `OPT_IN`.

    export PYTHONPATH=$PWD; python scripts/gluon_fwd_dims_gpu.py --opt-in [--dims 64 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from oracle import oracle_attention, oracle_mask  # noqa: E402

import packattn  # noqa: E402
from packattn.bench.workloads import doc_lengths  # noqa: E402
from packattn.mask import Mask  # noqa: E402
from packattn.ops.runtime.sm90 import dims_key  # noqa: E402
from packattn.ops.varlen import configs, launch_sm90, launch_triton, op  # noqa: E402
from packattn.ops.varlen.configs import GluonConfig  # noqa: E402
from packattn.ops.varlen.tiles import tile_table  # noqa: E402
from packattn.varlen import Varlen  # noqa: E402

# (q/k, v) head dims -> candidate configs to time (scripts/check_gluon_compile.py: no spills); the table config
# (`table_config`) is what the correctness cases and the plan check run first
CANDIDATES = {
    (96, 96): [GluonConfig(128, 128, 4, 8), GluonConfig(128, 128, 3, 8)],
    (192, 192): [GluonConfig(128, 64, 3, 8), GluonConfig(128, 64, 2, 8)],
    (192, 128): [GluonConfig(128, 64, 4, 8), GluonConfig(128, 128, 2, 8)],  # 128x128x2 spills under windows
    (128, 64): [GluonConfig(128, 128, 4, 8), GluonConfig(128, 128, 3, 8)],
}
LENGTHS_Q = [0, 1, 37, 200, 129, 333, 64, 17, 700]
LENGTHS_KV = [5, 1, 37, 260, 129, 333, 40, 17, 700]
MASKS = {"causal": {"causal": True}, "causal-tl": {"causal": "top_left"}, "none": {}, "window": {"window": (100, 30)},
         "chunk": {"causal": True, "chunk_size": 96}}
# --opt-in: variant -> (GluonConfig fields, the dims it runs at (None: all), masks)
OPT_IN = {
    "lazy8": ({"rescale_threshold": 8.0}, None, ("causal", "causal-tl", "none", "window", "chunk")),
    "lazy0": ({"rescale_threshold": 0.0}, ((64, 64), (256, 256), (192, 128)), ("causal", "window")),
    "split": ({"split_kv": True}, None, ("causal", "causal-tl", "window", "chunk")),
    "split-k64": ({"block_n": 64, "stages": 2, "split_kv": True}, ((256, 256),), ("causal", "none", "window")),
    "split-trim": ({"block_n": 64, "stages": 4, "trim": True, "split_kv": True}, ((128, 128),),
                   ("causal", "window", "chunk")),
    "qregs": ({"q_in_regs": True}, ((64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (128, 64)),
              ("causal", "window", "chunk")),
    "qregs-trim": ({"block_n": 64, "stages": 4, "trim": True, "q_in_regs": True}, ((128, 128), ),
                   ("causal", "window")),
    "qregs-split": ({"q_in_regs": True, "split_kv": True}, ((128, 128), (192, 192)), ("causal", "chunk")),
    "vec": ({"vec_store": True}, ((64, 64), (96, 96), (192, 192), (256, 256), (192, 128)),
            ("causal", "causal-tl", "none", "window", "chunk")),
    "vec-s3": ({"vec_store": True, "stages": 3}, ((128, 64),), ("causal", "window", "chunk")),
}
ALL_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64)]
TOL = {torch.bfloat16: (1e-2, 1e-3), torch.float16: (3e-3, 1e-3)}  # (rel L2 of out, max |lse error|)
_MASK_CACHE: dict = {}
DEVICE = "cuda"


def parse_dims(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(":")]
    return parts[0], parts[-1]


def inputs(seqs: Varlen, heads: tuple[int, int], dims: tuple[int, int], dtype, seed: int = 0, ramp: bool = False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    (hq, hkv), (d, dv) = heads, dims
    q = torch.randn(seqs.total_q, hq, d, device=DEVICE, generator=gen)
    k = torch.randn(seqs.total_kv, hkv, d, device=DEVICE, generator=gen)
    v = torch.randn(seqs.total_kv, hkv, dv, device=DEVICE, generator=gen)
    if ramp:  # scores that grow along each sequence's keys: the running max keeps moving
        lengths = seqs.cu_seqlens_kv.diff().tolist()
        pos = torch.cat([torch.arange(n, device=DEVICE) / max(n, 1) for n in lengths])
        q, k = q * 2, k * (1 + 3 * pos)[:, None, None]
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, lengths_q, lengths_kv, mask_kw: dict, scale: float):
    """float64 ``(out, lse)``: dense attention per sequence under the oracle's visibility matrix."""
    hq, dv = q.shape[1], v.shape[2]
    group = hq // k.shape[1]
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    sq = sk = 0
    for lq, lk in zip(lengths_q, lengths_kv):
        key = (lq, lk, tuple(sorted(mask_kw.items())))
        if key not in _MASK_CACHE:
            _MASK_CACHE[key] = oracle_mask(lq, lk, **mask_kw).to(q.device)
        vis = _MASK_CACHE[key]
        if lq and lk:
            qs = q[sq:sq + lq].double().transpose(0, 1)
            ks = k[sk:sk + lk].double().repeat_interleave(group, 1).transpose(0, 1)
            vs = v[sk:sk + lk].double().repeat_interleave(group, 1).transpose(0, 1)
            s = (qs @ ks.transpose(1, 2) * scale).masked_fill(~vis, float("-inf"))
            m = s.amax(-1, keepdim=True)
            seen = torch.isfinite(m)
            p = torch.where(seen, torch.exp(s - torch.where(seen, m, 0.0)), 0.0)
            z = p.sum(-1, keepdim=True)
            out[sq:sq + lq] = (p / torch.where(seen, z, 1.0) @ vs).transpose(0, 1)
            lse[:, sq:sq + lq] = torch.where(seen, m + torch.log(z), float("-inf")).squeeze(-1)
        sq, sk = sq + lq, sk + lk
    return out, lse


def run_gluon(q, k, v, seqs: Varlen, mask: Mask, cfg: GluonConfig, scale: float):
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device=q.device)
    seq_args = (seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv)
    tiles = tile_table(seqs, mask, False, cfg.block_m, cfg.block_n)
    launch_sm90.gluon_fwd(q, k, v, out, lse, seq_args, tiles, scale, mask, cfg)
    return out, lse


def run_triton(q, k, v, seqs: Varlen, mask: Mask, scale: float):
    long_seqs = seqs.max_seqlen_q >= configs.LONG_SEQLEN
    tc = configs.triton_config("fwd", q, v, long_seqs)
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device=q.device)
    seq_args = (seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.offsets_q, seqs.offsets_kv)
    tiles = tile_table(seqs, mask, False, tc.block_m, tc.block_n)
    launch_triton.triton_fwd(q, k, v, out, lse, seq_args, tiles, scale, mask, long_seqs)
    return out, lse


def errors(out, lse, ref_out, ref_lse) -> tuple[str | None, float, float]:
    """``(problem or None, rel L2 of out, max |lse error|)``."""
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return "NaN left (a row not written, or NaN computed)", math.inf, math.inf
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        return "lse = -inf on other rows than the reference's", math.inf, math.inf
    rel = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    fin = torch.isfinite(ref_lse)
    lse_err = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    return None, rel, lse_err


def check_case(dims, cfg, dtype, heads, mask_name, seqs, ramp: bool = False, beside=None) -> tuple[bool, str]:
    """One correctness case; ``beside``: a config whose errors on the same inputs are printed beside (instead of
    the Triton forward's under the causal mask)."""
    mask_kw = MASKS[mask_name]
    mask = Mask.make(**mask_kw)
    q, k, v = inputs(seqs, heads, dims, dtype, ramp=ramp)
    scale = 1.0 / math.sqrt(dims[0])
    ref_out, ref_lse = reference(q, k, v, LENGTHS_Q, LENGTHS_KV, mask_kw, scale)
    problem, rel, lse_err = errors(*run_gluon(q, k, v, seqs, mask, cfg, scale), ref_out, ref_lse)
    tol_out, tol_lse = TOL[dtype]
    ok = problem is None and rel <= tol_out and lse_err <= tol_lse
    name = f"d={dims[0]}/{dims[1]:<4d} {_cfg(cfg):10s} {str(dtype)[6:]:8s} {f'{heads[0]}/{heads[1]}':5s} {mask_name:9s}"
    text = f"{'ok  ' if ok else 'FAIL'} {name}{' ramp' if ramp else ''} out rel L2 {rel:.2e} lse err {lse_err:.1e}"
    if beside is not None:
        _, b_rel, b_lse = errors(*run_gluon(q, k, v, seqs, mask, beside, scale), ref_out, ref_lse)
        text += f" (table config: {b_rel:.2e}, {b_lse:.1e})"
    elif mask_name == "causal":  # the Triton forward's errors beside (one Triton compile per dim and dtype)
        _, t_rel, t_lse = errors(*run_triton(q, k, v, seqs, mask, scale), ref_out, ref_lse)
        text += f" (triton: {t_rel:.2e}, {t_lse:.1e})"
    return ok, text + (f" {problem}" if problem else "")


def check_reference_against_oracle() -> None:
    """The dense reference equals `oracle_attention` (float64, CPU) on a small MLA case with causal rows that
    see no key."""
    lq, lk = [1, 37, 64], [1, 37, 40]
    seqs = Varlen.from_lengths(lq, lk, device=DEVICE)
    q, k, v = inputs(seqs, (4, 2), (48, 32), torch.float64)
    ref = reference(q, k, v, lq, lk, {"causal": True}, 0.2)
    starts_q = [0, 1, 38]
    starts_kv = [0, 1, 38]
    orc = oracle_attention(q.cpu(), k.cpu(), v.cpu(), lq, lk, starts_q, starts_kv, sum(lq), causal=True, scale=0.2)
    err = max((a.cpu() - b).abs().nan_to_num(0.0).max().item() for a, b in zip(ref, orc))
    same_inf = torch.equal(torch.isneginf(ref[1].cpu()), torch.isneginf(orc[1]))
    assert err < 1e-10 and same_inf, f"reference differs from the oracle: {err}"
    print(f"reference == oracle_attention (max diff {err:.1e})", flush=True)


def table_config(dims) -> GluonConfig:
    return configs.CONFIGS[dims_key(*dims)]


def correctness(all_dims) -> int:
    seqs = Varlen.from_lengths(LENGTHS_Q, LENGTHS_KV, device=DEVICE)
    cases = []
    for dims in all_dims:
        first = table_config(dims)  # what the dispatch runs, then the other candidates
        others = [cfg for cfg in CANDIDATES[dims] if cfg != first]
        cases += [(dims, first, torch.bfloat16, heads, m) for m in MASKS for heads in ((32, 8), (8, 8))
                  if heads == (32, 8) or m == "causal"]
        cases += [(dims, first, torch.float16, (32, 8), "causal")]
        cases += [(dims, cfg, torch.bfloat16, (32, 8), "causal") for cfg in others]
    bad = 0
    for case in cases:
        ok, text = check_case(*case, seqs)
        bad += not ok
        print(text, flush=True)
    print(f"{len(cases) - bad} of {len(cases)} correctness cases ok", flush=True)
    return bad


def opt_in_correctness(all_dims, only=None) -> int:
    """`OPT_IN` variants (``only``: those named) on each dim's table config against the float64 reference (module
    docstring)."""
    seqs = Varlen.from_lengths(LENGTHS_Q, LENGTHS_KV, device=DEVICE)
    cases = []
    for name, (fields, dims_list, masks) in OPT_IN.items():
        if only is not None and name not in only:
            continue
        for dims in all_dims:
            if dims_list is not None and dims not in dims_list:
                continue
            base = table_config(dims)
            cfg = dataclasses.replace(base, **fields)
            cases += [(dims, cfg, torch.bfloat16, (32, 8), m, False, base) for m in masks]
            cases += [(dims, cfg, torch.bfloat16, (32, 8), "causal", True, base),
                      (dims, cfg, torch.float16, (8, 8), "causal", True, base)]
    bad = 0
    for dims, cfg, dtype, heads, mask_name, ramp, base in cases:
        ok, text = check_case(dims, cfg, dtype, heads, mask_name, seqs, ramp, base)
        bad += not ok
        print(text, flush=True)
    print(f"{len(cases) - bad} of {len(cases)} opt-in correctness cases ok", flush=True)
    return bad


def _cfg(cfg: GluonConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.stages}" + ("t" if cfg.trim else "")
            + ("" if cfg.rescale_threshold is None else f" lazy{cfg.rescale_threshold:g}")
            + (" split" if cfg.split_kv else "") + (" qregs" if cfg.q_in_regs else "")
            + (" vec" if cfg.vec_store else ""))


def median_ms(fn) -> float:
    """Median ms of ``fn`` (triton.testing.do_bench: CUDA events, the L2 cache flushed before each call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def timing(all_dims) -> list[tuple]:
    rows = []
    for dims in all_dims:
        total = 16384 if dims[0] >= 192 else 32768
        lengths = doc_lengths(total, 0)
        seqs = Varlen.from_lengths(lengths, device=DEVICE)
        q, k, v = inputs(seqs, (16, 4), dims, torch.bfloat16)
        mask, scale = Mask.make(causal=True), 1.0 / math.sqrt(dims[0])
        flops = 2 * (dims[0] + dims[1]) * sum(n * (n + 1) // 2 for n in lengths) * 16
        args = (q, k, v, seqs, mask)
        t_ms = median_ms(lambda args=args, scale=scale: run_triton(*args, scale))
        for cfg in CANDIDATES[dims]:
            g_ms = median_ms(lambda args=args, cfg=cfg, scale=scale: run_gluon(*args, cfg, scale))
            rows.append((dims, _cfg(cfg), g_ms, flops / g_ms / 1e9, t_ms, flops / t_ms / 1e9))
            print(f"timed d={dims[0]}/{dims[1]} {_cfg(cfg)}: gluon {g_ms:.3f} ms, triton {t_ms:.3f} ms", flush=True)
    return rows


def plan_check(all_dims) -> list[str]:
    """Does `op.forward_plan` pick the Gluon forward at these dims (under ``override(fwd=...)``), and does
    ``packattn.attention`` then give the direct call's output?"""
    lines = []
    seqs = Varlen.from_lengths(LENGTHS_Q, LENGTHS_KV, device=DEVICE)
    mask = Mask.make(causal=True)
    for dims in all_dims:
        cfg = table_config(dims)
        q, k, v = inputs(seqs, (32, 8), dims, torch.bfloat16)
        with configs.override(fwd=cfg):
            _, options = op.forward_plan(q, k, v, seqs, mask, False)
            gluon = bool(options[op.FWD_OPTIONS.index("gluon")])
            text = f"plan d={dims[0]}/{dims[1]}: {'Gluon' if gluon else 'Triton (the gating does not take these dims)'}"
            if gluon:
                got = packattn.attention(q, k, v, seqs, causal=True, backend="triton")
                want, _ = run_gluon(q, k, v, seqs, mask, cfg, 1.0 / math.sqrt(dims[0]))
                text += f", packattn.attention == direct call: {torch.equal(got, want)}"
        lines.append(text)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=parse_dims, default=list(CANDIDATES))
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--opt-in", action="store_true", help="check the opt-in variants (OPT_IN) instead")
    parser.add_argument("--only", nargs="+", default=None, choices=list(OPT_IN),
                        help="with --opt-in: these OPT_IN variants")
    args = parser.parse_args()
    if args.only and not args.opt_in:
        parser.error("--only names --opt-in variants")
    started = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    check_reference_against_oracle()
    if args.opt_in:
        bad = opt_in_correctness(args.dims if "--dims" in sys.argv else ALL_DIMS, args.only)
        print(f"{'FAILED' if bad else 'PASSED'}: {bad} correctness failure(s), {time.time() - started:.0f} s")
        return 1 if bad else 0
    bad = correctness(args.dims)
    rows = [] if args.no_time else timing(args.dims)
    plans = plan_check(args.dims)
    print(f"\n{'dims':9s} {'config':12s} {'gluon ms':>9s} {'TF/s':>6s} {'triton ms':>9s} {'TF/s':>6s} {'ratio':>6s}")
    for dims, cfg, g_ms, g_tf, t_ms, t_tf in rows:
        label = f"{dims[0]}/{dims[1]}"
        print(f"{label:9s} {cfg:12s} {g_ms:9.3f} {g_tf:6.0f} {t_ms:9.3f} {t_tf:6.0f} {t_ms / g_ms:6.2f}")
    print("\n".join(plans))
    print(f"{'FAILED' if bad else 'PASSED'}: {bad} correctness failure(s), {time.time() - started:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
