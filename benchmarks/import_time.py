"""Import cost of packattn, measured with ``python -X importtime`` in fresh interpreters.

Each row runs its statement in a new subprocess ``--runs`` times (default 7) and reports the median
over the runs of

* ``importtime ms``: the sum of the cumulative times ``-X importtime`` reports for the top-level
  imports the statement triggered (its own modules and everything they pulled in that was not
  loaded before: with ``import torch`` first, that is packattn's cost on top of torch);
* ``wall ms``: ``time.perf_counter()`` around the statement, in another fresh interpreter without
  ``-X importtime`` (which adds its own overhead);
* ``torch loaded``: whether the statement left ``torch`` in ``sys.modules``.

The budget (issue 25): ``from packattn import attention, Varlen, Tree`` at most 500 ms over
``import torch``, and ``import packattn`` does not import torch at all.

usage: python benchmarks/import_time.py [--runs N] [--python PATH] [--source DIR ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

# (label, statement run before the timed one, timed statement)
ROWS = [
    ("import torch", "", "import torch"),
    ("import packattn (alone)", "", "import packattn"),
    ("import packattn, after torch", "import torch", "import packattn"),
    ("from packattn import attention, Varlen, Tree, after torch", "import torch",
     "from packattn import attention, Varlen, Tree"),
    ("import packattn.nn, after torch", "import torch", "import packattn.nn"),
]
BUDGET_MS = 500.0

_PROGRAM = """
import sys, time
{before}
_t0 = time.perf_counter()
{stmt}
_t1 = time.perf_counter()
sys.stderr.write("WALL %r %d\\n" % ((_t1 - _t0) * 1e3, "torch" in sys.modules))
"""


def _top_level(stderr: str) -> list[tuple[str, float]]:
    """``(module, cumulative ms)`` of every top-level line of ``-X importtime`` output, in order."""
    out = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|")
        if cumulative.strip().isdigit() and not name.startswith("  "):  # one space of padding: top level
            out.append((name.strip(), int(cumulative) / 1e3))
    return out


def measure(python: str, before: str, stmt: str, source: str) -> tuple[float, float, bool]:
    """(importtime ms of ``stmt``, wall ms of ``stmt``, torch loaded after it), from two fresh interpreters
    started in ``source`` (so ``import packattn`` finds that checkout first): one under ``-X importtime``,
    one without it for the wall time (the instrumentation adds its own cost)."""
    program = _PROGRAM.format(before=before, stmt=stmt)
    done = subprocess.run([python, "-X", "importtime", "-c", program], capture_output=True, text=True, check=True,
                          cwd=source)
    head, _, loaded = _split(done.stderr)
    # the lines of the statement come after those of `before` (and of the interpreter's start-up):
    # everything after the last top-level line that `before` alone produces
    skip = len(_top_level(_baseline(python, before, source)))
    timed = _top_level(head)[skip:]
    plain = subprocess.run([python, "-c", program], capture_output=True, text=True, check=True, cwd=source)
    _, wall, _ = _split(plain.stderr)
    return sum(ms for _, ms in timed), float(wall), loaded == "1"


def _split(stderr: str) -> tuple[str, str, str]:
    """(the ``-X importtime`` lines before the statement's end marker, wall ms, torch-loaded flag); lines
    after the marker (imports at interpreter exit) are dropped."""
    lines = stderr.splitlines()
    at = max(i for i, line in enumerate(lines) if line.startswith("WALL "))
    _, wall, loaded = lines[at].split()
    return "\n".join(lines[:at]), wall, loaded


_baselines: dict = {}


def _baseline(python: str, before: str, source: str) -> str:
    """``-X importtime`` output of the interpreter running only ``before`` (cached per statement)."""
    key = (python, before, source)
    if key not in _baselines:
        program = _PROGRAM.format(before=before, stmt="pass")
        done = subprocess.run([python, "-X", "importtime", "-c", program], capture_output=True, text=True, check=True,
                              cwd=source)
        _baselines[key] = _split(done.stderr)[0]
    return _baselines[key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters per row (median reported)")
    parser.add_argument("--python", default=sys.executable, help="interpreter to measure (default: this one)")
    parser.add_argument("--source", action="append", metavar="DIR",
                        help="a packattn checkout to measure (repeat to compare, e.g. a worktree of an older "
                        "commit: the runs of each row alternate between them); default: this script's checkout")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    sources = args.source or [str(Path(__file__).resolve().parents[1])]
    print(f"{args.python}: median of {args.runs} fresh interpreters per row and checkout")
    print(f"{'statement':<58} {'checkout':<20} {'importtime ms':>13} {'wall ms':>9}  torch loaded")
    results = {}
    for label, before, stmt in ROWS:
        samples: dict[str, list] = {source: [] for source in sources}
        for _ in range(args.runs):
            for source in sources:
                samples[source].append(measure(args.python, before, stmt, source))
        for source in sources:
            runs = samples[source]
            imp, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            results[label, source] = (imp, wall, all(r[2] for r in runs))
            print(f"{label:<58} {_short(source):<20} {imp:>13.0f} {wall:>9.0f}  {'yes' if runs[0][2] else 'no'}")
    ok = True
    for source in sources:
        light = results["from packattn import attention, Varlen, Tree, after torch", source][0]
        loads_torch = results["import packattn (alone)", source][2]
        met = light <= BUDGET_MS and not loads_torch
        ok = ok and met
        print(f"{_short(source)}: public names {light:.0f} ms over torch (budget {BUDGET_MS:.0f}), `import packattn` "
              f"{'imports torch' if loads_torch else 'without torch'}: {'met' if met else 'NOT met'}")
    return 0 if ok else 1


def _short(path: str) -> str:
    return path if len(path) <= 20 else "..." + path[-17:]


if __name__ == "__main__":
    sys.exit(main())
