"""A/B of an environment knob that must not change results (a work order, a launch option): for each
workload and each value of ``--env NAME``, the forward (``--mode fwd``, no grad) or forward+backward
(``--mode fb``) of ``packattn.attention(..., backend="triton")`` is timed (do_bench median) and its
outputs (out, lse; with ``fb`` also dq, dk, dv) are compared bitwise with the first value's.

    python3 benchmarks/ab_env.py --env PACKATTN_GLUON_HEAD_SECTION --values 0 1 2 --mode fwd W1 W2 W4 W8

Workloads: W1-W5, W8 (`packattn.bench.workloads.varlen_workloads`), W6, W7 (tree workloads).
The env value "" means the variable unset. The table comes last.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

import packattn
from packattn.bench.workloads import tree_workloads, varlen_workloads


def _set_env(name: str, value: str) -> None:
    if value == "":
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def run(w, mode: str):
    """``(timed function, function returning the tensors to compare)`` for workload ``w``."""
    desc, q, k, v = w.make_inputs("cuda", requires_grad=(mode == "fb"))
    backend = "triton_tree" if isinstance(desc, packattn.Tree) else "triton"
    options = {} if backend == "triton_tree" else w.options
    dout = torch.randn_like(q)

    def call():
        if mode == "fwd":
            with torch.no_grad():
                return packattn.attention(q, k, v, desc, backend=backend, return_lse=True, **options)
        out, lse = packattn.attention(q, k, v, desc, backend=backend, return_lse=True, **options)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    return call


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--env", required=True)
    parser.add_argument("--values", nargs="+", required=True)
    parser.add_argument("--mode", choices=("fwd", "fb"), default="fwd")
    args = parser.parse_args(argv)
    table = {**varlen_workloads(), **tree_workloads()}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.env} in {args.values}, mode {args.mode}", flush=True)
    rows = []
    for name in args.workloads:
        w = table[name]
        flops = w.fwd_flops() if args.mode == "fwd" else w.fwdbwd_flops()
        call = run(w, args.mode)
        reference = None
        for value in args.values:
            _set_env(args.env, value)
            got = [t.detach().clone() for t in call()]
            if reference is None:
                reference, same = got, True
            else:
                same = all(torch.equal(a, b) for a, b in zip(reference, got))
            ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            rows.append((name, value, ms, flops / ms * 1e-9, same))
            print(f"  {name} {args.env}={value!r}: {ms:.3f} ms, {flops / ms * 1e-9:.0f} TF/s, "
                  f"{'bitwise equal' if same else 'DIFFERENT'}", flush=True)
        _set_env(args.env, args.values[0])
    print(f"\nworkload  {args.env:<30} ms       TF/s  bitwise")
    for name, value, ms, tflops, same in rows:
        print(f"{name:<9} {value!r:<30} {ms:8.3f} {tflops:6.0f}  {'yes' if same else 'NO'}")
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
