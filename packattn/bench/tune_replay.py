"""`packattn tune --replay CHECK.json`: what ``backend="auto"`` would pick on each row of a `packattn tune --check`
run (its ``--json`` file) if it ranked by another cost table (``--table``, default the packaged one), judged on
that run's own timings. No GPU: the check timed every backend on every row, so the replayed pick's time is read
from the row, and the ratio is that time over the fastest backend's (the check's own ratio used auto's measured
time, which also holds a little dispatch time and noise).

The pick is decided by the same code as a call's (`costs.covering`, `costs.rank`; the priority rule with
`Backend.defers_to` where no row covers), among the backends the check timed on the row (those that were
installed and accepted the call), for the device the check ran on (its ``env.capability``, sm_90 kernels on).
``stand_ins`` replaces `costs.STAND_INS` for a what-if: ``{"mid": "tiny"}`` ranks the ``mid`` regime's calls by
the ``tiny`` rows, as a tiny bound of 256 would.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import torch

from packattn import backends, costs, dispatch
from packattn.bench.tune import make_shape
from packattn.bench.tune_check import TOLERANCE

_NAME = re.compile(r"^(long|s\d+) d(\d+)(?:v(\d+))? g(\d+) (\w+)$")
_SEED = re.compile(r"doc_lengths\(\d+, (\d+)\)")


def shape_of(name: str, label: str = ""):
    """The `tune.Shape` of a check row's ``shape`` name (``"s200 d64 g1 causal"``; long ones take the seed of
    their ``lengths`` label)."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a tune shape name (like 's200 d64 g1 causal')")
    regime, d, dv, group, mask = match.groups()
    seed = _SEED.search(label)
    return make_shape(regime, int(d), int(dv or d), int(group), mask, seed=int(seed.group(1)) if seed else 0)


def _params(shape, grad: bool) -> dispatch.Params:
    """The call's `dispatch.Params` as on the check's GPU (the descriptor is built on the host)."""
    return dispatch.call_params(shape.workload().varlen("cpu"), device_type="cuda", dtype=torch.bfloat16,
                                heads_q=shape.heads_q, heads_kv=shape.heads_kv, head_dim=shape.head_dim,
                                head_dim_v=shape.head_dim_v, mask=shape.mask, requires_grad=grad)


def _rule(params, candidates: list[str], capability) -> str:
    """The priority rule: the first candidate, or the one it defers to (`Backend.defers_to`) on that device."""
    first = backends.get(candidates[0])
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a: tuple(capability)), \
            mock.patch("packattn.ops.runtime.support.sm90_kernels_off", lambda: None):
        deferral = first.defers_to(params)
    return deferral[0] if deferral is not None and deferral[0] in candidates else candidates[0]


def replay_row(found: costs.Table, row: dict, capability=(9, 0), stand_ins=None) -> dict:
    """One check row replayed: ``{shape, pass, logged (pick, by), pick, by, row (the covering row's key or
    None), ratio, changed}``."""
    shape = shape_of(row["shape"], row.get("lengths", ""))
    params = _params(shape, row["pass"] == "f+b")
    times = row["times"]
    candidates = [b.name for b in backends.registry() if b.name in times]
    key, _ = costs.call_key(params)
    covering, note = costs.covering(found, key, stand_ins)
    decision = costs.rank(found, covering, candidates, {}, note) if covering is not None else None
    if decision is not None and decision.choice is not None:
        pick, by = decision.choice, f"{covering.key.regime} row" if note else "table"
    else:
        pick, by = _rule(params, candidates, capability), "rule"
    fastest = min(times.values())
    return {"shape": row["shape"], "pass": row["pass"], "logged": (row["pick"], row["decided_by"]), "pick": pick,
            "by": by, "row": covering.key.describe() if covering is not None else None, "regime": key.regime,
            "ratio": round(times[pick] / fastest, 3), "changed": pick != row["pick"]}


def replay(check, table=None, stand_ins=None) -> list[dict]:
    """Every row of a check run (its JSON file or the parsed dict) replayed against ``table`` (a path or
    `costs.Table`; default the packaged table of the check's architecture)."""
    data = json.loads(Path(check).read_text()) if not isinstance(check, dict) else check
    capability = data.get("env", {}).get("capability") or (9, 0)
    if table is None:
        found = costs.table(f"sm{capability[0]}{capability[1]}")
        if found is None:
            raise ValueError(f"no packaged cost table for sm{capability[0]}{capability[1]}: pass --table")
    else:
        found = table if isinstance(table, costs.Table) else costs.load(table)
    return [replay_row(found, row, capability, stand_ins) for row in data["rows"] if row.get("times")]


def print_replay(rows: list[dict]) -> int:
    """The replayed rows (``*`` where the pick changed) and a summary; the number of rows over 5%."""
    print(f"{'shape':<24} {'pass':<4} {'regime':<6} {'logged pick':<20} {'replayed pick':<26} {'ratio':>6}")
    slow = 0
    for r in rows:
        slow += r["ratio"] > TOLERANCE
        logged = f"{r['logged'][0]} ({r['logged'][1]})"
        print(f"{r['shape']:<24} {r['pass']:<4} {r['regime']:<6} {logged:<20} "
              f"{r['pick'] + ' (' + r['by'] + ')':<26} {r['ratio']:>6.3f}{' *' if r['changed'] else ''}"
              f"{'  <-- slow' if r['ratio'] > TOLERANCE else ''}")
    changed = sum(r["changed"] for r in rows)
    print(f"replayed: within {TOLERANCE - 1:.0%} of the fastest backend on {len(rows) - slow} of {len(rows)} rows; "
          f"{changed} pick(s) changed (*)")
    return slow


def run_replay(check, table=None) -> int:
    """`packattn tune --replay`: 0 when every replayed row is within 5% of the fastest, else 1."""
    return 0 if print_replay(replay(check, table)) == 0 else 1
