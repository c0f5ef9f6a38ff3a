# Sourced by the scripts here: make (once) and enter .venv with packattn and its test deps.
# CPU machines get the CPU torch wheel (torch==2.13.0); triton is pinned to what we test against.
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
python -m pip install -q -e ".[test]"
# optional integrations whose tests run in CI too (CPU builds)
python -c "import jax" 2>/dev/null || python -m pip install -q "jax==0.10.2" "jaxlib==0.10.2"
python -c "import transformers" 2>/dev/null || python -m pip install -q "transformers==5.18.0"
python -c "import matplotlib" 2>/dev/null || python -m pip install -q "matplotlib==3.11.2"  # the bench plots (tests/test_cli.py)
