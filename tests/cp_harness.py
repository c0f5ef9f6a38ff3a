"""Shared machinery of the context-parallel tests: spawn gloo workers once per world with a
deadline, and compare a CP strategy with single-process attention on the same global inputs.

A test module defines a top-level worker ``worker(rank, world, init_file, out_dir, *args)`` that
calls `init_gloo`, runs its cases (each one usually `errors_vs_single`), and always ends with
`finish` (writes ``rank{r}.json``, destroys the group). The parent calls `spawn`, which joins the
workers with a deadline (a hang fails, it does not block the suite) and returns the per-rank dicts.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

import packattn
from packattn import cp
from packattn.varlen import Varlen

GRAD_NAMES = ("out", "lse", "dq", "dk", "dv")


# ------------------------------------------------------------------ worker side
def init_gloo(rank: int, world: int, init_file: str, timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def finish(rank: int, out_dir: str, results: dict) -> None:
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_case(fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)`` (a case's result dict), or ``{"exception": ...}`` when it raises: a worker
    reports the failure and keeps its process group in step for the next case."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return {"exception": f"{type(exc).__name__}: {exc}"}


def grads(fn, inputs, grad_out, grad_lse=None):
    """``fn(*leaves) -> (out, lse)``; returns out, lse and the leaves' gradients of ``sum(out *
    grad_out)`` (plus ``sum(lse * grad_lse)`` over the finite lse when ``grad_lse`` is given)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    loss = (out * grad_out).sum()
    if grad_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
    loss.backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|; inf when their non-finite entries (lse = -inf) differ."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
        return math.inf
    diff = (a[finite] - b[finite]).abs()
    return float(diff.max()) if diff.numel() else 0.0


def errors_vs_single(seqs: Varlen, mask: dict, heads, dtype: torch.dtype, seed: int, make_plan, *,
                     backend: str = "reference", check_deterministic: bool = False, lse_in_loss: bool = False,
                     cp_options: dict | None = None) -> dict:
    """Seeded global inputs (same on every rank); single-process float64 attention vs
    ``cp.attention`` with ``make_plan(seqs)`` in ``dtype``, everything gathered back to the global
    layout. ``heads = (heads_q, heads_kv, head_dim, head_dim_v)``. Returns max errors of out, lse,
    dq, dk, dv (``"cp"``; ``"single"`` too for a non-float64 dtype: the same-dtype single-process
    error, the yardstick), the count of non-zeros in padding rows, whether ``position_ids`` match,
    and with ``check_deterministic`` whether two ``deterministic=True`` runs are bitwise equal.
    ``lse_in_loss``: the loss also weighs lse, so gradients flow back through lse too.
    ``cp_options``: more keywords of ``cp.attention`` (not of the single-process call)."""
    hq, hk, d, dv = heads
    g = torch.Generator().manual_seed(seed)
    ref_inputs = [torch.randn(seqs.total_q, h, dim, generator=g, dtype=torch.float64)
                  for h, dim in ((hq, d), (hk, d), (hk, dv))]
    grad_out = torch.randn(seqs.total_q, hq, dv, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(hq, seqs.total_q, generator=g, dtype=torch.float32) if lse_in_loss else None

    def single(q, k, v):
        return packattn.attention(q, k, v, seqs, backend="reference", return_lse=True, **mask)

    out_ref, lse_ref, grads_ref = grads(single, ref_inputs, grad_out, grad_lse)
    inputs = [t.to(dtype) for t in ref_inputs]
    errors = {}
    if dtype != torch.float64:
        out1, lse1, grads1 = grads(single, inputs, grad_out.to(dtype), grad_lse)
        errors["single"] = dict(zip(GRAD_NAMES, [max_err(out1, out_ref), max_err(lse1, lse_ref)]
                                    + [max_err(a, b) for a, b in zip(grads1, grads_ref)]))

    plan = make_plan(seqs)
    local = [plan.shard(t) for t in inputs]

    def parallel(q, k, v):
        return cp.attention(q, k, v, plan, backend=backend, return_lse=True,
                            deterministic=check_deterministic, **mask, **(cp_options or {}))

    local_grads = (plan.shard(grad_out.to(dtype)), None if grad_lse is None else plan.shard(grad_lse.t()).t())
    out_l, lse_l, grads_l = grads(parallel, local, *local_grads)
    if check_deterministic:
        again = grads(parallel, local, *local_grads)
        errors["bitwise"] = all(torch.equal(a, b) for a, b in zip([out_l, lse_l, *grads_l], [*again[:2], *again[2]]))
    with torch.no_grad():
        out_g, lse_g = plan.unshard(out_l), plan.unshard(lse_l.t().contiguous()).t()
        grads_g = [plan.unshard(t) for t in grads_l]
    errors["cp"] = dict(zip(GRAD_NAMES, [max_err(out_g, out_ref), max_err(lse_g, lse_ref)]
                            + [max_err(a, b) for a, b in zip(grads_g, grads_ref)]))
    pad = seqs.row_map_q()[0] < 0
    errors["padding_nonzero"] = sum(int(t[pad].count_nonzero()) for t in [out_g, *grads_g])
    errors["position_ids_ok"] = bool(torch.equal(plan.position_ids, seqs.row_map_q()[1][plan.local_rows]))
    return errors


def check(errors: dict, dtype: str, tol64: float, where: str) -> None:
    """Assert one rank's `errors_vs_single` result: float64 within ``tol64``; lower precision
    within 2x the single-process error of the same dtype plus 1e-5."""
    assert "exception" not in errors, f"{where}: {errors}"
    assert errors["padding_nonzero"] == 0, f"{where}: padding rows not zero"
    assert errors["position_ids_ok"], f"{where}: position_ids"
    if "bitwise" in errors:
        assert errors["bitwise"], f"{where}: two deterministic runs differ"
    for key, err in errors["cp"].items():
        bound = tol64 if dtype == "float64" else 2 * errors["single"][key] + 1e-5
        assert err <= bound, f"{where}: {key} error {err} > {bound}"


# ------------------------------------------------------------------ parent side
def spawn(worker, world: int, tmp_dir: str, args: tuple, timeout_s: float) -> list[dict]:
    """Run ``worker(rank, world, init_file, tmp_dir, *args)`` on ``world`` processes; fail the
    test if they do not all finish within ``timeout_s``; return each rank's JSON results."""
    init_file = os.path.join(tmp_dir, "init")
    ctx = mp.spawn(worker, args=(world, init_file, tmp_dir, *args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"CP workers (world={world}) did not finish in {timeout_s} s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for r in range(world):
        with open(os.path.join(tmp_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out
