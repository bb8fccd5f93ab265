#!/bin/bash
# Several named rewards in reward.json: one for a parseable file, one for the right counts.
python3 - <<'PY'
import json

rewards = {"parses": 0, "correct": 0}
try:
    counts = json.load(open("/app/counts.json"))
    rewards["parses"] = 1
    rewards["correct"] = int(counts == {"apple": 3, "pear": 2, "fig": 1})
except (OSError, ValueError):
    pass
json.dump(rewards, open("/logs/verifier/reward.json", "w"))
print(rewards)
PY
