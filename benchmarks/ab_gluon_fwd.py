"""A/B of the Gluon Hopper forward (`packattn.backends.triton_fwd_gluon`) against the Triton forward
(``packattn.attention(..., backend="triton")``, i.e. ``torch.ops.packattn.varlen_fwd``), on one GPU.

    python3 benchmarks/ab_gluon_fwd.py [W1 W2 W4 W8]     (needs an sm_90 GPU)

1. Small nasty cases (lengths [1, 0, 17, 37, 100, 129, 300], GQA, causal both alignments,
   windows, chunks, cross lengths, padding with NaN in the padding rows, d 64/128, fp16/bf16):
   max |out| and |lse| differences to the Triton forward. Both kernels round P to 16 bits
   before the PV product and accumulate in a different order, so out differs by a few bf16 ulps
   (tolerance 2e-2 absolute at |out| <= ~3) and lse by float32 noise (tolerance 1e-3).
2. The workloads (bf16, d 128): the same comparison, then the median forward time
   (``torch.no_grad``, ``triton.testing.do_bench``, tile tables cached as in real use) and TF/s on
   the workload's useful FLOPs, for the launcher's default config and each of `tg.ALTERNATIVES`
   (set through ``$PACKATTN_GLUON_FWD_CONFIG``).
A failing case is reported and the script goes on; the summary table comes last.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton.testing

import packattn
from packattn.backends import triton_fwd_gluon as tg
from packattn.backends.triton_varlen import tile_table
from packattn.bench.workloads import varlen_workloads
from packattn.mask import Mask
from packattn.varlen import Varlen

NASTY_LENGTHS = [1, 0, 17, 37, 100, 129, 300]
OUT_TOL, LSE_TOL = 2e-2, 1e-3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def gluon_attention(q, k, v, seqs: Varlen, scale: float | None = None, **options):
    """``(out, lse)`` through `gluon_fwd`, set up as `TritonVarlenBackend.run` sets up the Triton
    forward (mask, tile table with the Gluon kernel's block sizes, physical row offsets)."""
    mask = Mask.make(**options)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if scale < 0:
        q, scale = -q, -scale
    cfg = tg.config_for(q.shape[-1])
    q_tiles = tile_table(seqs, mask, False, cfg.block_m, cfg.block_n)
    rows_q = seqs.cu_seqlens_q_padded if seqs.cu_seqlens_q_padded is not None else seqs.cu_seqlens_q
    rows_kv = seqs.cu_seqlens_kv_padded if seqs.cu_seqlens_kv_padded is not None else seqs.cu_seqlens_kv
    return tg.gluon_fwd(q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_kv, rows_q, rows_kv, q_tiles, scale,
                        mask.left, mask.right, mask.chunk_size or 0, mask.align == "top_left",
                        seqs.cu_seqlens_q_padded is not None)


def triton_attention(q, k, v, seqs: Varlen, **options):
    return packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **options)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| where equal infinities (lse = -inf rows) count as 0 and any NaN as inf."""
    a, b = a.float(), b.float()
    same = (a == b)
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return float(diff.max()) if diff.numel() else 0.0


def _padding_rows(total: int, cu: torch.Tensor, cu_padded: torch.Tensor | None) -> torch.Tensor:
    """Boolean (total,) mask of the rows that belong to no sequence (padding between sequences)."""
    in_seq = torch.zeros(total, dtype=torch.bool)
    if cu_padded is None:
        return in_seq
    cu, cu_padded = cu.cpu().tolist(), cu_padded.cpu().tolist()
    for i in range(len(cu) - 1):
        in_seq[cu_padded[i]:cu_padded[i] + cu[i + 1] - cu[i]] = True
    return ~in_seq


def nasty_cases():
    """(name, lengths_q, lengths_kv, heads_q, heads_kv, head_dim, dtype, options, pad_to_multiple)."""
    L = NASTY_LENGTHS
    cross = [5, 3, 40, 0, 130, 129, 257]
    cases = []
    for dtype in ("bf16", "fp16"):
        for d in (128, 64):
            cases += [
                (f"{dtype} d{d} causal", L, None, 4, 4, d, dtype, {"causal": True}, None),
                (f"{dtype} d{d} no mask", L, None, 4, 4, d, dtype, {}, None),
            ]
    cases += [
        ("bf16 d128 GQA 4/2 causal", L, None, 4, 2, 128, "bf16", {"causal": True}, None),
        ("bf16 d128 causal top-left", L, None, 4, 4, 128, "bf16", {"causal": "top_left"}, None),
        ("bf16 d128 window (16,0)", L, None, 4, 4, 128, "bf16", {"window": (16, 0)}, None),
        ("bf16 d128 causal window (16,0)", L, None, 4, 4, 128, "bf16", {"causal": True, "window": (16, 0)}, None),
        ("bf16 d128 window (8,8)", L, None, 4, 4, 128, "bf16", {"window": (8, 8)}, None),
        ("bf16 d128 chunk 32 causal", L, None, 4, 4, 128, "bf16", {"causal": True, "chunk_size": 32}, None),
        ("bf16 d128 chunk 32", L, None, 4, 4, 128, "bf16", {"chunk_size": 32}, None),
        ("bf16 d64 window (8,8) GQA 4/1", L, None, 4, 1, 64, "bf16", {"window": (8, 8)}, None),
        ("bf16 d128 cross causal", L, cross, 4, 2, 128, "bf16", {"causal": True}, None),
        ("bf16 d128 cross causal top-left", L, cross, 4, 2, 128, "bf16", {"causal": "top_left"}, None),
        ("bf16 d128 cross no mask", L, cross, 4, 2, 128, "bf16", {}, None),
        ("bf16 d128 padded(8) causal NaN pads", L, None, 4, 4, 128, "bf16", {"causal": True}, 8),
        ("bf16 d128 padded(8) no mask NaN pads", L, None, 4, 2, 128, "bf16", {}, 8),
        ("bf16 d64 padded(8) chunk 32 NaN pads", L, None, 4, 4, 64, "bf16", {"causal": True, "chunk_size": 32}, 8),
        ("bf16 d128 padded(8) cross window(8,8)", L, cross, 4, 2, 128, "bf16", {"window": (8, 8)}, 8),
    ]
    return cases


def run_nasty(case) -> tuple[str, float, float, bool]:
    name, lq, lk, hq, hkv, d, dtype_name, options, pad = case
    dtype = DTYPES[dtype_name]
    seqs = Varlen.from_lengths(lq, lk, pad_to_multiple=pad, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seqs.total_q, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(seqs.total_kv, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(seqs.total_kv, hkv, d, device="cuda", dtype=dtype, generator=gen)
    pad_q = _padding_rows(seqs.total_q, seqs.cu_seqlens_q, seqs.cu_seqlens_q_padded).cuda()
    pad_kv = _padding_rows(seqs.total_kv, seqs.cu_seqlens_kv, seqs.cu_seqlens_kv_padded).cuda()
    q[pad_q] = float("nan")  # padding rows may be uninitialised memory: nothing may leak from them
    k[pad_kv] = float("nan")
    v[pad_kv] = float("nan")
    with torch.no_grad():
        ref_out, ref_lse = triton_attention(q, k, v, seqs, **options)
        out, lse = gluon_attention(q, k, v, seqs, **options)
    torch.cuda.synchronize()
    d_out, d_lse = _max_diff(out, ref_out), _max_diff(lse, ref_lse)
    return name, d_out, d_lse, d_out <= OUT_TOL and d_lse <= LSE_TOL


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _with_config(cfg: tg.GluonConfig | None, fn):
    """Run ``fn()`` with `tg.config_for` returning ``cfg`` (None: the launcher's table)."""
    old = os.environ.pop(tg.ENV_CONFIG, None)
    if cfg is not None:
        os.environ[tg.ENV_CONFIG] = f"{cfg.block_m},{cfg.block_n},{cfg.stages},{cfg.num_warps}"
    try:
        return fn()
    finally:
        os.environ.pop(tg.ENV_CONFIG, None)
        if old is not None:
            os.environ[tg.ENV_CONFIG] = old


def run_workload(name: str, w, configs) -> list[dict]:
    """Correctness and median forward time of the Triton forward and of the Gluon one per config."""
    seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=False)
    flops = w.fwd_flops()
    rows = []
    with torch.no_grad():
        ref_out, ref_lse = triton_attention(q, k, v, seqs, **w.options)
        triton_ms = bench(lambda: triton_attention(q, k, v, seqs, **w.options))
        for cfg in configs:
            label = "default" if cfg is None else f"{cfg.block_m}x{cfg.block_n}/{cfg.stages}s/{cfg.num_warps}w"
            row = {"name": name, "config": label, "triton_ms": triton_ms, "triton_tf": flops / triton_ms / 1e9}
            try:
                out, lse = _with_config(cfg, lambda: gluon_attention(q, k, v, seqs, **w.options))
                torch.cuda.synchronize()
                row["d_out"], row["d_lse"] = _max_diff(out, ref_out), _max_diff(lse, ref_lse)
                row["ok"] = row["d_out"] <= OUT_TOL and row["d_lse"] <= LSE_TOL
                del out, lse
                row["gluon_ms"] = _with_config(cfg, lambda: bench(lambda: gluon_attention(q, k, v, seqs, **w.options)))
                row["gluon_tf"] = flops / row["gluon_ms"] / 1e9
            except Exception as e:  # noqa: BLE001 -- report and go on
                row.update(ok=False, d_out=float("nan"), d_lse=float("nan"), gluon_ms=float("nan"), gluon_tf=0.0,
                           error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
    return rows


def main(names: list[str]) -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs an sm_90 (Hopper) GPU")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for d in tg.HEAD_DIMS:
        print(f"gluon config d={d}: {tg.config_for(d)}")
    failures = 0

    print("\n== nasty cases: max |diff| vs the Triton forward ==")
    for case in nasty_cases():
        try:
            name, d_out, d_lse, ok = run_nasty(case)
            failures += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {name:42s} out {d_out:.3e}  lse {d_lse:.3e}", flush=True)
        except Exception as e:  # noqa: BLE001 -- report and go on
            failures += 1
            print(f"  ERR  {case[0]:42s} {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)

    table = varlen_workloads()
    configs = [None] + list(tg.ALTERNATIVES)
    rows = []
    print("\n== workloads (bf16; gluon configs: default = the launcher's table, then tg.ALTERNATIVES) ==")
    for name in names:
        try:
            for row in run_workload(name, table[name], configs):
                failures += not row["ok"]
                rows.append(row)
                print(f"  {name} {row['config']:16s} out {row['d_out']:.3e} lse {row['d_lse']:.3e} "
                      f"{'ok' if row['ok'] else 'FAIL'}; triton {row['triton_ms']:.3f} ms, gluon {row['gluon_ms']:.3f} ms "
                      f"{row.get('error', '')}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"  {name}: ERR {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)

    print("\nworkload gluon config      triton ms  TF/s  gluon ms  TF/s  speedup  max|dout|  max|dlse|  ok")
    for r in rows:
        print(f"{r['name']:8s} {r['config']:16s} {r['triton_ms']:8.3f}  {r['triton_tf']:4.0f}  {r['gluon_ms']:8.3f}"
              f"  {r['gluon_tf']:4.0f}  {r['triton_ms'] / r['gluon_ms']:6.2f}x  {r['d_out']:.2e}   {r['d_lse']:.2e}"
              f"   {r['ok']}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["W1", "W2", "W4", "W8"]))
