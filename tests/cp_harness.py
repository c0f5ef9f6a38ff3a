"""Shared machinery of the context-parallel tests: spawn gloo workers once per world with a
deadline, and compare a CP strategy with single-process attention on the same global inputs.

A test module defines a top-level worker ``worker(rank, world, init_file, out_dir, *args)`` that
calls `init_gloo`, runs its cases (each one usually `errors_vs_single`), and always ends with
`finish` (writes ``rank{r}.json``, destroys the group). The parent calls `spawn`, which joins the
workers with a deadline (a hang fails, it does not block the suite) and returns the per-rank dicts.

`errors_vs_single` and `verdict` are also what scripts/cp_gpu_check.py runs on GPUs with NCCL
(``device="cuda"``, the Triton backends): keep this module importable without pytest.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time

import torch
import torch.multiprocessing as mp

import packattn
from packattn import cp

# seconds for one spawn of a world's workers (it runs every case of that world): a loaded 2-core CI machine
# needs minutes at world 4
SPAWN_TIMEOUT_S = 300
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


def global_rows(seqs) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(total, padding, positions)`` of a `Varlen` or a `packattn.Tree`: the number of global rows,
    which rows are padding (bool; a Tree has none) and every row's position, on the host."""
    if isinstance(seqs, Varlen):
        seq, pos = (t.cpu() for t in seqs.row_map_q())
        return seqs.total_q, seq < 0, pos
    return seqs.total, torch.zeros(seqs.total, dtype=torch.bool), seqs.position_ids.cpu()


def max_abs(t: torch.Tensor) -> float:
    """Largest |t| over its finite entries (0 when none)."""
    t = t.double()
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def errors_vs_single(seqs, mask: dict, heads, dtype: torch.dtype, seed: int, make_plan, *,
                     backend: str = "reference", check_deterministic: bool = False, lse_in_loss: bool = False,
                     cp_options: dict | None = None, device="cpu", single_backend: str = "reference") -> dict:
    """Seeded global inputs (same on every rank); single-process float64 attention vs
    ``cp.attention`` with ``make_plan(seqs)`` in ``dtype``, everything gathered back to the global
    layout. ``seqs``: a `Varlen` or a `packattn.Tree` (``mask`` then ``{}``). ``heads = (heads_q,
    heads_kv, head_dim, head_dim_v)``. Returns max errors of out, lse, dq, dk, dv (``"cp"``;
    ``"single"`` too for a non-float64 dtype: the error of single-process attention in ``dtype``
    with ``single_backend``, the yardstick), the count of non-zeros in padding rows, whether
    ``position_ids`` match, and with ``check_deterministic`` whether two ``deterministic=True``
    runs are bitwise equal; ``"scale"``: the largest |value| of each float64 result (see
    `error_bound`). ``lse_in_loss``: the loss also weighs lse, so gradients flow back
    through lse too. ``cp_options``: more keywords of ``cp.attention`` (not of the single-process
    call). ``device``: where everything runs (inputs drawn on the host in float64, then moved; the
    descriptor moved there before ``make_plan``); the float64 oracle is always backend "reference"."""
    hq, hk, d, dv = heads
    device = torch.device(device)
    seqs = seqs.to(device)
    total, pad, positions = global_rows(seqs)
    g = torch.Generator().manual_seed(seed)
    ref_inputs = [torch.randn(total, h, dim, generator=g, dtype=torch.float64).to(device)
                  for h, dim in ((hq, d), (hk, d), (hk, dv))]
    grad_out = torch.randn(total, hq, dv, generator=g, dtype=torch.float64).to(device)
    grad_lse = torch.randn(hq, total, generator=g, dtype=torch.float32).to(device) if lse_in_loss else None

    def single(q, k, v, backend="reference"):
        return packattn.attention(q, k, v, seqs, backend=backend, return_lse=True, **mask)

    out_ref, lse_ref, grads_ref = grads(single, ref_inputs, grad_out, grad_lse)
    inputs = [t.to(dtype) for t in ref_inputs]
    errors = {"scale": dict(zip(GRAD_NAMES, [max_abs(t) for t in (out_ref, lse_ref, *grads_ref)]))}
    if dtype != torch.float64:
        out1, lse1, grads1 = grads(lambda q, k, v: single(q, k, v, single_backend), inputs, grad_out.to(dtype),
                                   grad_lse)
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
    pad = pad.to(out_g.device)
    errors["padding_nonzero"] = sum(int(t[pad].count_nonzero()) for t in [out_g, *grads_g])
    errors["position_ids_ok"] = bool(torch.equal(plan.position_ids.cpu(), positions[plan.local_rows.cpu()]))
    return errors


def error_bound(errors: dict, key: str, dtype: str, tol64: float, atol: float = 1e-5,
                roundings: float = 0.0) -> float:
    """The largest CP error of ``key`` that passes: ``tol64`` in float64, else 2x the single-process
    error of the same dtype plus ``atol`` plus ``roundings`` rounding units of ``dtype`` (half its
    eps) at the result's scale (``errors["scale"]``: e.g. dK/dV summed over ranks in bf16 is rounded
    more often than one process's; the CPU tests use none)."""
    if dtype == "float64":
        return tol64
    bound = 2 * errors["single"][key] + atol
    if roundings:
        bound += roundings * torch.finfo(getattr(torch, dtype)).eps / 2 * errors["scale"][key]
    return bound


def verdict(errors: dict, dtype: str, tol64: float, atol: float = 1e-5, roundings: float = 0.0) -> list[str]:
    """What is wrong with one rank's `errors_vs_single` result (empty: it passes): an exception,
    non-zero padding rows, wrong ``position_ids``, deterministic runs that differ, an error above
    `error_bound`."""
    if "exception" in errors:
        return [f"exception {errors['exception']}"]
    failures = []
    if errors["padding_nonzero"] != 0:
        failures.append("padding rows not zero")
    if not errors["position_ids_ok"]:
        failures.append("position_ids")
    if "bitwise" in errors and not errors["bitwise"]:
        failures.append("two deterministic runs differ")
    for key, err in errors["cp"].items():
        bound = error_bound(errors, key, dtype, tol64, atol, roundings)
        if not err <= bound:
            failures.append(f"{key} error {err} > {bound}")
    return failures


def check(errors: dict, dtype: str, tol64: float, where: str) -> None:
    """Assert one rank's `errors_vs_single` result (`verdict`): float64 within ``tol64``; lower
    precision within 2x the single-process error of the same dtype plus 1e-5."""
    assert "exception" not in errors, f"{where}: {errors}"
    failures = verdict(errors, dtype, tol64)
    assert not failures, f"{where}: {'; '.join(failures)}"


# ------------------------------------------------------------------ parent side
def spawn(worker, world: int, tmp_dir: str, args: tuple, timeout_s: float) -> list[dict]:
    """Run ``worker(rank, world, init_file, tmp_dir, *args)`` on ``world`` processes; fail the
    test if they do not all finish within ``timeout_s``; return each rank's JSON results."""
    import pytest

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
