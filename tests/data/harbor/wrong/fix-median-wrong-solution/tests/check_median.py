import os
import sys

sys.path.insert(0, os.getcwd())
from stats import median

CASES = [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([7], 7), ([1.5, 0.5], 1.0), ([9, 8, 7, 6, 5, 4], 6.5)]
count = int(os.environ.get("MEDIAN_CASES", len(CASES)))
failed = [(values, want, median(list(values))) for values, want in CASES[:count] if median(list(values)) != want]
for values, want, got in failed:
    print(f"median({values}) = {got}, want {want}")
print(f"{count - len(failed)}/{count} cases pass")
sys.exit(1 if failed else 0)
