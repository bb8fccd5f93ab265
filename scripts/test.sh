#!/usr/bin/env bash
# Set up everything, run the checks (ruff, the import-layer contract, mypy --strict) and every test tier (unit, SDK
# clients, harness replays, real vLLM engine, real Slurm, e2e).
#   bash scripts/test.sh             every tier (what CI runs)
#   bash scripts/test.sh --fast      skip the real-engine tier and its set-up (for the inner loop)
#   bash scripts/test.sh --coverage  also measure coverage (both flags may be given)
# Extra arguments go to pytest (`bash scripts/test.sh tests/unit -x`). A bare `pytest` runs the quick tiers only, in
# one process (pyproject's addopts deselect slurm, engine and slow); the -m here replaces that selection.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
COVERAGE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) FAST=1; shift ;;
    --coverage) COVERAGE=(--cov --cov-report=term:skip-covered --cov-report=xml); shift ;;
    *) break ;;
  esac
done
if [ "$FAST" = 1 ]; then
  bash scripts/setup.sh
  SELECTED="not engine"
else
  bash scripts/setup.sh --engine
  SELECTED="engine or slurm or slow or not (engine or slurm or slow)"  # every test: pyproject's addopts select fewer
fi
# The checks run first (about 40 s); a failed one does not stop the tests, so one CI run reports everything.
failed=()
export POLAR_HYPOTHESIS=ci  # property tests draw the same examples every run (tests/conftest.py)
# Every process of the run shares two cores: torch's OpenMP threads (trainers, TRL, the audit; vLLM sets its own) sleep
# between parallel regions instead of spinning. The tiny model's training steps beside other work: 26 s of CPU for 15
# steps passive, 31-58 s spinning.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Bytecode is written (into this checkout's __pycache__, which git ignores): with PYTHONDONTWRITEBYTECODE set, as some
# container images set it, every pytest worker rewrote the asserts of all 450 test modules again (17 s of CPU a
# collection, 9 s cached) and every launch, gateway and server process compiled polar_gym anew.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check polar_gym tests benchmarks scripts || failed+=(ruff)
.venv/bin/lint-imports || failed+=(lint-imports)
.venv/bin/mypy || failed+=(mypy)
# One run on three pytest-xdist workers, every tier together (scripts/test.sh --fast: all but the real engine), as
# tests/conftest.py groups and orders them (--dist loadgroup, --no-loadscope-reorder): the tests of the local Slurm
# and the unprivileged user on one worker (one cluster, one user clone), those of the session's Qwen3 vLLMs on another
# (one vLLM per dtype), the tiny VLM's together, every other file as one unit; the two long groups go out first and the
# quick files (~3,500 tests, a third of their time spent waiting on sandbox and container deadlines) last, filling the
# gaps and the end of the heavy tests (~210, CPU-bound but for their waits on Slurm, engines and harnesses). Measured on
# this 2-core machine: the quick tiers on three workers then the heavy ones on two, 262 s + 1,808 s, the heavy run
# ending on its shared group alone with a core idle.
# Exit status 5 (no test selected) is not a failure. Coverage (--coverage) is of polar_gym in the test processes
# (sandboxes and subprocesses are not measured); the table lists the files not fully covered, coverage/coverage.xml
# holds the rest. It is not in CI's run: tracing cost the quick tiers a third more CPU (758 CPU-s against 551) and
# the heavy tests' in-process part about 40 % more. The run lists the slowest tests and those that used the most CPU
# (tests/_cpu_time.py; on two busy cores a test's CPU is what it costs the others): CI time is everyone's clock.
rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist loadgroup --no-loadscope-reorder --durations=0 \
  --durations-min=5 --cpu-durations=40 -m "$SELECTED" ${COVERAGE[@]+"${COVERAGE[@]}"} "$@" || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 5 ] || failed+=(pytest)
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
