"""`packattn explain`: which backend ``backend="auto"`` picks for a described call, and why each other
backend is passed over, without running anything (no tensors are allocated; descriptors are built on
the host). It asks the same dispatch code a call asks, with the environment's overrides
(``PACKATTN_BACKEND``, ``PACKATTN_DISABLE``) applied, and says what decided: the measured-cost table's row
(`packattn.costs`: its key, the table's device and date, every backend's time) or the priority rule. It names
the call's cost-table key, length regime included, and says when a row of another regime stands in for a
regime the table has no row of (`costs.STAND_INS`).

A call is described by a benchmark workload (``--workload W1``) and/or flags: lengths, heads, head
dims, dtype, device, mask, descriptor kind, gradients, lse, determinism.
"""

from __future__ import annotations

import argparse

DTYPES = ("bfloat16", "float16", "float32", "float64")
KINDS = ("varlen", "dense", "tree")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", help="start from a workload of shared/workloads.md (W1-W8, W6, W7, W8tree); "
                        "the flags below override it")
    parser.add_argument("--kind", choices=KINDS, help="descriptor: varlen (default), dense (bshd: --lengths BxS), "
                        "tree (a Tree of sequences of --lengths; dispatch keys on the longest)")
    parser.add_argument("--lengths", help="query lengths: comma-separated, NxL repeats L N times (e.g. 300,0,1,1200 "
                        "or 64x512); default 8x4096")
    parser.add_argument("--lengths-kv", help="key lengths (cross-attention), same syntax; default: --lengths")
    parser.add_argument("--pad-to", type=int, metavar="M", help="sequences in slots of a multiple of M rows "
                        "(padding between sequences)")
    parser.add_argument("--heads", help="HQ or HQ/HKV (GQA), default 16/16")
    parser.add_argument("--head-dim", help="D or D/DV (value head dim), default 128")
    parser.add_argument("--dtype", choices=DTYPES, help="default bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available here, else cpu")
    parser.add_argument("--causal", nargs="?", const="bottom_right", choices=("none", "bottom_right", "top_left"),
                        help="causal mask (bare --causal: bottom_right); default: the workload's, else none")
    parser.add_argument("--window", help="LEFT,RIGHT (-1 = unbounded; write --window=-1,0 for a leading -1)")
    parser.add_argument("--chunk", type=int, metavar="C", help="chunk_size")
    parser.add_argument("--no-grad", action="store_true", help="inference: no gradients (default: with gradients)")
    parser.add_argument("--lse", action="store_true", help="return_lse=True")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--backend", default="auto", help="the backend= argument of the call (default auto)")


