# Sourced by the scripts here: make (once) and enter .venv with packattn (editable), its test deps and the
# optional integrations whose tests run too (extras hf, jax, bench), each resolved within pyproject.toml's ranges.
# Where torch is not importable yet: torch==2.13.0 (on CPU machines of this project's kind pip finds the CPU
# build among the machine's local wheels) and triton==3.6.0 (torch 2.11's; our Gluon kernels also run on 3.9).
# Packages already installed and in range are kept. CI tests the ranges' ends in venvs of its own (.ci/run).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -c "import triton" 2>/dev/null || python -m pip install -q "triton==3.6.0"
python -m pip install -q -e ".[test,hf,jax,bench]"
