"""`packattn info | explain | demo | bench | tune`, and `packattn --version`."""

from __future__ import annotations

import argparse
import platform
import sys


def _versions() -> dict[str, str]:
    import torch

    import packattn

    out = {"packattn": packattn.__version__, "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "not installed"
    if torch.cuda.is_available():
        out["device"] = f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    else:
        out["device"] = "CPU (no CUDA device)"
    return out


def info() -> int:
    from packattn.backends import REGISTRY

    for key, value in _versions().items():
        print(f"{key:>10}: {value}")
    print("\nbackends (priority order):")
    for backend in REGISTRY:
        why = backend.unavailable()
        print(f"  {backend.name:<14} {'available' if why is None else 'unavailable: ' + why}")
    print("\nwhich backend auto picks for a given call, and why: packattn explain --help")
    return 0


def _version() -> str:
    import packattn

    return f"packattn {packattn.__version__}"


def _parser() -> argparse.ArgumentParser:
    from packattn import explain

    parser = argparse.ArgumentParser(prog="packattn", description="attention for packed sequences")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, versions, and which backends can run here")
    explain.add_arguments(sub.add_parser(
        "explain", help="which backend auto picks for a described call, and why the others are passed over",
        description=explain.__doc__.split("\n\n")[0]))
    demo = sub.add_parser("demo", help="run every available backend on packed batches against the reference, "
                                       "and a GRPO training step packed as a tree vs as varlen")
    demo.add_argument("what", nargs="?", choices=("all", "tree"), default="all",
                      help="all (default): backends, then the tree step; tree: only the GRPO tree-vs-varlen step")
    demo.add_argument("--size", choices=("auto", "small", "large"), default="auto", help="problem size (auto: large on a GPU)")
    demo.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="time the workloads of workloads.md on every implementation (GPU)")
    bench.add_argument("--workloads", nargs="*", help="e.g. W1 W2 (default: all)")
    bench.add_argument("--impls", nargs="*", help="implementations (default: all)")
    bench.add_argument("--json", help="write results as JSON here")
    bench.add_argument("--plot", help="write a PNG bar chart here")
    bench.add_argument("--cp", action="store_true", help="context parallelism: W10 on every GPU of a torchrun "
                       "launch (torchrun --nproc_per_node N -m packattn.cli bench --cp)")
    bench.add_argument("--strategies", nargs="*", help="--cp: CP strategies (default: allgather p2p a2a a2a+p2p)")
    bench.add_argument("--balances", nargs="*", help="--cp: plan balances (default: zigzag documents)")
    bench.add_argument("--backend", default="triton", help="--cp: attention backend of the local problems")
    bench.add_argument("--no-check", action="store_true", help="--cp: skip the comparison with one GPU")
    bench.add_argument("--overlap-groups", nargs="*", type=int, metavar="G",
                       help="--cp: run strategy allgather once per G kv-head groups (cp.attention's overlap_groups; "
                       "default: its default)")
    bench.add_argument("--cp-docs", choices=("w10", "one"), default="w10",
                       help="--cp: W10's documents, or one document of all its tokens (every strategy communicates)")
    bench.add_argument("--autograd-threads", choices=("on", "off"), default="on",
                       help="off: every backward on the calling thread (torch.autograd.set_multithreading_enabled"
                       "(False)) instead of autograd's CUDA device thread, for every implementation")
    bench.add_argument("--heat-up", type=float, default=0.0, metavar="SECONDS",
                       help="run matmuls this long before the first row, so no row is timed on a cold GPU")
    bench.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                       help="let the GPU idle this long before each row (rows start from a similar temperature)")
    bench.add_argument("--rounds", type=int, default=1, metavar="N",
                       help="measure every row N times (N passes over all rows) and show the median of each time")
    bench.add_argument("--sweep", choices=("head-dims",),
                       help="head-dims: every head dim, MLA and short documents at 64 / 128 / 256 "
                            "(packattn.bench.workloads.head_dim_workloads), with --workloads added")
    bench.add_argument("--cp-scaling", nargs="+", metavar="JSON",
                       help="plot efficiency against world size from --cp JSON files into --plot (no run)")
    _tune_parser(sub)
    return parser


