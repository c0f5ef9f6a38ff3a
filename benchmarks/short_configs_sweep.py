"""Short batches (every sequence <= `packattn.lengths.SHORT_SEQLEN`): the Gluon forward's configs at one head dim
against candidate short-batch configs and torch ``varlen_attn``: documents of 128 / 160 / 256 / 384 tokens
(~32K tokens, 16K from d = 192) under one mask (`MASKS`, default causal), heads 32/32 and 32/8, bf16, forward ms
(do_bench median, 3 interleaved rounds, one process); each candidate's output is compared with the first's.

    PYTHONPATH=$PWD python benchmarks/short_configs_sweep.py 96 [causal | none | window]

Columns: ``table`` (what `configs.config_for` picks now), ``trim64`` (128-row tiles over 64-key blocks, trimmed),
``m64`` (64 x 64 tiles, one consumer warp group), ``torch_varlen``. NOTES.md v39 / v40 have the H100 numbers that
chose `configs.SHORT_DEFAULT_CONFIGS` and `configs.SHORT_MASKED_CONFIGS`.
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.testing

import packattn
from packattn.bench.workloads import Workload
from packattn.ops.varlen import configs
from packattn.ops.varlen.configs import GluonConfig

TRIM64 = {64: GluonConfig(128, 64, 4, 8, trim=True, vec_store=True),
          96: GluonConfig(128, 64, 4, 8, trim=True, vec_store=True),
          128: GluonConfig(128, 64, 4, 8, trim=True),
          192: GluonConfig(128, 64, 3, 8, trim=True, q_in_regs=True, vec_store=True),
          256: GluonConfig(128, 64, 2, 8, trim=True, split_kv=True, rescale_threshold=8.0)}
MASKS = {"causal": {"causal": True}, "none": {}, "window": {"causal": True, "window": (128, 0)}}
M64 = {64: GluonConfig(64, 64, 3, 4, vec_store=True), 96: GluonConfig(64, 64, 3, 4, vec_store=True),
       128: GluonConfig(64, 64, 3, 4), 192: GluonConfig(64, 64, 3, 4, vec_store=True),
       256: GluonConfig(64, 64, 2, 4, split_kv=True)}


def main(head_dim: int, mask: str = "causal") -> None:
    tokens = 32640 if head_dim < 192 else 16320
    work = {f"s{n}g{g}": Workload(f"s{n}g{g}", [n] * (tokens // n), heads_q=32, heads_kv=32 // g, head_dim=head_dim,
                                  options=MASKS[mask]) for n in (128, 160, 256, 384) for g in (1, 4)}
    variants = {"table": None, "trim64": TRIM64[head_dim], "m64": M64[head_dim], "torch_varlen": None}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, d = {head_dim}, "
          f"mask {mask}")
    times: dict = {}
    for rnd in range(3):
        for name, w in work.items():
            desc, q, k, v = w.make_inputs("cuda", requires_grad=False)
            first = None
            for label, cfg in variants.items():
                tables = {} if cfg is None else {
                    "SHORT_CONFIGS": {**configs.SHORT_CONFIGS, head_dim: cfg},
                    "SHORT_DEFAULT_CONFIGS": {**configs.SHORT_DEFAULT_CONFIGS, head_dim: cfg},
                    "SHORT_MASKED_CONFIGS": {d: c for d, c in configs.SHORT_MASKED_CONFIGS.items() if d != head_dim}}
                backend = "torch_varlen" if label == "torch_varlen" else "triton"
                with configs.override(**tables), torch.no_grad():
                    def call(q=q, k=k, v=v, desc=desc, backend=backend, options=w.options):
                        return packattn.attention(q, k, v, desc, backend=backend, **options)
                    out = call()
                    times.setdefault((name, label), []).append(
                        triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
                first = out if first is None else first
                if rnd == 0 and (out.float() - first.float()).abs().max() > 2e-2:
                    print(f"{name} {label}: output differs from the table config's")
    print("workload " + " ".join(f"{label:>12s}" for label in variants))
    for name in work:
        print(f"{name:8s} " + " ".join(f"{statistics.median(times[name, label]):12.3f}" for label in variants))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 96, sys.argv[2] if len(sys.argv) > 2 else "causal")
