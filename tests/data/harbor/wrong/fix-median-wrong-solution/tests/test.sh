#!/bin/bash
# No pytest: a plain python check; the reward is 1 only if every case passes.
if python3 /tests/check_median.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
