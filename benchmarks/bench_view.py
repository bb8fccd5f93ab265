"""The trace viewer on a long session: a 200-turn session must open in under a second.

    .venv/bin/python benchmarks/bench_view.py [--turns 200] [--baseline 20] [--browser] [--repeat 5]
                                              [--out benchmarks/results]

A run folder is written with two sessions in launch's shapes (tests/view/_view_kit.py): one of ``--turns`` model
calls merged into one chain (each call samples 100 tokens, each tool answers 100: tens of thousands of tokens) and a
baseline of ``--baseline`` calls. Timed in the same run, for each: the API's answers for opening the session (the
session payload plus the first trace's token arrays, decoded with the cached Qwen tokenizer when it is built),
in-process through the ASGI app, median of ``--repeat``; with ``--browser``, the whole open in headless Chromium
(``python -m polar_gym.view`` as a process; from navigation to the last token span in the DOM). Printed: times,
answer sizes, and the long/baseline ratios next to the turn ratio (under it: the cost grows less than linearly);
written to ``OUT/bench_view.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastapi.testclient import TestClient  # noqa: E402

from polar_gym.view import OutDirSource, create_view_app  # noqa: E402
from tests.view._view_kit import make_session, running_viewer, write_run  # noqa: E402


def _api_open(client: TestClient, session_id: str) -> tuple[float, int, int]:
    """Seconds to answer what the page asks when a session opens; bytes sent; tokens."""
    start = time.perf_counter()
    payload = client.get(f"/view/api/sessions/{session_id}")
    tokens = client.get(f"/view/api/sessions/{session_id}/traces/0/tokens")
    elapsed = time.perf_counter() - start
    assert payload.status_code == tokens.status_code == 200
    return elapsed, len(payload.content) + len(tokens.content), len(tokens.json()["ids"])


def _browser_open(url: str, session_id: str, n_tokens: int) -> float:
    from tests._browser import open_page

    with open_page(url) as browser:
        page = browser.page
        page.wait_for_selector("#sessions tbody tr")
        start = time.perf_counter()
        page.evaluate("sid => { location.hash = '#/session/' + encodeURIComponent(sid); }", session_id)
        page.wait_for_function("n => document.querySelectorAll('.trace[data-trace=\"0\"] .tokens .t').length === n",
                               arg=n_tokens, polling="raf")
        elapsed = time.perf_counter() - start
        assert browser.problems == [], browser.problems
    return elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--baseline", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--browser", action="store_true", help="also time the open in headless Chromium")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-view-") as tmp:
        run = write_run(Path(tmp) / "run", [
            make_session("long", "bench", turns=args.turns, assistant_tokens=100, tool_tokens=100,
                         prompt_tokens=2000, seed=1),
            make_session("base", "bench", turns=args.baseline, assistant_tokens=100, tool_tokens=100,
                         prompt_tokens=2000, seed=2)])
        source = OutDirSource(run)
        client = TestClient(create_view_app(source), base_url="http://127.0.0.1")
        _api_open(client, "base")  # warm: the tokenizer loads, the trajectories index is built
        results: dict[str, Any] = {"tokenizer": str(source.tokens().directory) if source.tokens() else None}
        for name in ("base", "long"):
            runs = [_api_open(client, name) for _ in range(args.repeat)]
            results[name] = {"api_s": statistics.median(r[0] for r in runs), "bytes": runs[0][1],
                             "tokens": runs[0][2]}
        if args.browser:
            with running_viewer(run) as (url, _):
                for name in ("base", "long"):
                    results[name]["browser_s"] = statistics.median(
                        _browser_open(url, name, results[name]["tokens"]) for _ in range(max(1, args.repeat // 2)))
    turn_ratio = args.turns / args.baseline
    print(f"tokenizer: {results['tokenizer'] or 'none (ids)'}")
    print(f"{'session':<8} {'turns':>6} {'tokens':>8} {'answer KB':>10} {'API ms':>8} {'browser ms':>11}")
    for name, turns in (("base", args.baseline), ("long", args.turns)):
        r = results[name]
        browser = f"{r['browser_s'] * 1000:11.0f}" if "browser_s" in r else f"{'-':>11}"
        print(f"{name:<8} {turns:>6} {r['tokens']:>8} {r['bytes'] / 1024:>10.0f} {r['api_s'] * 1000:>8.1f} {browser}")
    token_ratio = results["long"]["tokens"] / results["base"]["tokens"]
    print(f"ratio long/base: turns x{turn_ratio:.1f}, tokens x{token_ratio:.1f},"
          f" API x{results['long']['api_s'] / results['base']['api_s']:.1f}"
          + (f", browser x{results['long']['browser_s'] / results['base']['browser_s']:.1f}"
             if "browser_s" in results["long"] else ""))
    total = results["long"].get("browser_s", results["long"]["api_s"])
    print(f"{args.turns}-turn session opens in {total * 1000:.0f} ms "
          f"({'browser' if 'browser_s' in results['long'] else 'API only'}; target under 1000 ms)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_view.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
