#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k lars).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
