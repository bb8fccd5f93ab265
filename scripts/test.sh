#!/usr/bin/env bash
# Set up everything, run the checks (ruff, the import-layer contract, mypy --strict) and every test tier (unit, SDK
# clients, harness replays, real vLLM engine, real Slurm, e2e).
#   bash scripts/test.sh             every tier (what CI runs)
#   bash scripts/test.sh --fast      skip the real-engine tier and its set-up (for the inner loop)
#   bash scripts/test.sh --coverage  also measure the quick tiers' coverage (both flags may be given)
# Extra arguments go to both pytest runs (`bash scripts/test.sh tests/unit -x`). A bare `pytest` runs the quick tiers
# only, in one process (pyproject's addopts deselect slurm, engine and slow); the -m here replaces that selection.
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
  HEAVY="not engine and (slurm or slow)"
else
  bash scripts/setup.sh --engine
  HEAVY="engine or slurm or slow"
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
# Two runs on pytest-xdist workers (measured: ~4 min and ~18 min, against over an hour in one process).
# - The quick tiers (no real engine, Slurm or slow marker: ~3,500 tests): a test file per worker at a time, so a
#   file's fixtures are built once; three workers, as a third of the time is spent waiting (sandbox and container
#   deadlines): 229 s against 273 s on two (four: no faster).
# - The heavy tiers (~200 tests), on two workers: the groups of tests/conftest.py's xdist_group_of: every test of the
#   session's vLLMs, the local Slurm or the unprivileged user on one worker (one vLLM per dtype, one cluster, one user
#   clone, which these tests share), the tiny VLM's tests together, the rest by file. They are CPU-bound: a third
#   worker made them no faster, and running both tiers in one run of three workers took as long as the two runs.
# Exit status 5 (no test selected: a path given to one tier only) is not a failure. Coverage (--coverage) is the
# quick tiers': of polar_gym in their test processes (sandboxes and subprocesses are not measured); the table lists
# the files not fully covered, coverage/coverage.xml holds the rest. It is not in CI's run: tracing cost the quick
# tiers a third more time (424 s against 319 s on three workers, 758 CPU-s against 551), and no check reads it. The
# heavy tiers run polar_gym mostly in subprocesses, which coverage does not see, and tracing their in-process part
# cost them about 40 % more CPU there (the gateway and proxy of the e2e tests: 14.4 s against 10.0 s). Each run lists its
# slowest tests and those that used the most CPU (tests/_cpu_time.py; on two busy cores a test's CPU is what it costs
# the others): CI time is everyone's clock.
run_pytest() {
  local rc=0
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 5 ]
}
run_pytest -n 3 --dist loadfile --durations=20 --cpu-durations=20 -m "not (engine or slurm or slow)" \
  ${COVERAGE[@]+"${COVERAGE[@]}"} "$@" || failed+=(pytest-quick)
run_pytest -n 2 --dist loadgroup --durations=0 --durations-min=5 --cpu-durations=40 -m "$HEAVY" "$@" \
  || failed+=(pytest-heavy)
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
