#!/usr/bin/env bash
# Set up (.venv) and run the test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh"
set +e
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi
exit "$rc"