def _tune_parser(sub) -> None:
    tune = sub.add_parser("tune", help="time the backends on a grid of shapes on this GPU and write the cost table "
                                       "auto dispatch ranks them by (GPU)",
                          description="packattn/bench/tune.py: the grid, the budget, what is timed")
    tune.add_argument("--out", metavar="FILE", help="write the table here (JSON, rewritten after every shape); "
                      "commit it as packattn/data/costs_<arch>.json")
    tune.add_argument("--check", action="store_true", help="instead: time auto against every backend on a sweep "
                      "of other shapes (forward and forward+backward) and print auto's ratio to the fastest")
    tune.add_argument("--replay", metavar="CHECK_JSON", help="instead, on any machine: replay a --check run's "
                      "--json rows against a table (--table, default the packaged one): what auto would pick, and "
                      "its ratio to the fastest on that run's own timings")
    tune.add_argument("--table", metavar="FILE", help="--check / --replay: rank by this table instead of the "
                      "packaged one")
    tune.add_argument("--json", metavar="FILE", help="--check: write the sweep's rows here")
    tune.add_argument("--budget", type=float, default=290.0, metavar="SECONDS",
                      help="wall time for the whole run, compiles included (default 290): timing stops when it is "
                           "spent, and the table written so far stays valid")
    tune.add_argument("--resume", action="store_true", help="keep the shapes --out already holds, time the rest")
    tune.add_argument("--backends", nargs="+", metavar="NAME",
                      help="backends to time (default: fa4 triton torch_varlen; e.g. add flex)")
    tune.add_argument("--workers", type=int, metavar="N", help="processes that compile every kernel first, in "
                      "parallel (default: CPU cores - 2, at most 14; 0: compile while timing)")
    tune.add_argument("--only", metavar="REGEX", help="only the grid shapes whose name matches (e.g. 'long d128')")


def _tune(args, parser, argv) -> int:
    if args.replay:
        from packattn.bench.tune_replay import run_replay

        return run_replay(args.replay, args.table)
    if args.check:
        from packattn.bench.tune_check import run_check

        return run_check(args.table, args.backends, args.json, args.workers, args.budget)
    if not args.out:
        parser.error("packattn tune needs --out FILE (or --check, or --replay CHECK_JSON)")
    from packattn.bench.tune import run_tune

    command = "packattn " + " ".join(argv if argv is not None else sys.argv[1:])
    return run_tune(args.out, budget=args.budget, resume=args.resume, names=args.backends, workers=args.workers,
                    only=args.only, command=command)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "explain":
        from packattn import explain

        try:
            return explain.run(args)
        except ValueError as e:  # a bad description: a usage error, not a traceback
            parser.error(str(e))
    if args.command == "bench" and args.cp_scaling:
        if not args.plot:
            parser.error("--cp-scaling needs --plot FILE.png")
        from packattn.bench.cp import plot_scaling

        plot_scaling(args.cp_scaling, args.plot)
        return 0
    if args.command == "bench" and args.cp:
        from packattn.bench.cp import run_cp_bench

        return run_cp_bench(args.strategies, args.balances, args.backend, args.json, check=not args.no_check,
                            overlap_groups=args.overlap_groups, docs=args.cp_docs, plot_path=args.plot)
    if args.command == "bench":
        from packattn.bench.runner import run_bench

        workloads = args.workloads
        if args.sweep == "head-dims":
            from packattn.bench.workloads import head_dim_workloads

            workloads = [*(workloads or []), *head_dim_workloads()]
        return run_bench(workloads, args.impls, args.json, args.plot, args.autograd_threads == "on",
                         args.heat_up, args.pause, args.rounds)
    if args.command == "info":
        return info()
    if args.command == "tune":
        try:
            return _tune(args, parser, argv)
        except ValueError as e:  # an unknown backend, a --resume of another device's file
            parser.error(str(e))
    from packattn.demo_tree import run_demo_tree

    if args.what == "tree":
        return run_demo_tree(size=args.size, seed=args.seed)
    from packattn.demo import run_demo

    status = run_demo(size=args.size, seed=args.seed)
    print()
    return max(status, run_demo_tree(size=args.size, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
