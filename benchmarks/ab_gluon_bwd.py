"""A/B of the Gluon Hopper backward (`packattn.ops.varlen.launch_sm90_bwd`) against the Triton backward
(``torch.ops.packattn.varlen_bwd``: `varlen_bwd.bwd_dkdv_kernel` + `bwd_dq_kernel`), on one GPU.

    python3 benchmarks/ab_gluon_bwd.py [--no-nasty] [--only dq|dkdv] [W1 W2 W4 W8]     (needs an sm_90 GPU)

1. Small nasty cases (lengths [1, 0, 17, 37, 100, 129, 300], GQA 4/2 and 4/1, causal both
   alignments, no mask, windows, chunks, cross lengths, padding with NaN in the padding rows of
   q / k / v / dout, d 64/128, fp16/bf16): the reference is ``packattn.attention(..., backend="triton")``
   + autograd; the Gluon kernels then run on the same out / lse / dout, with the launchers' defaults and
   then with each dK/dV config of ``DKDV_ALTERNATIVES`` (the warp-specialised ",ws" ones included) and
   each warp-specialised dQ config of ``DQ_WS_ALTERNATIVES``.
   Reported: max |diff| / max |ref| for dq, dk, dv. Both sides round P and dS to 16 bits before their products but sum in different
   orders (and tiles), so they differ by a few ulps of the inputs' dtype (tolerances in ``TOL``).
2. The workloads (bf16, d 128): dq / dk / dv of the Gluon backward checked against the Triton
   backward, then the median time (``triton.testing.do_bench``) of the dK/dV pass and of the dQ pass
   separately (delta and tile tables computed once, outside the timing), Triton vs the Gluon
   launcher's default config and each alternative of ``DKDV_ALTERNATIVES`` / ``DQ_ALTERNATIVES``
   (set through ``$PACKATTN_GLUON_DKDV_CONFIG`` / ``$PACKATTN_GLUON_DQ_CONFIG``).
A failing case is reported and the script goes on; the summary table comes last.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton.testing

import packattn
from packattn.ops.varlen import launch_sm90_bwd as tb
from packattn.backends import triton_varlen as tv
from packattn.bench.workloads import varlen_workloads
from packattn.mask import Mask
from packattn.varlen import Varlen

NASTY_LENGTHS = [1, 0, 17, 37, 100, 129, 300]
CROSS_LENGTHS = [5, 3, 40, 0, 130, 129, 257]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # max |diff| / max |ref|
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------- problem set-up
class Problem:
    """One batch as `TritonVarlenBackend.run` hands it to the kernels: inputs, mask arguments, forward
    ``out`` / ``lse`` (Triton backend, no grad), a random ``dout``, ``delta``."""

    def __init__(self, seqs: Varlen, q, k, v, dout, options: dict):
        self.seqs, self.q, self.k, self.v, self.dout = seqs, q, k, v, dout
        self.mask = Mask.make(**options)
        self.options = options
        self.scale = q.shape[-1] ** -0.5
        self.rows_q = seqs.cu_seqlens_q_padded if seqs.cu_seqlens_q_padded is not None else seqs.cu_seqlens_q
        self.rows_kv = seqs.cu_seqlens_kv_padded if seqs.cu_seqlens_kv_padded is not None else seqs.cu_seqlens_kv
        self.seq_args = (seqs.cu_seqlens_q, seqs.cu_seqlens_kv, self.rows_q, self.rows_kv)
        self.mask_args = (self.mask.left, self.mask.right, self.mask.chunk_size or 0)
        self.top_left = self.mask.align == "top_left"
        self.padded_q = seqs.cu_seqlens_q_padded is not None
        self.padded_kv = seqs.cu_seqlens_kv_padded is not None
        self.pad_rows_q = seqs.padding_rows("q") if self.padded_q else None
        self.pad_rows_kv = seqs.padding_rows("kv") if self.padded_kv else None
        with torch.no_grad():
            self.out, self.lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **options)
        self.delta = tv.bwd_delta(self.out, dout, self.lse, None)

    def triton_grads(self):
        """Reference ``(dq, dk, dv)``: the Triton backend's forward + autograd (its backward op)."""
        q, k, v = (x.detach().requires_grad_(True) for x in (self.q, self.k, self.v))
        out = packattn.attention(q, k, v, self.seqs, backend="triton", **self.options)
        return torch.autograd.grad(out, (q, k, v), self.dout)

    def gluon_tables(self):
        """``(dq_tiles, dkdv_tiles)`` built with the Gluon kernels' block sizes (current config)."""
        d = self.q.shape[-1]
        dq, dkdv = tb.dq_config(d), tb.dkdv_config(d)
        return (tv.tile_table(self.seqs, self.mask, False, dq.block_m, dq.block_n),
                tv.tile_table(self.seqs, self.mask, True, dkdv.block_n, dkdv.block_m))

    def gluon_grads(self):
        """``(dq, dk, dv)`` of `gluon_varlen_bwd` on this problem's out / lse / dout."""
        dq_tiles, dkdv_tiles = self.gluon_tables()
        return tb.gluon_varlen_bwd(self.dout, None, self.q, self.k, self.v, self.out, self.lse, *self.seq_args,
                                   dq_tiles, dkdv_tiles, self.scale, *self.mask_args, self.top_left, self.padded_q,
                                   self.padded_kv, self.pad_rows_q, self.pad_rows_kv)


