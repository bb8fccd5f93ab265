#!/bin/bash
if [ "$(cat /app/name.txt)" = "Ada" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
