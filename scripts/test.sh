#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole test suite.
# --quick: the quick tier (no multi-process or slow tests; tests/conftest.py). Other arguments go to
# pytest (e.g. scripts/test.sh -k lars).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the test files run on parallel workers, one file to a worker (pytest-xdist), in the order
# tests/conftest.py gives them (most work first; not xdist's own, by test count): most tests wait on the
# processes they start, so two workers keep a 2-core machine busy; TEST_WORKERS=0 runs them one by one
# (the machine's processors: nproc alone obeys OMP_NUM_THREADS, which a CPU-run shell may set to 1)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
workers=${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
exec .venv/bin/python -m pytest -ra -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
