"""Run an sm_90a compile check (the scripts/check_gluon_*compile.py helpers) from a test: in a subprocess, because
the test process runs Triton's interpreter (TRITON_INTERPRET is set before any kernel is defined, tests/conftest.py)
and a real compile needs it unset."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_check(script: str, timeout: float = 300) -> str:
    """Run ``script`` (Python source; the repo root is its working directory) without TRITON_INTERPRET; assert it
    exits 0 and return its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout
