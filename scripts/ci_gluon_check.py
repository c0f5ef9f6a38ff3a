"""CI's Gluon gate check: compile our Hopper Gluon kernels for sm_90a on the CPU with the installed Triton
and hold the result against `packattn.ops.runtime.support.gluon_unsupported` (whether packattn runs them
on this Triton).

* Gluon on for this Triton: every forward configuration the launcher selects (d 64 / 128, causal and no
  mask), the backward dK/dV and dQ (d 64 / 128, causal; the dQ also with DELTA_FROM_O), the tree dK/dV and dQ
  (d 128) and the tree forward (d 128) must compile cleanly (the check scripts' own criteria); exit 1 otherwise.
* Gluon off: one forward variant is compiled and checked (exit 0 either way; a clean result prints a note that
  the release could be added to ``GLUON_TRITON`` after a GPU run).

    python scripts/ci_gluon_check.py          # one summary line last: "gluon: ..."
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from packattn.ops.runtime import support  # noqa: E402

FULL = [
    ["check_gluon_compile.py", "--head-dims", "64", "128", "--masks", "R", "", "--jobs", "2", "--selected"],
    ["check_gluon_bwd_compile.py", "--head-dims", "64", "128", "--masks", "R", "--dtypes", "bf16"],
    ["check_gluon_bwd_compile.py", "--kernels", "dq", "--delta-from-o", "--head-dims", "128", "--masks", "R",
     "--dtypes", "bf16"],
    ["check_gluon_bwd_compile.py", "--tree", "--head-dims", "128", "--dtypes", "bf16"],
    ["check_gluon_tree_compile.py", "--head-dims", "128", "--dtypes", "bf16"],
]
PROBE = [["check_gluon_compile.py", "--head-dims", "128", "--masks", "R", "--jobs", "1"]]


def run_checks(checks: list[list[str]]) -> list[str]:
    """Run each check script (its output shown as it goes); the ones that failed, as command lines."""
    failed = []
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    for check in checks:
        command = [sys.executable, os.path.join(ROOT, "scripts", check[0]), *check[1:]]
        print("+", " ".join(repr(a) if a == "" else a for a in command[1:]), flush=True)
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # nanobind's leak report at interpreter exit is noise here
        print("\n".join(line for line in done.stdout.splitlines() if "leaked" not in line and "nanobind" not in line))
        if done.returncode != 0:
            failed.append(" ".join(check))
    return failed


def main() -> int:
    version = support.triton_version()
    if version is None:
        print("gluon: FAILED: triton is not installed")
        return 1
    off = support.gluon_unsupported()
    if off is None:
        failed = run_checks(FULL)
        if failed:
            print(f"gluon: FAILED: Gluon kernels are on for triton {version} but fail the compile check: "
                  f"{'; '.join(failed)}")
            return 1
        print(f"gluon: passed: kernels on for triton {version}, sm_90a compile check clean ({len(FULL)} scripts)")
        return 0
    failed = run_checks(PROBE)
    if failed:
        print(f"gluon: passed: kernels off for triton {version} (GLUON_TRITON {support.GLUON_TRITON}), "
              "and they fail the compile check there (a failed compile, a spill in a main loop, ...: above)")
    else:
        print(f"gluon: passed: kernels off for triton {version}; note: they pass the compile check there, add it "
              "to GLUON_TRITON after a GPU run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