def parse_lengths(text: str, what: str = "--lengths") -> list[int]:
    """``"300,0,1,1200"`` / ``"64x512"`` / ``"4096,8x512"`` -> a list of ints >= 0 (ValueError naming the bad part)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        count, _, length = part.rpartition("x")
        try:
            n, repeat = int(length), int(count) if count else 1
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a length or NxL") from None
        if n < 0 or repeat < 0:
            raise ValueError(f"{what}: {part!r} has a negative number")
        out += [n] * repeat
    return out


def _pair(text: str | None, what: str) -> tuple[int, int] | None:
    if text is None:
        return None
    first, _, second = text.partition("/")
    try:
        return int(first), int(second or first)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not N or N/M") from None


def describe_call(args: argparse.Namespace):
    """``(Params, one line about the descriptor)`` for the parsed arguments."""
    import torch

    from packattn import dispatch
    from packattn.mask import Mask

    base = _workload(args.workload)
    kind = args.kind or ("tree" if base is not None and hasattr(base, "sequences") else "varlen")
    lengths = parse_lengths(args.lengths) if args.lengths else (base.lengths_q if base else [4096] * 8)
    if args.lengths_kv:
        lengths_kv = parse_lengths(args.lengths_kv, "--lengths-kv")
    else:
        lengths_kv = base.lengths_kv if base is not None and args.lengths is None else None
    heads = _pair(args.heads, "--heads") or ((base.heads_q, base.heads_kv) if base else (16, 16))
    dims = _pair(args.head_dim, "--head-dim") or ((base.head_dim, base.head_dim) if base else (128, 128))
    options = dict(base.options) if base else {}
    if args.causal is not None:
        options["causal"] = {"none": False, "bottom_right": True, "top_left": "top_left"}[args.causal]
    if args.window is not None:
        options["window"] = _pair(args.window.replace(",", "/"), "--window")
    if args.chunk is not None:
        options["chunk_size"] = args.chunk
    pad = args.pad_to if args.pad_to is not None else (base.pad_to_multiple if base else None)
    seqs, line = _descriptor(kind, lengths, lengths_kv, pad, base if args.lengths is None else None)
    if kind == "tree":
        options = {"causal": True}  # a tree's own rule (its causal part is what dispatch keys on)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    params = dispatch.call_params(
        seqs, device_type=device, dtype=getattr(torch, args.dtype or "bfloat16"), heads_q=heads[0], heads_kv=heads[1],
        head_dim=dims[0], head_dim_v=dims[1], mask=Mask.make(**options), dense=kind == "dense", return_lse=args.lse,
        deterministic=args.deterministic, requires_grad=not args.no_grad)
    return params, line


def _workload(name: str | None):
    if name is None:
        return None
    from packattn.bench.workloads import all_workloads

    workloads = all_workloads()
    if name not in workloads:
        raise ValueError(f"--workload {name!r}: known workloads are {', '.join(workloads)}")
    return workloads[name]


def _descriptor(kind: str, lengths: list[int], lengths_kv, pad, tree_workload):
    """The host descriptor (on the CPU: dispatch looks only at its host values) and a line about it."""
    from packattn.varlen import Varlen

    if kind == "tree":
        from packattn.tree import Tree

        if tree_workload is not None and hasattr(tree_workload, "sequences"):
            sequences = tree_workload.sequences
        else:  # sequences of these lengths sharing nothing: dispatch keys only on the longest
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            sequences = [list(range(s, s + n)) for s, n in zip(starts, lengths)]
        tree = Tree.from_sequences(sequences)
        return tree, (f"tree of {len(sequences)} sequences: {tree.total} packed rows ({tree.unpacked.total_q} "
                      f"expanded), deepest {tree.max_depth}")
    if kind == "dense":
        if len(set(lengths)) > 1 or (lengths_kv and len(set(lengths_kv)) > 1):
            raise ValueError("--kind dense takes equal lengths: --lengths BxS")
        seq_kv = lengths_kv[0] if lengths_kv else (lengths[0] if lengths else 0)
        seqs = Varlen.uniform(len(lengths), lengths[0] if lengths else 0, seq_kv, "cpu")
        return seqs, f"dense batch {len(lengths)} x {seqs.max_seqlen_q} queries x {seq_kv} keys"
    seqs = Varlen.from_lengths(lengths, lengths_kv, pad_to_multiple=pad)
    padded = f", padded to multiples of {pad}" if seqs.pad_between_seqs else ""
    return seqs, (f"varlen of {seqs.num_seqs} sequences: {seqs.total_q} query / {seqs.total_kv} key rows, longest "
                  f"{seqs.max_seqlen_q} / {seqs.max_seqlen_kv}{padded}")


def run(args: argparse.Namespace) -> int:
    """Print the call, the pick and every backend's reason; 0 when some backend can run the call, else 1."""
    from packattn import dispatch

    params, line = describe_call(args)
    chosen, listing, decision = dispatch.explain(params, args.backend)
    print(f"call: {dispatch.describe(params)}, backend={args.backend!r}")
    print(f"      {line}")
    print(f"      {_key_line(params)}")
    if params.device_type == "cuda" and not _has_cuda():
        print("      (no CUDA device here: the backends that need one are unavailable; explain on the GPU machine)")
    print(f"picks: {chosen or 'nothing (no backend can run this call)'}")
    if decision is not None and chosen is not None:
        for text in _decision_lines(decision):
            print(text)
    width = max(len(name) for name, _ in listing)
    for name, why in listing:
        if name == chosen:
            verdict = "<- picked"
        elif why is None:
            verdict = "could run it (lower priority)"
        else:
            verdict = why
        print(f"  {name:<{width}}  {verdict}")
    return 0 if chosen else 1


def _key_line(params) -> str:
    """The call's cost-table key and its length regime's range (`costs.call_key`), or why it has none."""
    from packattn import costs

    key, why = costs.call_key(params)
    if key is None:
        return f"cost-table key: none ({why})"
    return f"cost-table key: {key.describe()} (length regime {key.regime}: longest {costs.REGIME_LENGTHS[key.regime]})"


def _decision_lines(decision) -> list[str]:
    """What decided auto's pick (`costs.Decision`): the row, the shapes it was measured on and the table's
    device and versions; or the priority rule and why no row decided."""
    lines = [f"decided by: {decision.describe()}"]
    lines += [f"      measured on {_shape_line(shape)}" for shape in (decision.row.shapes if decision.choice else ())]
    meta = decision.table.meta if decision.table is not None else {}
    if meta.get("device"):
        lines.append(f"      table: {decision.table.source} ({meta['device']}, {meta.get('date')}; torch "
                     f"{meta.get('torch')}, triton {meta.get('triton')}, FA4 {meta.get('fa4') or 'not installed'})")
    return lines


def _shape_line(shape) -> str:
    """One measured shape of a cost-table row: its lengths, heads and times."""
    if not isinstance(shape, dict):
        return str(shape)
    heads = "/".join(str(h) for h in shape.get("heads", ()))
    times = ", ".join(f"{name} {ms:.3g}" for name, ms in sorted(shape.get("ms", {}).items(), key=lambda t: t[1]))
    return f"{shape.get('lengths', '?')}, heads {heads}: {times} ms"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
