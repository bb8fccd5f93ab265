#!/bin/bash
# Runs from the working directory (/app) after the agent; writes the reward.
if [ "$(cat /app/greeting.txt)" = "Hello, Harbor!" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
