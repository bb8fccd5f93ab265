#!/bin/bash
python3 -c 'import collections, json; json.dump(collections.Counter(open("data/words.txt").read().split()), open("counts.json", "w"))'
