"""polar_gym's journal transport for NeMo Gym's token capture against Gym's own file store (``TokenCaptureStore``),
measured in the same run, in Gym's interpreter (started there when this one has no ``nemo_gym``).

    .venv/bin/python benchmarks/bench_nemo_transport.py [--calls 100] [--rounds 3]

One rollout: a chain of ``--calls`` calls whose prompt grows by 200 tokens a turn from 1,000 (100 sampled, 100 of
tool output), each put durably (both stores fsync), then frozen once. Printed per store (medians over the rounds):
bytes on disk, ms per put, freeze seconds; and the ratios polar / Gym.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _entries(calls: int) -> list[Any]:
    from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

    prompt, parent, out = list(range(1000)), None, []
    for i in range(calls):
        generation = [5000 + i] * 100
        entry = TokenEntry(rollout_id="r", model_call_id=f"c{i}", prompt_token_ids=list(prompt),
                           generation_token_ids=generation, generation_log_probs=[-0.1] * 100, created_at=1.0)
        stamp_lineage(entry, parent, parent_resolution=ParentResolutionStatus.RESOLVED if parent
                      else ParentResolutionStatus.ROOT)
        out.append(entry)
        parent = entry.model_call_id
        prompt = prompt + generation + [7] * 100
    return out


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


async def _one(store: str, entries: list[Any], root: Path) -> dict[str, float]:
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    from polar_gym.env.nemo_transport import PolarTokenSink, PolarTokenSource

    sink: Any
    source: Any
    if store == "polar":
        sink, source = PolarTokenSink(root), PolarTokenSource(root)
    else:
        sink = source = TokenCaptureStore(root)
    t0 = time.perf_counter()
    for entry in entries:
        await sink.put(entry)
    t1 = time.perf_counter()
    snapshot = await source.freeze("r")
    t2 = time.perf_counter()
    assert len(snapshot.entries) == len(entries)
    return {"bytes": _disk_bytes(root), "ms_per_put": (t1 - t0) / len(entries) * 1000, "freeze_s": t2 - t1}


def _measure(calls: int, rounds: int) -> None:
    entries = _entries(calls)
    results: dict[str, list[dict[str, float]]] = {"polar": [], "gym": []}
    for k in range(rounds):
        for store in (("polar", "gym") if k % 2 == 0 else ("gym", "polar")):
            with tempfile.TemporaryDirectory(prefix="bench_nemo_transport_") as tmp:
                results[store].append(asyncio.run(_one(store, entries, Path(tmp))))
    med = {store: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for store, runs in results.items()}
    print(f"{calls} calls, last prompt {len(entries[-1].prompt_token_ids)} tokens, {rounds} rounds (medians)")
    print(f"{'store':8} {'disk MB':>9} {'ms/put':>8} {'freeze s':>9}")
    for store, row in med.items():
        print(f"{store:8} {row['bytes'] / 1e6:9.2f} {row['ms_per_put']:8.2f} {row['freeze_s']:9.3f}")
    ratio = {key: med["polar"][key] / med["gym"][key] for key in med["polar"]}
    print(f"{'polar/gym':8} {ratio['bytes']:9.3f} {ratio['ms_per_put']:8.2f} {ratio['freeze_s']:9.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("nemo_gym") is None:  # polar_gym's venv: go to Gym's interpreter
        from polar_gym.assets import nemo_gym_python
        from polar_gym.env.conformance import gym_pythonpath

        env = {**os.environ, "PYTHONPATH": gym_pythonpath(os.environ.get("PYTHONPATH"))}
        return subprocess.run([str(nemo_gym_python()), __file__, *(argv if argv is not None else sys.argv[1:])],
                              env=env, check=False).returncode
    _measure(args.calls, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
