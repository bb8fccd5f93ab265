"""Memory of a long-lived proxy over many sessions: what it keeps after they finish (issue 11, fault 9).

    .venv/bin/python benchmarks/bench_memory.py [--sizes 1000 10000 100000] [--prompt-kb 8] [--mode gateway adhoc]

N sessions go through the real ProxyService and CaptureJournal (on disk, in a temporary directory); the engine is a
fake that answers at once, so only the proxy's own bookkeeping is measured. Two modes:

- ``gateway``: each session is registered with a fresh key and an attempt id, makes its calls, is revoked and its
  journal released, as a gateway node does when the session's result is final;
- ``adhoc``: a standalone proxy, where any key opens a session and nobody says it ended (bounded by LRU).

At each size the Python heap still allocated (tracemalloc, after a GC) and the process RSS are printed, with the
ratios of the heap at the largest size to each smaller one (flat memory: ratios near 1, not the ratio of the
sizes; the interpreter's interned-strings table may double once early on, a one-off step of ~2 MB).
Journal files of finished sessions are deleted in batches as the run goes (``--keep-files`` keeps them), so 100,000
sessions do not fill the disk; memory never depended on them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_gym.proxy.capture import CaptureJournal  # noqa: E402
from polar_gym.proxy.chat import ChatMessage, ChatRequest, ChatResult  # noqa: E402
from polar_gym.proxy.engines.base import Engine  # noqa: E402
from polar_gym.proxy.providers.base import Route  # noqa: E402
from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry, new_session_key  # noqa: E402

__all__ = ["FixedEngine", "Probe", "run_sessions"]


class FixedEngine(Engine):
    """Answers every call at once with a fixed reply; token IDs derived from the prompt's length."""

    name = "fixed"

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        size = len(request.messages[-1].content or "") if request.messages else 0
        prompt = list(range(min(size // 4, 4096)))
        return ChatResult(message=ChatMessage(role="assistant", content="ok"), prompt_ids=prompt,
                          response_ids=[7, 8, 9], response_logprobs=[-0.1, -0.2, -0.3], engine=self.name)


@dataclass
class Probe:
    sessions: int
    heap_bytes: int
    rss_bytes: int
    seconds: float


def _rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def run_sessions(root: Path, checkpoints: list[int], *, mode: str = "gateway", prompt_bytes: int = 8192,
                       calls: int = 2, keep_files: bool = False, max_open: int | None = None,
                       max_adhoc: int = 4096,
                       on_probe: Callable[[Probe], Awaitable[None] | None] | None = None) -> list[Probe]:
    """Run sessions through a ProxyService and measure the heap (tracemalloc must be tracing) at each checkpoint."""
    journal = CaptureJournal(root, max_open=max_open)
    registry = SessionRegistry(allow_adhoc=mode == "adhoc", max_adhoc=max_adhoc)
    service = ProxyService(FixedEngine(), journal, registry, keepalive_after=None)
    filler = "x" * prompt_bytes
    route = Route("/v1/chat/completions")
    probes: list[Probe] = []
    started = time.perf_counter()
    done_dirs: list[Path] = []
    n = 0
    try:
        for target in checkpoints:
            while n < target:
                sid = f"task-{n // 8}-{n % 8}-{n:08x}"
                key, attempt = sid, None
                if mode == "gateway":
                    key, attempt = new_session_key(), f"{n:012x}"
                    await journal.begin_attempt(sid, attempt)
                    registry.register(SessionInfo(sid, "policy", {}, attempt=attempt, key=key))
                messages = [{"role": "system", "content": filler}, {"role": "user", "content": f"task {n}"}]
                for call in range(calls):
                    body = orjson.dumps({"model": "policy", "messages": messages})
                    reply = await service.handle("openai_chat", body, route, {"authorization": f"Bearer {key}"})
                    if reply.status != 200:
                        raise RuntimeError(f"call failed: {reply.status} {reply.body[:200]!r}")
                    messages = [*messages, {"role": "assistant", "content": "ok"},
                                {"role": "user", "content": f"next {call}"}]
                if mode == "gateway":
                    registry.unregister(sid)  # revoked at the end of RUNNING
                    journal.release(sid, attempt)  # the result is final
                    service.forget(sid)
                directory = journal.session_dir(sid)
                if directory is not None and not keep_files:
                    done_dirs.append(directory)
                if len(done_dirs) >= 1000:
                    await asyncio.to_thread(_remove, done_dirs)
                    done_dirs = []
                n += 1
            gc.collect()
            heap, _ = tracemalloc.get_traced_memory()
            probe = Probe(n, heap, _rss(), time.perf_counter() - started)
            probes.append(probe)
            if on_probe is not None:
                out = on_probe(probe)
                if out is not None:
                    await out
    finally:
        journal.close()
    return probes


def _remove(dirs: list[Path]) -> None:
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    p.add_argument("--prompt-kb", type=float, default=8.0, help="size of each session's system prompt")
    p.add_argument("--calls", type=int, default=2, help="model calls per session")
    p.add_argument("--mode", nargs="+", default=["gateway", "adhoc"], choices=["gateway", "adhoc"])
    p.add_argument("--keep-files", action="store_true")
    args = p.parse_args(argv)
    sizes = sorted(args.sizes)
    for mode in args.mode:
        print(f"\n{mode}: {args.calls} calls per session, {args.prompt_kb:g} KB system prompt", flush=True)
        print(f"{'sessions':>10} {'heap MB':>9} {'RSS MB':>8} {'seconds':>8} {'sessions/s':>10}", flush=True)

        def show(probe: Probe) -> None:
            print(f"{probe.sessions:>10,} {probe.heap_bytes / 2**20:>9.2f} {probe.rss_bytes / 2**20:>8.1f} "
                  f"{probe.seconds:>8.1f} {probe.sessions / max(probe.seconds, 1e-9):>10.0f}", flush=True)

        with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
            tracemalloc.start()
            try:
                probes = asyncio.run(run_sessions(Path(tmp), sizes, mode=mode, prompt_bytes=int(args.prompt_kb * 1024),
                                                  calls=args.calls, keep_files=args.keep_files, on_probe=show))
            finally:
                tracemalloc.stop()
        last = probes[-1]
        for earlier in probes[:-1]:  # flat memory: ratios near 1 (a one-off table resize can step once early)
            print(f"heap at {last.sessions:,} / heap at {earlier.sessions:,} sessions: "
                  f"{last.heap_bytes / earlier.heap_bytes:.2f}x (sessions {last.sessions / earlier.sessions:.0f}x); "
                  f"RSS {last.rss_bytes / earlier.rss_bytes:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