def _padding_rows(total: int, cu: torch.Tensor, cu_padded: torch.Tensor | None) -> torch.Tensor:
    """Boolean (total,) mask of the rows that belong to no sequence (padding between sequences)."""
    in_seq = torch.zeros(total, dtype=torch.bool)
    if cu_padded is None:
        return in_seq
    cu, cu_padded = cu.cpu().tolist(), cu_padded.cpu().tolist()
    for i in range(len(cu) - 1):
        in_seq[cu_padded[i]:cu_padded[i] + cu[i + 1] - cu[i]] = True
    return ~in_seq


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (any NaN / inf counts as inf)."""
    a, ref = a.float(), ref.float()
    diff = (a - ref).abs()
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    top = float(diff.max()) if diff.numel() else 0.0
    return top / scale if scale > 0 else top


# ---------------------------------------------------------------- 1. nasty cases
def nasty_cases():
    """(name, lengths_q, lengths_kv, heads_q, heads_kv, head_dim, dtype, options, pad_to_multiple)."""
    L, X = NASTY_LENGTHS, CROSS_LENGTHS
    cases = []
    for dtype in ("bf16", "fp16"):
        for d in (128, 64):
            cases += [
                (f"{dtype} d{d} causal", L, None, 4, 4, d, dtype, {"causal": True}, None),
                (f"{dtype} d{d} no mask", L, None, 4, 4, d, dtype, {}, None),
                (f"{dtype} d{d} GQA 4/2 causal top-left", L, None, 4, 2, d, dtype, {"causal": "top_left"}, None),
                (f"{dtype} d{d} GQA 4/1 window (8,8)", L, None, 4, 1, d, dtype, {"window": (8, 8)}, None),
            ]
    for d in (128, 64):
        cases += [
            (f"bf16 d{d} window (16,0)", L, None, 4, 4, d, "bf16", {"window": (16, 0)}, None),
            (f"bf16 d{d} causal window (16,0)", L, None, 4, 2, d, "bf16", {"causal": True, "window": (16, 0)}, None),
            (f"bf16 d{d} chunk 32 causal", L, None, 4, 4, d, "bf16", {"causal": True, "chunk_size": 32}, None),
            (f"bf16 d{d} chunk 32", L, None, 4, 1, d, "bf16", {"chunk_size": 32}, None),
            (f"bf16 d{d} cross causal", L, X, 4, 2, d, "bf16", {"causal": True}, None),
            (f"bf16 d{d} cross causal top-left", L, X, 4, 2, d, "bf16", {"causal": "top_left"}, None),
            (f"bf16 d{d} cross no mask", L, X, 4, 1, d, "bf16", {}, None),
            (f"bf16 d{d} padded(8) causal NaN pads", L, None, 4, 4, d, "bf16", {"causal": True}, 8),
            (f"bf16 d{d} padded(8) no mask GQA NaN pads", L, None, 4, 2, d, "bf16", {}, 8),
            (f"bf16 d{d} padded(8) chunk 32 NaN pads", L, None, 4, 4, d, "bf16", {"causal": True, "chunk_size": 32}, 8),
            (f"bf16 d{d} padded(8) cross window(8,8)", L, X, 4, 2, d, "bf16", {"window": (8, 8)}, 8),
        ]
    cases.append(("fp16 d128 padded(8) cross causal NaN pads", L, X, 4, 2, 128, "fp16", {"causal": True}, 8))
    return cases


def make_nasty(case) -> Problem:
    _, lq, lk, hq, hkv, d, dtype_name, options, pad = case
    dtype = DTYPES[dtype_name]
    seqs = Varlen.from_lengths(lq, lk, pad_to_multiple=pad, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seqs.total_q, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(seqs.total_kv, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(seqs.total_kv, hkv, d, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(seqs.total_q, hq, d, device="cuda", dtype=dtype, generator=gen)
    pad_q = _padding_rows(seqs.total_q, seqs.cu_seqlens_q, seqs.cu_seqlens_q_padded).cuda()
    pad_kv = _padding_rows(seqs.total_kv, seqs.cu_seqlens_kv, seqs.cu_seqlens_kv_padded).cuda()
    for x, rows in ((q, pad_q), (dout, pad_q), (k, pad_kv), (v, pad_kv)):
        x[rows] = float("nan")  # padding rows may be uninitialised memory: nothing may leak from them
    return Problem(seqs, q, k, v, dout, options)


def run_nasty(case) -> list[tuple[str, list[float], bool]]:
    """The launchers' default configs, then each dK/dV alternative of ``DKDV_ALTERNATIVES`` (the
    warp-specialised ",ws" ones included), then each warp-specialised dQ config of ``DQ_WS_ALTERNATIVES``,
    on the same problem: one ``(name, diffs, ok)`` per config."""
    problem = make_nasty(case)
    ref = problem.triton_grads()
    tol = TOL[problem.q.dtype]
    results = []
    d = problem.q.shape[-1]
    runs = ([(tb.ENV_DKDV, "dkdv", cfg) for cfg in [None] + tb.DKDV_ALTERNATIVES.get(d, [])]
            + [(tb.ENV_DQ, "dq", cfg) for cfg in tb.DQ_WS_ALTERNATIVES.get(d, [])])
    runs = [r for r in runs if ONLY_PASS is None or (r[1] == ONLY_PASS and r[2] is not None)]
    for env, kind, cfg in runs:
        name = case[0] if cfg is None else f"{case[0]} [{kind} {_label(cfg)}]"
        try:
            got = _with_env(env, cfg, problem.gluon_grads)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- report and go on
            print(f"  ERR  {name:44s} {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append((name, [float("nan")] * 3, False))
            continue
        diffs = [rel_diff(g, r) for g, r in zip(got, ref)]
        results.append((name, diffs, max(diffs) <= tol))
    return results


# ---------------------------------------------------------------- 2. workloads: separate passes, timed
def triton_dkdv(p: Problem, dk, dv):
    """The Triton dK/dV pass exactly as ``packattn::varlen_bwd`` launches it (tiles from `launch_config`)."""
    d = p.q.shape[-1]
    cfg = tv.launch_config("dkdv", d, p.q.dtype, p.q.device)
    tiles = tv.tile_table(p.seqs, p.mask, True, cfg.block_n, cfg.block_m)
    common = dict(HEAD_DIM=d, BLOCK_D=tv.block_d(d), INPUT_PRECISION=tv._precision(p.q.dtype),
                  **tv._mask_constexprs(*p.mask_args, p.top_left))
    return lambda: tv.launch_dkdv(p.q, p.k, p.v, p.dout, p.lse, p.delta, dk, dv, tiles, p.seq_args, tiles, p.scale,
                                  p.mask_args, common)


def triton_dq(p: Problem, dq):
    """The Triton dQ pass exactly as ``packattn::varlen_bwd`` launches it."""
    from packattn.ops.varlen.bwd_triton import bwd_dq_kernel

    d, heads_q = p.q.shape[-1], p.q.shape[1]
    cfg = tv.launch_config("dq", d, p.q.dtype, p.q.device)
    tiles = tv.tile_table(p.seqs, p.mask, False, cfg.block_m, cfg.block_n)
    common = dict(HEAD_DIM=d, BLOCK_D=tv.block_d(d), INPUT_PRECISION=tv._precision(p.q.dtype),
                  **tv._mask_constexprs(*p.mask_args, p.top_left), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    args = (p.q, p.k, p.v, p.dout, p.lse, p.delta, dq, tiles, *p.seq_args, *tv._qkv_do_strides(p.q, p.k, p.v, p.dout),
            dq.stride(0), dq.stride(1), p.lse.stride(0), heads_q, heads_q // p.k.shape[1], p.scale * LOG2E, p.scale,
            *p.mask_args)
    return lambda: tv._launch(bwd_dq_kernel, (tiles.shape[0] * heads_q,), args, common, cfg)


def gluon_dkdv(p: Problem, dk, dv):
    cfg = tb.dkdv_config(p.q.shape[-1])
    tiles = tv.tile_table(p.seqs, p.mask, True, cfg.block_n, cfg.block_m)
    return lambda: tb.gluon_launch_dkdv(p.q, p.k, p.v, p.dout, p.lse, p.delta, dk, dv, tiles, p.seq_args, p.scale,
                                        p.mask_args, p.top_left)


def gluon_dq(p: Problem, dq):
    cfg = tb.dq_config(p.q.shape[-1])
    tiles = tv.tile_table(p.seqs, p.mask, False, cfg.block_m, cfg.block_n)
    return lambda: tb.gluon_launch_dq(p.q, p.k, p.v, p.dout, p.lse, p.delta, dq, tiles, p.seq_args, p.scale,
                                      p.mask_args, p.top_left)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _with_env(name: str, cfg: tb.GluonBwdConfig | None, fn):
    """Run ``fn()`` with ``$name`` set to ``cfg`` (None: the launcher's table)."""
    old = os.environ.pop(name, None)
    if cfg is not None:
        os.environ[name] = cfg.label()  # "block_m,block_n,stages,num_warps[,ws]"
    try:
        return fn()
    finally:
        os.environ.pop(name, None)
        if old is not None:
            os.environ[name] = old


def _label(cfg) -> str:
    if cfg is None:
        return "default"
    return f"{cfg.block_m}x{cfg.block_n}/{cfg.stages}s/{cfg.num_warps}w{'/ws' if cfg.warp_specialize else ''}"


def run_pass(name: str, kind: str, p: Problem, refs: list, triton_fn, make_gluon, env: str, configs,
             flops: float) -> list[dict]:
    """Time the Triton pass ``kind`` once, then check and time the Gluon pass per config."""
    outs = [torch.zeros_like(r) for r in refs]
    triton_ms = bench(triton_fn(p, *outs))
    rows = []
    for cfg in configs:
        row = {"name": name, "pass": kind, "config": _label(cfg), "triton_ms": triton_ms,
               "triton_tf": flops / triton_ms / 1e9}
        try:
            for o in outs:
                o.fill_(float("nan"))  # rows inside sequences must all be written
            pads = p.pad_rows_q if kind == "dq" else p.pad_rows_kv
            if pads is not None:
                for o in outs:
                    o.index_fill_(0, pads, 0.0)  # the caller's job, as in varlen_bwd
            fn = _with_env(env, cfg, lambda: make_gluon(p, *outs))
            _with_env(env, cfg, fn)
            torch.cuda.synchronize()
            row["err"] = max(rel_diff(o, r) for o, r in zip(outs, refs))
            row["ok"] = row["err"] <= TOL[p.q.dtype]
            row["gluon_ms"] = _with_env(env, cfg, lambda: bench(fn))
            row["gluon_tf"] = flops / row["gluon_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 -- report and go on
            row.update(ok=False, err=float("nan"), gluon_ms=float("nan"), gluon_tf=0.0,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
    return rows


def run_workload(name: str, w) -> list[dict]:
    """Correctness and median time of the dK/dV and dQ passes, Triton vs Gluon configs."""
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=False)
    dout = torch.randn_like(q)
    p = Problem(seqs, q, k, v, dout, w.options)
    d = q.shape[-1]
    ref_dq, ref_dk, ref_dv = tv.varlen_bwd(dout, None, q, k, v, p.out, p.lse, *p.seq_args,
                                           *triton_tables(p), p.scale, *p.mask_args, p.top_left, p.padded_q,
                                           p.padded_kv, p.pad_rows_q, p.pad_rows_kv)
    # useful FLOPs of each pass: dK/dV 4 products, dQ 3, each 2 * d per visible pair and head
    fwd = w.fwd_flops()  # = 2 products
    rows = [] if ONLY_PASS == "dq" else run_pass(name, "dkdv", p, [ref_dk, ref_dv], triton_dkdv, gluon_dkdv,
                                                 tb.ENV_DKDV, [None] + tb.DKDV_ALTERNATIVES.get(d, []), 2.0 * fwd)
    if ONLY_PASS == "dkdv":
        return rows
    rows += run_pass(name, "dq", p, [ref_dq], triton_dq, gluon_dq, tb.ENV_DQ,
                     [None] + tb.DQ_ALTERNATIVES.get(d, []), 1.5 * fwd)
    return rows


def triton_tables(p: Problem):
    """``(dq_tiles, dkdv_tiles)`` with the Triton kernels' block sizes, as `TritonVarlenBackend.run` builds them."""
    d = p.q.shape[-1]
    dq, dkdv = (tv.launch_config(kind, d, p.q.dtype, p.q.device) for kind in ("dq", "dkdv"))
    return (tv.tile_table(p.seqs, p.mask, False, dq.block_m, dq.block_n),
            tv.tile_table(p.seqs, p.mask, True, dkdv.block_n, dkdv.block_m))


# ---------------------------------------------------------------- main
ONLY_PASS = None  # "--only dq" / "--only dkdv": that pass's alternatives only (nasty cases and workloads)


def main(names: list[str]) -> int:
    global ONLY_PASS
    skip_nasty = "--no-nasty" in names  # workload timings only
    if "--only" in names:
        ONLY_PASS = names[names.index("--only") + 1]
        names = [n for n in names if n not in ("--only", ONLY_PASS)]
    names = [n for n in names if n != "--no-nasty"]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs an sm_90 (Hopper) GPU")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    # the reference side is the Triton backward: keep the triton backend off its Gluon passes
    # (the Gluon side is launched directly, whatever this says)
    os.environ["PACKATTN_TRITON_BWD"] = "triton"
    for d in tb.HEAD_DIMS:
        print(f"gluon d={d}: dkdv {tb.dkdv_config(d)}, dq {tb.dq_config(d)}")
    failures = 0

    print("\n== nasty cases: max |diff| / max |ref| vs the Triton backward ==")
    for case in ([] if skip_nasty else nasty_cases()):
        try:
            for name, diffs, ok in run_nasty(case):
                failures += not ok
                print(f"  {'ok  ' if ok else 'FAIL'} {name:44s} dq {diffs[0]:.2e}  dk {diffs[1]:.2e}  "
                      f"dv {diffs[2]:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 -- report and go on
            failures += 1
            print(f"  ERR  {case[0]:44s} {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)

    table = varlen_workloads()
    rows = []
    print("\n== workloads (bf16; gluon configs: default = the launcher's table, then the ALTERNATIVES) ==")
    for name in names:
        try:
            for row in run_workload(name, table[name]):
                failures += not row["ok"]
                rows.append(row)
                print(f"  {name} {row['pass']:4s} {row['config']:16s} err {row['err']:.2e} "
                      f"{'ok' if row['ok'] else 'FAIL'}; triton {row['triton_ms']:.3f} ms, gluon {row['gluon_ms']:.3f} ms "
                      f"{row.get('error', '')}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"  {name}: ERR {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)
        torch.cuda.empty_cache()

    print("\nworkload pass gluon config      triton ms  TF/s  gluon ms  TF/s  speedup  max rel err  ok")
    for r in rows:
        print(f"{r['name']:8s} {r['pass']:4s} {r['config']:16s} {r['triton_ms']:8.3f}  {r['triton_tf']:4.0f}"
              f"  {r['gluon_ms']:8.3f}  {r['gluon_tf']:4.0f}  {r['triton_ms'] / r['gluon_ms']:6.2f}x  {r['err']:.2e}"
              f"     {r['ok']}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["W1", "W2", "W4", "W8"]))
