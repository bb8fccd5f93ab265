#!/usr/bin/env bash
# Set up everything, run the checks (ruff, the import-layer contract, mypy --strict) and every test tier (unit, SDK
# clients, harness replays, real vLLM engine, real Slurm, e2e) with a coverage report.
#   bash scripts/test.sh           every tier (what CI runs)
#   bash scripts/test.sh --fast    skip the real-engine tier and its set-up (for the inner loop)
# Extra arguments go to pytest (`bash scripts/test.sh tests/unit -x`). A bare `pytest` runs the quick tiers only
# (pyproject's addopts deselect slurm, engine and slow); the -m here replaces that selection.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
[ "${1:-}" = "--fast" ] && { FAST=1; shift; }
if [ "$FAST" = 1 ]; then
  bash scripts/setup.sh
  MARK="not engine"
else
  bash scripts/setup.sh --engine
  MARK="engine or slurm or slow or not (engine or slurm or slow)"  # every tier, named
fi
# The checks run first (about 40 s); a failed one does not stop the tests, so one CI run reports everything.
failed=()
export POLAR_HYPOTHESIS=ci  # property tests draw the same examples every run (tests/conftest.py)
.venv/bin/ruff check polar_gym tests benchmarks scripts || failed+=(ruff)
.venv/bin/lint-imports || failed+=(lint-imports)
.venv/bin/mypy || failed+=(mypy)
# Coverage of polar_gym in this process (the sandboxes' and subprocesses' own runs are not measured); the table
# lists the files not fully covered, coverage/coverage.xml holds the rest. The 40 slowest tests are listed: CI time is
# everyone's clock.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 -m "$MARK" --cov --cov-report=term:skip-covered --cov-report=xml \
  "$@" || failed+=(pytest)
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
