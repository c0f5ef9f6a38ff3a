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
    if not candidates:
        raise ValueError(f"times name no known backend ({', '.join(times)})")
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


def read_check(check) -> dict:
    """A check run's JSON file (or the parsed dict) after `validate_check`; ValueError naming the file when it
    cannot be read or parsed."""
    if isinstance(check, dict):
        data, source = check, "the check run"
    else:
        source = str(check)
        try:
            data = json.loads(Path(check).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{source}: not a readable JSON file ({e})") from None
    validate_check(data, source)
    return data


def validate_check(data, source: str) -> None:
    """Raise ValueError naming ``source`` and the first problem unless ``data`` is laid out as a ``packattn tune
    --check --json`` file: a top-level ``rows`` list of objects, each with a ``shape`` name, a ``pass`` (fwd or
    f+b), the logged ``pick`` and ``decided_by`` and ``times`` (backend -> positive ms; empty where nothing ran),
    at least one row with times; ``env.capability``, when present, a [major, minor] pair."""
    def bad(what: str):
        raise ValueError(f"{source}: {what}")

    if isinstance(data, dict) and "schema" in data and "arch" in data:
        bad("is a cost table, not a `packattn tune --check --json` run (a table goes in --table)")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        bad("not a `packattn tune --check --json` run: needs a top-level 'rows' list")
    env = data.get("env") or {}
    if not isinstance(env, dict):
        bad(f"env must be an object, got {env!r}")
    capability = env.get("capability")
    if capability is not None and (not isinstance(capability, (list, tuple)) or len(capability) != 2
                                   or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)):
        bad(f"env.capability must be [major, minor], got {capability!r}")
    for number, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            bad(f"row {number}: not an object")
        missing = [k for k in ("shape", "pass", "pick", "decided_by", "times") if k not in row]
        if missing:
            bad(f"row {number}: lacks {', '.join(missing)}")
        for name in ("shape", "pick", "decided_by"):
            if not isinstance(row[name], str):
                bad(f"row {number}: {name} must be a name, got {row[name]!r}")
        if row["pass"] not in ("fwd", "f+b"):
            bad(f"row {number}: pass must be fwd or f+b, got {row['pass']!r}")
        times = row["times"]
        if not isinstance(times, dict) or not all(
                isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0 for ms in times.values()):
            bad(f"row {number}: times must map backends to positive ms, got {times!r}")
    if not any(row["times"] for row in data["rows"]):
        bad(f"none of its {len(data['rows'])} rows has timings: nothing to replay")


def replay(check, table=None, stand_ins=None) -> list[dict]:
    """Every row of a check run (its JSON file or the parsed dict) replayed against ``table`` (a path or
    `costs.Table`; default the packaged table of the check's architecture). ValueError for a file that is not a
    check run (`validate_check`)."""
    data = read_check(check)
    capability = (data.get("env") or {}).get("capability") or (9, 0)
    if table is None:
        found = costs.table(f"sm{capability[0]}{capability[1]}")
        if found is None:
            raise ValueError(f"no packaged cost table for sm{capability[0]}{capability[1]}: pass --table")
    else:
        found = table if isinstance(table, costs.Table) else costs.load(table)
    source = "the check run" if isinstance(check, dict) else str(check)
    out = []
    for number, row in enumerate(data["rows"]):
        if row["times"]:
            try:
                out.append(replay_row(found, row, capability, stand_ins))
            except ValueError as e:  # a shape name replay cannot rebuild, a backend it does not know
                raise ValueError(f"{source}: row {number}: {e}") from None
    return out


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
