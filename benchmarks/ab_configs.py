"""A/B of kernel configurations: for each workload and each ``--variant``, the forward (``--mode fwd``, no grad)
or forward+backward (``--mode fb``) of ``packattn.attention(..., backend="triton" | "triton_tree")`` is timed
(do_bench median) and its outputs (out, lse; with ``fb`` also dq, dk, dv) are compared with the first
variant's (bitwise, else the largest difference relative to the largest value).

    python3 benchmarks/ab_configs.py W1 W2 W8 --variant "" --variant "HEAD_SECTION=1" --mode fb --repeat 3
    python3 benchmarks/ab_configs.py W8 --variant "" --variant "fwd=GluonConfig(128, 64, 4, 8, trim=True)"

A variant is ``NAME=VALUE;NAME=VALUE`` ("" = as is), applied through the one experiment mechanism,
`packattn.ops.varlen.configs.override` (the tree family's `packattn.ops.tree.configs.override` for names
written ``tree.NAME``): NAME is a table or threshold of that module (``GLUON_MIN_SEQLEN``, ``HEAD_SECTION``,
``DQ_CONFIGS``, ...) or ``fwd`` / ``dkdv`` / ``dq`` (one config every such pass takes), VALUE a Python
expression evaluated in that module (``GluonConfig(...)``, ``{128: GluonBwdConfig(...)}``, ``512``).
``PACKATTN_PORTABLE=1`` in a variant sets that environment knob (the portable Triton kernels only).
``--repeat R`` runs the list of variants R times, interleaved (A B A B ...): an H100 at its power limit runs
the same kernels slower hot than cool (benchmarks/NOTES.md), so the summary gives medians over the repeats.
Workloads: W1-W5, W8 (varlen), W6, W7, W8tree (trees). The table comes last.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
from collections import defaultdict

import torch
import triton.testing

import packattn
from packattn.bench.workloads import head_dim_workloads, tree_workloads, varlen_workloads

FAMILIES = {"": "packattn.ops.varlen.configs", "tree.": "packattn.ops.tree.configs"}


@contextlib.contextmanager
def variant(spec: str):
    """Run the ``with`` block under the overrides of ``spec`` ("NAME=VALUE;..."; see the module docstring)."""
    overrides: dict[str, dict] = defaultdict(dict)
    environment = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, value = (s.strip() for s in item.split("=", 1))
        if name.startswith("PACKATTN_"):
            environment[name] = value
            continue
        prefix = "tree." if name.startswith("tree.") else ""
        module = importlib.import_module(FAMILIES[prefix])
        overrides[module.__name__][name[len(prefix):]] = eval(value, vars(module))  # noqa: S307 - a script's input
    saved = {name: os.environ.get(name) for name in environment}
    try:
        os.environ.update(environment)
        with contextlib.ExitStack() as stack:
            for module_name, values in overrides.items():
                stack.enter_context(importlib.import_module(module_name).override(**values))
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(w, mode: str):
    """A function that runs workload ``w`` once on fresh inputs (the same values every time: seed 0) and returns
    the tensors to compare, and the timed call on those inputs. Fresh inputs per variant: the descriptor's
    cached tile tables and plans are built under that variant's configs."""
    desc, q, k, v = w.make_inputs("cuda", requires_grad=(mode == "fb"))
    backend = "triton_tree" if isinstance(desc, packattn.Tree) else "triton"
    options = {} if backend == "triton_tree" else w.options
    gen = torch.Generator(device="cuda").manual_seed(1)  # the same dout for every variant
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, generator=gen).to(q.dtype)  # out's shape

    def call():
        if mode == "fwd":
            with torch.no_grad():
                return packattn.attention(q, k, v, desc, backend=backend, return_lse=True, **options)
        out, lse = packattn.attention(q, k, v, desc, backend=backend, return_lse=True, **options)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    return call


def difference(reference: list[torch.Tensor], got: list[torch.Tensor]) -> str:
    if all(torch.equal(a, b) for a, b in zip(reference, got)):
        return "bitwise"
    worst = 0.0
    for a, b in zip(reference, got):
        finite = torch.isfinite(a) & torch.isfinite(b)
        scale = a[finite].abs().max().clamp_min(1e-30)
        worst = max(worst, float(((a - b)[finite]).abs().max() / scale))
    return f"{worst:.1e}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--variant", action="append", help='"NAME=VALUE;NAME=VALUE" ("" = as is); repeatable')
    parser.add_argument("--mode", choices=("fwd", "fb"), default="fwd")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    variants = args.variant or [""]
    table = {**varlen_workloads(), **tree_workloads(), **head_dim_workloads()}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"mode {args.mode}, variants {variants}, {args.repeat} repeat(s)", flush=True)
    times, checks = defaultdict(list), {}
    for repeat in range(args.repeat):
        for name in args.workloads:
            w = table[name]
            reference = None
            for spec in variants:
                with variant(spec):
                    call = run(w, args.mode)
                    got = [t.detach().clone() for t in call()]
                    ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
                reference = got if reference is None else reference
                checks[name, spec] = difference(reference, got)
                times[name, spec].append(ms)
                print(f"  repeat {repeat + 1} {name} [{spec or 'as is'}]: {ms:.3f} ms, {checks[name, spec]}", flush=True)
    print(f"\nworkload  {'variant':<50} ms (median)  spread  TF/s  vs first")
    for (name, spec), samples in times.items():
        w = table[name]
        flops = w.fwd_flops() if args.mode == "fwd" else w.fwdbwd_flops()
        ms = statistics.median(samples)
        spread = (max(samples) - min(samples)) / ms
        print(f"{name:<9} {spec or '(as is)':<50} {ms:10.3f}  {spread:5.1%}  {flops / ms * 1e-9:5.0f}  "
              f"{checks[name, spec]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
