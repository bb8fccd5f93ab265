"""NeMo Gym's own conformance suite (``nemo_gym.token_id_capture.conformance.run_conformance``, lineage checks on)
against polar_gym's journal transport; runs in Gym's interpreter. ``python -m polar_gym.env conformance`` starts it
there (:func:`polar_gym.env.conformance.conformance_command`); it prints one ``passed <check>`` line per check that
passed, then ``FAILED <check>: <detail>`` and exit status 1 at the first that did not, or ``all N checks passed``.

``--transport module:Name`` swaps the store class (a :class:`polar_gym.env.nemo_transport.JournalTokenStore`
subclass) to check another backend, or a deliberately broken one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_gym.token_id_capture.conformance import ConformanceError, run_conformance

from polar_gym.env.nemo_transport import JournalTokenStore, PolarLineageResolver, PolarTokenSink, PolarTokenSource

__all__ = ["check", "main"]


def _store_class(target: str | None) -> type[JournalTokenStore]:
    if not target:
        return JournalTokenStore
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, JournalTokenStore)):
        raise SystemExit(f"--transport {target} is not a JournalTokenStore subclass")
    return cls


_ROLLOUT = "polar-conformance"


async def check(root: Path, store_class: type[JournalTokenStore] = JournalTokenStore) -> tuple[list[str], Any]:
    """(the checks that passed, in order; the ConformanceError that stopped the suite or None). Each factory call
    is a fresh client on a fresh store instance over the same directory, as separate workers would be.

    ``run_conformance`` names the checks that passed only when all did; each check runs under its own rollout id
    (``<rollout>-<check name with dashes>``), so the checks that ran are read off the rollouts the store saw."""
    seen: list[str] = []

    def note(rollout_id: str) -> None:
        name = rollout_id.removeprefix(f"{_ROLLOUT}-").replace("-", "_")
        if name not in seen:
            seen.append(name)

    def client(cls: Any) -> Any:
        def make() -> Any:
            store = store_class(root)
            store.observer = note
            return cls(root, store=store)
        return make

    try:
        passed: list[str] = await run_conformance(client(PolarTokenSink), client(PolarTokenSource),
                                                  lineage_factory=client(PolarLineageResolver), rollout_id=_ROLLOUT)
    except ConformanceError as exc:
        return [name for name in seen if name != exc.check_name], exc
    return passed, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.env.nemo_conformance", description=__doc__)
    parser.add_argument("--root", help="the transport's directory (default: a new temporary one)")
    parser.add_argument("--transport", help="module:Name of a JournalTokenStore subclass to check instead")
    args = parser.parse_args(argv)
    store_class = _store_class(args.transport)
    with tempfile.TemporaryDirectory(prefix="polar_gym_conformance_") as tmp:
        root = Path(args.root) if args.root else Path(tmp)
        passed, failure = asyncio.run(check(root, store_class))
    for name in passed:
        print(f"passed {name}", flush=True)
    if failure is not None:
        print(f"FAILED {failure.check_name}: {failure.detail}", flush=True)
        return 1
    print(f"all {len(passed)} checks passed", flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
