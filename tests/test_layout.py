"""Layout rules of packattn/ (issue 26), checked on the source text:

* the environment is read in one module: no ``os.environ`` / ``os.getenv`` outside ``packattn/env.py``;
* comments state contracts and reasons: no measurement histories ("the ninth session", "since 2026-11-24"),
  no results paths (``benchmarks/results/...``), no "not timed yet" -- those live in benchmarks/NOTES.md;
* size: no file over 500 lines, no function over 80 (decorators and docstring included);
* knobs: ``packattn.env.KNOBS`` (the user-facing ``PACKATTN_*`` variables) has at most 5 names, the source
  names no other ``PACKATTN_*`` variable, and the README's knob table lists exactly them;
* the kernel wing: one folder per family under ``packattn/ops/``, the varlen family's configs in one module.

Each check lists every offending ``file:line``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "packattn"
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_KNOBS = 500, 80, 5

ENVIRONMENT = re.compile(r"\bos\.(environ|getenv|putenv|unsetenv)\b|\bfrom\s+os\s+import\b[^\n]*\b(environ|getenv)\b")
ORDINAL = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
           r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(st|nd|rd|th)")
HISTORY = {
    "results path": re.compile(r"benchmarks/results|\bresults/\d{4}-\d\d-\d\d|\bresults/20\d\d"),
    "numbered session": re.compile(rf"\b({ORDINAL})\s+session\b|\bsession\s+\d+\b", re.I),
    "session": re.compile(r"\bsessions?\b", re.I),
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "not timed yet": re.compile(r"\bnot (yet )?timed\b|\bnot yet (measured|run)\b|\bnot (measured|run on a GPU) yet\b", re.I),
}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _offences(pattern: re.Pattern, skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in _sources():
        if _rel(path) in skip:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{_rel(path)}:{number}: {line.strip()[:120]}")
    return found


def test_environment_is_read_only_in_env_py():
    offences = _offences(ENVIRONMENT, skip=("packattn/env.py",))
    assert not offences, "os.environ outside packattn/env.py:\n" + "\n".join(offences)


def test_no_measurement_histories_or_results_paths():
    offences = [f"[{kind}] {hit}" for kind, pattern in HISTORY.items() for hit in _offences(pattern)]
    assert not offences, ("measurement histories / results paths in packattn/ (they belong in "
                          "benchmarks/NOTES.md):\n" + "\n".join(offences))


def test_no_file_over_500_lines():
    long = [f"{_rel(p)}: {n} lines" for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_80_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{_rel(path)}:{node.lineno}: {node.name} is {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _knobs() -> tuple[str, ...]:
    from packattn import env

    knobs = getattr(env, "KNOBS", None)
    assert knobs is not None, "packattn.env.KNOBS (the user-facing PACKATTN_* variables) is missing"
    return tuple(knobs)


def test_at_most_five_knobs_and_the_source_names_no_other():
    knobs = _knobs()
    assert len(knobs) <= MAX_KNOBS and len(set(knobs)) == len(knobs), knobs
    assert all(re.fullmatch(r"PACKATTN_[A-Z_]+", k) for k in knobs), knobs
    others = [hit for hit in _offences(re.compile(r"PACKATTN_[A-Z_]+"))
              if set(re.findall(r"PACKATTN_[A-Z_]+", hit.split(": ", 1)[1])) - set(knobs)]
    assert not others, f"PACKATTN_* names that are not in env.KNOBS {knobs}:\n" + "\n".join(others)


def test_readme_knob_table_lists_exactly_the_knobs():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\|\s*`(PACKATTN_[A-Z_]+)", readme, re.M)
    assert sorted(rows) == sorted(_knobs()), (rows, _knobs())


def test_kernel_wing_layout():
    for family in ("runtime", "varlen", "tree", "small_seq"):
        assert (PACKAGE / "ops" / family / "__init__.py").is_file(), f"packattn/ops/{family}/ is missing"
    assert (PACKAGE / "ops" / "varlen" / "configs.py").is_file(), "packattn/ops/varlen/configs.py is missing"
    assert not (PACKAGE / "kernels").exists(), "packattn/kernels/ should be gone (kernels live in packattn/ops/)"
