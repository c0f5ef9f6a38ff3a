"""`packattn demo`: packed batches (varlen, padding, window, chunk, cross, GQA) on every available
backend, each compared with the reference backend computed in float32 from the same inputs.

Backends that cannot run in this process at all (no CUDA, a missing package) are listed once, with
the reason, before the table; the table has a row per case for the others. Times are medians of
several forward+backward runs after one warm-up run."""

from __future__ import annotations

import random
import statistics
import time

import torch

from packattn import backends, dispatch
from packattn.api import attention
from packattn.mask import Mask
from packattn.varlen import Varlen

CASES = [
    # name, options for attention(), pad_to_multiple, cross-attention
    ("varlen causal", {"causal": True}, None, False),
    ("padded causal", {"causal": True}, 64, False),
    ("window (64,0)", {"causal": True, "window": (64, 0)}, None, False),
    ("chunk 128", {"causal": True, "chunk_size": 128}, None, False),
    ("cross bottom-right", {"causal": True}, None, True),
    ("cross top-left, padded", {"causal": "top_left"}, 16, True),
]


def _lengths(rng: random.Random, total: int, longest: int) -> list[int]:
    out = []
    while sum(out) < total:
        out.append(rng.choice([0, 1, rng.randint(2, longest)]))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn``, each timed alone, after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_demo(size: str = "auto", seed: int = 0, reps: int | None = None) -> int:
    """Every case on every backend that can run here; ``reps`` timed runs per row (default 10 large, 5 small)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    large = size == "large" or (size == "auto" and device.type == "cuda")
    total, longest, heads, dim = (16384, 4096, (16, 4), 128) if large else (600, 150, (4, 2), 32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = reps or (10 if large else 5)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"packattn demo on {device} ({'large' if large else 'small'}): ~{total} tokens, heads {heads[0]}/{heads[1]}, "
          f"head_dim {dim}, {str(dtype).replace('torch.', '')}; errors vs the reference in float32\n")
    usable = _usable_backends()
    rows = []
    failures = 0
    for name, opts, pad, cross in CASES:
        lq = _lengths(rng, total, longest)
        lk = [max(0, n + rng.randint(-20, 20)) for n in lq] if cross else None
        seqs = Varlen.from_lengths(lq, lk, pad_to_multiple=pad, device=device)
        q = torch.randn(seqs.total_q, heads[0], dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(seqs.total_kv, heads[1], dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(seqs.total_kv, heads[1], dim, device=device, dtype=dtype, requires_grad=True)
        dout = torch.randn(seqs.total_q, heads[0], dim, device=device, dtype=dtype)
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = attention(q32, k32, v32, seqs, backend="reference", **opts)
        ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
        for backend in usable:
            why = _unsupported(backend, q, k, v, seqs, opts)
            if why is not None:
                rows.append((name, backend.name, "-", "-", "-", why))
                continue

            def step(backend=backend):
                out = attention(q, k, v, seqs, backend=backend.name, **opts)
                return out, torch.autograd.grad(out, (q, k, v), dout)

            row = _check_backend(name, backend.name, step, ref, ref_grads, dtype, device, reps)
            failures += row[-1] != "ok"
            rows.append(row)
    tree_rows, tree_failures, saved = _tree_case(usable, device, dtype, large, heads, dim, reps, rng)
    rows += tree_rows
    failures += tree_failures
    _print_table(("case", "backend", "max|out err|", "max|grad err|", f"fwd+bwd ms (median of {reps})", "status"),
                 rows)
    print(f"\ntree case: {saved}")
    print(f"\n{'all backends agree with the reference' if not failures else f'{failures} failures'}")
    return 1 if failures else 0


def _check_backend(case: str, name: str, step, ref, ref_grads, dtype, device, reps: int) -> tuple:
    """One table row: ``step() -> (out, grads)`` against the float32 reference, timed; the last
    field is "ok" only when the output is finite and within tolerance."""
    try:
        out, grads = step()
        err_out = (out.float() - ref).abs().max().item()
        err_grad = max((g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads))
        ms = _time(step, device, reps)
        ok = torch.isfinite(out).all().item() and err_out < (2e-2 if dtype != torch.float32 else 1e-4)
        return case, name, f"{err_out:.2e}", f"{err_grad:.2e}", f"{ms:.2f}", "ok" if ok else "MISMATCH"
    except Exception as e:  # report, keep going
        return case, name, "-", "-", "-", f"error: {type(e).__name__}: {e}"[:90]


def _usable_backends() -> list:
    """The backends that can run in this process; one line for each of the others, with its reason."""
    usable, missing = [], []
    for backend in backends.registry():
        why = backend.unavailable()
        if why is None:
            usable.append(backend)
        else:
            missing.append((backend.name, why))
    if missing:
        print("not available here (skipped in every case):")
        for name, why in missing:
            print(f"  {name}: {why}")
        print()
    return usable


def _tree_case(usable, device, dtype, large: bool, heads, dim: int, reps: int, rng: random.Random):
    """A GRPO-like batch packed as a `Tree`, on every tree-capable backend, against each sequence run
    alone (the expanded batch, causal, reference backend in float32)."""
    from packattn.tree import Tree

    prompts, group, prompt_len, response_len = (2, 8, 2048, 1024) if large else (2, 4, 40, 30)
    sequences, next_id = [], 0
    for _ in range(prompts):
        prompt = list(range(next_id, next_id + prompt_len))
        next_id += prompt_len
        for _ in range(group):
            n = rng.randint(1, response_len)
            sequences.append(prompt + list(range(next_id, next_id + n)))
            next_id += n
    tree = Tree.from_sequences(sequences, device=device)
    expanded = tree.unpacked
    saved = (f"{len(sequences)} sequences, {expanded.total_q} tokens expanded, {tree.total} packed as a tree "
             f"({expanded.total_q / tree.total:.2f}x fewer)")
    q = torch.randn(tree.total, heads[0], dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(tree.total, heads[1], dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(tree.total, heads[1], dim, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(expanded.total_q, heads[0], dim, device=device, dtype=dtype)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention(*(tree.gather(t) for t in (q32, k32, v32)), expanded, causal=True, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    rows, failures = [], 0
    for backend in usable:
        why = _unsupported(backend, q, k, v, tree, {"causal": True})
        if why is not None:
            rows.append(("tree (GRPO)", backend.name, "-", "-", "-", why))
            continue

        def step(backend=backend):
            out = tree.gather(attention(q, k, v, tree, backend=backend.name))
            return out, torch.autograd.grad(out, (q, k, v), dout)

        row = _check_backend("tree (GRPO)", backend.name, step, ref, ref_grads, dtype, device, reps)
        failures += row[-1] != "ok"
        rows.append(row)
    return rows, failures, saved


def _unsupported(backend, q, k, v, seqs, opts):
    """Why ``backend`` does not take this case (the call's `dispatch.Params`, as `attention` keys it), or None."""
    params = dispatch.call_params(seqs, device_type=q.device.type, dtype=q.dtype, heads_q=q.shape[1],
                                  heads_kv=k.shape[1], head_dim=q.shape[2], head_dim_v=v.shape[2],
                                  mask=Mask.make(**opts), requires_grad=True)
    return backend.unsupported(params) or backend.auto_skip(params)


def _print_table(header, rows):
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(*header)
        for row in rows:
            table.add_row(*row)
        Console(width=160).print(table)
    except ImportError:
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
