#!/usr/bin/env bash
# Set up everything and run every test tier (unit, SDK clients, harness replays, real vLLM engine) and ruff.
#   bash scripts/test.sh           every tier (what CI runs)
#   bash scripts/test.sh --fast    skip the real-engine tier and its set-up (for the inner loop)
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
[ "${1:-}" = "--fast" ] && { FAST=1; shift; }
if [ "$FAST" = 1 ]; then
  bash scripts/setup.sh
  MARK=(-m "not engine")
else
  bash scripts/setup.sh --engine
  MARK=()
fi
.venv/bin/ruff check polar_gym tests benchmarks scripts
.venv/bin/python -m pytest -q -p no:cacheprovider "${MARK[@]}" "$@"
