"""The floor of pyproject.toml's declared ranges, as pins: each requirement of the project's dependencies and
of the named extras that has a lower bound (``name>=X``) becomes ``name==X`` (its environment marker kept);
one without a lower bound is left out (the resolver picks). CI installs its floor environment with these as
constraints, so the floor follows pyproject.toml (e.g. the ``hf`` extra's transformers bound) by itself.

    python scripts/ci_pins.py test hf jax bench      # pins, one a line
"""

from __future__ import annotations

import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")


def floor_pin(requirement: str) -> str | None:
    """``name==X`` (with the requirement's marker) for a requirement with a ``>=X`` specifier, else None."""
    match = _REQUIREMENT.match(requirement)
    if match is None:
        raise ValueError(f"cannot parse requirement {requirement!r}")
    name, _, specifiers, marker = match.groups()
    for spec in specifiers.split(","):
        spec = spec.strip()
        if spec.startswith(">="):
            return f"{name}=={spec[2:].strip()}" + (f" {marker}" if marker else "")
    return None


def floor_pins(project: dict, extras: list[str]) -> list[str]:
    """The pins of the project's dependencies and of ``extras`` (an unknown extra is a KeyError)."""
    requirements = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        requirements += optional[extra]
    return [pin for pin in map(floor_pin, requirements) if pin is not None]


def main(argv: list[str]) -> int:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    print("\n".join(floor_pins(project, argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
