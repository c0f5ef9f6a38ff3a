"""`packattn tune --check`: does ``backend="auto"`` run the fastest backend? On a sweep of shapes other than the
table's (`check_grid`: other document lengths inside each regime, every head dim, GQA groups 1, 2, 4, 8, masks
causal / none / window), each forward-only and with gradients, it times auto and every backend of ``--backends``
that accepts the call (`tune.measure`, the bench's timing helper with longer runs than the tune's, in `ROUNDS`
interleaved rounds, each in another order (`rotated`), each time the median of them: auto and the backend it
picks run the same kernels, which a drifting clock times apart by up to 8% one after the other) and prints

    shape | pass | auto's pick (what decided) | auto ms | fastest backend | fastest ms | ratio

(ratio = auto ms / fastest ms). It runs with or without FlashAttention-4 installed: a backend that is not there
is neither timed nor picked. Exit status 0 when auto is within 5% of the fastest on every row, else 1.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from packattn import costs, dispatch
from packattn.bench.tune import (
    DEFAULT_BACKENDS,
    DIMS,
    compile_first,
    default_workers,
    device_meta,
    make_shape,
    measure,
    start_clock,
    usable,
)

TIMING = {"warmup": 50, "rep": 100}
ROUNDS = 3
TOLERANCE = 1.05


def check_grid() -> list:
    """At least 30 (shape, pass) rows: 25 shapes x forward / forward+backward, none of the table's lengths (long:
    ``doc_lengths(..., seed 1)``; short: documents of 384 and 300 tokens; mid: 200 and 160; tiny: 96), the
    regimes' low ends included (300 and 160 tokens; since the short rows include 320-token documents, v40, 300 is
    no longer far from a measured length)."""
    out = [make_shape("long", d, dv, 4, "causal", seed=1) for d, dv in DIMS]
    out += [make_shape("s384", d, d, 4, "causal") for d in (64, 128, 256)]
    out += [make_shape("s200", 64, 64, 1, "causal"), make_shape("s200", 128, 128, 8, "causal"),
            make_shape("s200", 256, 256, 1, "causal"), make_shape("s96", 128, 128, 4, "causal"),
            make_shape("s384", 192, 128, 4, "causal"), make_shape("s384", 96, 96, 1, "none"),
            make_shape("long", 128, 128, 1, "none", seed=1), make_shape("long", 256, 256, 4, "none", seed=1),
            make_shape("long", 64, 64, 2, "causal", seed=1), make_shape("long", 128, 128, 4, "window", seed=1),
            make_shape("s384", 128, 128, 4, "window"), make_shape("s200", 128, 64, 4, "none"),
            make_shape("long", 192, 192, 1, "causal", seed=1), make_shape("s300", 64, 64, 1, "causal"),
            make_shape("s160", 96, 96, 1, "causal")]
    return out


def rotated(names: list[str], by: int) -> list[str]:
    """``names`` starting at its ``by``-th (modulo its length): each round times the backends in another order, so
    that no backend is always the first timed after a shape's inputs are made."""
    by %= len(names)
    return names[by:] + names[:by]


def median_times(rounds: list[dict]) -> dict:
    """`tune.measure`'s result from several rounds of it: each time the median of its rounds (the first
    round's refusals)."""
    out = {"fwd": {}, "fwdbwd": {}, "refused": rounds[0]["refused"]}
    for part in ("fwd", "fwdbwd"):
        for name in rounds[0][part]:
            out[part][name] = statistics.median(r[part][name] for r in rounds if name in r[part])
    return out


