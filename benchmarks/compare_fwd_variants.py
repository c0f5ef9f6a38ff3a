"""Compare the Triton forward kernels on a CUDA GPU: the default pointer kernel
(`packattn.kernels.varlen_fwd`) and the experimental TMA kernel (`packattn.kernels.varlen_fwd_tma`,
selected per call by ``PACKATTN_TRITON_FWD=tma``).

usage: python3 benchmarks/compare_fwd_variants.py [W1 W2 W8 ...] [--configs 128,32,4,4 128,64,8,3 ...]

For each workload (`packattn.bench.workloads.varlen_workloads`, bf16): checks that the two variants
agree (max |out_tma - out_default| and max |lse_tma - lse_default| over finite lse < 2e-2), then
times the forward of each (``triton.testing.do_bench``, median) and prints workload, variant, config,
ms and TF/s (``w.fwd_flops() / ms / 1e9``). ``--configs`` (BLOCK_M,BLOCK_N,warps,stages) replaces the
Hopper forward config for the workload's padded head dim, one row per config and variant; by
default the current config only. Exit status 1 if a variant disagrees.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton.testing

import packattn
from packattn.backends import triton_varlen as tv
from packattn.bench.workloads import varlen_workloads

TOL = 2e-2
VARIANTS = {"default": None, "tma": "tma"}


def set_variant(value: str | None) -> None:
    if value is None:
        os.environ.pop(tv.FWD_VARIANT_ENV, None)
    else:
        os.environ[tv.FWD_VARIANT_ENV] = value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=["W1", "W2", "W8"])
    parser.add_argument("--configs", nargs="*", default=[], help="BLOCK_M,BLOCK_N,warps,stages for the fwd kernel")
    parser.add_argument("--warmup", type=int, default=25)
    parser.add_argument("--rep", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    saved_env = os.environ.get(tv.FWD_VARIANT_ENV)
    original = dict(tv.HOPPER_CONFIGS)
    table = varlen_workloads()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'workload':<18} {'variant':<8} {'config (M,N,warps,stages)':<27} {'ms':>8} {'TF/s':>7}  check")
    failures = 0
    try:
        for name in args.workloads:
            w = table[name]
            _, q, k, v = w.make_inputs("cuda", torch.bfloat16, requires_grad=False)
            flops = w.fwd_flops()
            bd = tv.block_d(w.head_dim)
            configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] or [None]
            for cfg in configs:
                tv.HOPPER_CONFIGS.clear()
                tv.HOPPER_CONFIGS.update(original)
                if cfg is not None:
                    tv.HOPPER_CONFIGS[("fwd", bd)] = tv.LaunchConfig(*cfg)
                tv._reduced_stages.clear()
                current = tv.launch_config("fwd", w.head_dim, q.dtype, q.device)
                cfg_text = f"{current.block_m},{current.block_n},{current.num_warps},{current.num_stages}"
                seqs = w.varlen("cuda")  # fresh per-batch tile tables for these block sizes

                def forward():
                    return packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **w.options)

                results = {}
                with torch.no_grad():
                    for variant, env in VARIANTS.items():
                        set_variant(env)
                        out, lse = forward()
                        torch.cuda.synchronize()
                        ms = triton.testing.do_bench(forward, warmup=args.warmup, rep=args.rep, return_mode="median")
                        results[variant] = (out, lse, ms)
                    set_variant(saved_env)
                out_ref, lse_ref, _ = results["default"]
                for variant, (out, lse, ms) in results.items():
                    check = ""
                    if variant != "default":
                        d_out = (out.float() - out_ref.float()).abs().max().item()
                        same_inf = torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
                        finite = torch.isfinite(lse_ref)
                        d_lse = (lse[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
                        ok = d_out < TOL and d_lse < TOL and same_inf and not torch.isnan(out).any()
                        failures += not ok
                        check = f"{'ok' if ok else 'MISMATCH'} max|dout|={d_out:.2e} max|dlse|={d_lse:.2e}" + \
                            ("" if same_inf else " lse=-inf on different rows")
                    print(f"{w.name:<18} {variant:<8} {cfg_text:<27} {ms:8.3f} {flops / ms / 1e9:7.1f}  {check}",
                          flush=True)
    finally:
        tv.HOPPER_CONFIGS.clear()
        tv.HOPPER_CONFIGS.update(original)
        set_variant(saved_env)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