def check_rows(shape, times: dict, picks: dict) -> list[dict]:
    """The sweep's rows of one shape from `tune.measure`'s times (``auto`` among them) and auto's picks per pass
    (``{grad: (backend, what decided)}``)."""
    rows = []
    for grad, part in ((False, "fwd"), (True, "fwdbwd")):
        backends = {name: ms for name, ms in times[part].items() if name != "auto"}
        auto = times[part].get("auto")
        pick, by = picks[grad]
        row = {"shape": shape.name, "lengths": shape.label, "heads": [shape.heads_q, shape.heads_kv],
               "pass": "f+b" if grad else "fwd", "pick": pick, "decided_by": by, "auto_ms": auto, "times": backends}
        if backends and auto is not None:
            fastest = min(backends, key=backends.get)
            row.update(fastest=fastest, fastest_ms=backends[fastest], ratio=round(auto / backends[fastest], 3))
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> int:
    """The sweep table and a summary line; the number of rows where auto is more than 5% slower (or unmeasured)."""
    print(f"{'shape':<26} {'pass':<4} {'auto picks (by)':<28} {'auto ms':>8} {'fastest':<13} {'ms':>8} {'ratio':>6}")
    slow = 0
    for r in rows:
        ratio = r.get("ratio")
        slow += ratio is None or ratio > TOLERANCE
        auto = f"{r['auto_ms']:.3f}" if r["auto_ms"] is not None else "-"
        print(f"{r['shape']:<26} {r['pass']:<4} {r['pick'] + ' (' + r['decided_by'] + ')':<28} {auto:>8} "
              f"{r.get('fastest', '-'):<13} {r.get('fastest_ms', float('nan')):>8.3f} "
              f"{ratio if ratio is not None else float('nan'):>6.3f}{'  <-- slow' if ratio and ratio > TOLERANCE else ''}")
    worst = max((r for r in rows if r.get("ratio") is not None), key=lambda r: r["ratio"], default=None)
    print(f"auto within {TOLERANCE - 1:.0%} of the fastest backend on {len(rows) - slow} of {len(rows)} rows"
          + (f"; worst {worst['ratio']:.3f} ({worst['shape']} {worst['pass']})" if worst else ""))
    return slow


def picks_of(shape) -> dict:
    """``{grad: (auto's backend, "table" or "rule")}`` for the shape's call on this device."""
    seqs = shape.workload().varlen("cuda")
    out = {}
    for grad in (False, True):
        chosen, _, decision = dispatch.explain(shape.params(seqs, grad))
        out[grad] = (chosen or "none", "table" if decision is not None and decision.choice else "rule")
    return out


def run_check(table=None, names=None, json_path=None, workers: int | None = None, budget: float = 300.0) -> int:
    """Time auto against every backend on `check_grid` (see the module docstring). ``table``: rank by this file
    instead of the packaged table."""
    elapsed, log = start_clock()
    if not torch.cuda.is_available():
        print("packattn tune --check needs a CUDA GPU")
        return 1
    if table is not None:
        costs.use(table)
        dispatch.clear_cache()
    arch, meta = device_meta("packattn tune --check")
    used = costs.table(arch)
    log(f"{meta['device']} ({arch}), FA4 {meta['fa4'] or 'not installed'}; cost table: "
        f"{used.describe() + f', {len(used.rows)} rows' if used else 'none (the priority rule decides)'}")
    names = usable(names or DEFAULT_BACKENDS, log)
    shapes = check_grid()
    compile_first(shapes, names, default_workers() if workers is None else workers,
                  budget - 0.8 * ROUNDS * len(shapes) * (len(names) + 1) - elapsed(), log)
    rows = []
    for number, shape in enumerate(shapes, 1):
        if elapsed() > budget:
            log(f"budget of {budget:.0f} s spent: {len(shapes) - number + 1} shapes not checked")
            break
        times = median_times([measure(shape, rotated(["auto", *names], r), "cuda", TIMING) for r in range(ROUNDS)])
        rows += check_rows(shape, times, picks_of(shape))
        log(f"{number}/{len(shapes)} {shape.name} [{shape.label}]: " + "; ".join(
            f"{r['pass']} auto {r['pick']} {r.get('ratio', '-')}x" for r in rows[-2:]))
    slow = print_rows(rows)
    if json_path:
        Path(json_path).write_text(json.dumps({"env": meta, "table": used.describe() if used else None,
                                               "rows": rows}, indent=1) + "\n")
        log(f"wrote {json_path}")
    return 0 if slow == 0 and len(rows) == 2 * len(shapes) else 1
