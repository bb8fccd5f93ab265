"""Record what real harness CLIs send to the gateway, as test data for the provider front ends.

For each target (a harness, or pi with one of its four APIs) this starts the proxy (oracle engine, real Qwen
tokenizer, a file journal) on a loopback port, runs the pinned CLI once non-interactively in a temp working dir with
HOME pointing at a temp dir that holds its config files, then reads the journal back and writes a few of the
requests to ``tests/data/harness/<target>/NN.json`` (NN = the call's index in the session) plus a summary of every
run to ``tests/data/harness/runs.json``. The files, environment and argv come from the harness adapters in
``polar_gym/harness/``, so a recording is also a live test of the adapters.

The whole recorder re-executes itself inside a fresh network namespace (``unshare --net``, loopback only), so the
CLIs' telemetry and update checks fail fast instead of leaving the machine. Run as root, from the repository root:

    .venv/bin/python scripts/record_harness_traffic.py [TARGET ...] [--timeout 240]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from polar_gym.harness.base import Harness, HarnessContext  # noqa: E402
from polar_gym.harness.install import PINS, ensure_installed  # noqa: E402
from polar_gym.proxy.tokenizer import ChatTokenizer  # noqa: E402
from polar_gym.registry import HARNESSES  # noqa: E402
from polar_gym.schema import CompletionRecord  # noqa: E402

__all__ = ["TARGETS", "Launch", "Target", "context_for", "launch_for", "main", "record", "select_records"]

INSTRUCTION = "Create hello.txt containing hi, then reply done."
COMMANDS = ["printf hi > hello.txt"]
FINAL_ANSWER = "done"
MODEL = "policy"
TOKENIZER_DIR = Path.home() / ".cache" / "polar_gym" / "tokenizer-qwen3-llamacpp0.3.36"
OUT_DIR = REPO / "tests" / "data" / "harness"
_NETNS_FLAG = "POLAR_RECORD_IN_NETNS"
#: dropped from saved headers: credentials, and what varies per run
_DROP_HEADERS = {"authorization", "x-api-key", "x-goog-api-key", "cookie", "proxy-authorization", "host",
                 "content-length"}

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class Target:
    """One recording: a harness and, for pi, the API it is configured to speak."""

    name: str
    harness: str
    provider: str
    pi_api: str | None = None


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("qwen_code", "qwen_code", "openai_chat"),
    Target("opencode", "opencode", "openai_chat"),
    Target("pi_openai_completions", "pi", "openai_chat", "openai-completions"),
    Target("claude_code", "claude_code", "anthropic"),
    Target("pi_anthropic_messages", "pi", "anthropic", "anthropic-messages"),
    Target("codex", "codex", "openai_responses"),
    Target("pi_openai_responses", "pi", "openai_responses", "openai-responses"),
    Target("gemini_cli", "gemini_cli", "google"),
    Target("pi_google_generative_ai", "pi", "google", "google-generative-ai"),
]}


@dataclass
class Launch:
    """How to run a harness: argv, extra environment, files to write (absolute path -> text), side model names."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    side_models: list[str] = field(default_factory=list)


def context_for(target: Target, binary: str, gateway: str, key: str, home: str, workdir: str) -> HarnessContext:
    """The adapter's view of one recording: the session key, the fixed instruction and model, pi's API."""
    return HarnessContext(session_id=key, instruction=INSTRUCTION, model_name=MODEL, gateway_url=gateway,
                          workdir=workdir, home=home, cli_path=binary,
                          config={"api": target.pi_api} if target.pi_api else {})


def launch_for(target: Target, binary: str, gateway: str, key: str, home: str, workdir: str) -> Launch:
    """The command line, environment and config files that point ``target`` at ``gateway`` with ``key``, from the
    harness adapter registered under ``target.harness`` (pure, as the adapters are)."""
    adapter: Harness = HARNESSES.get(target.harness)()
    ctx = context_for(target, binary, gateway, key, home, workdir)
    if adapter.provider_for(ctx) != target.provider:
        raise ValueError(f"{target.name}: adapter speaks {adapter.provider_for(ctx)}, target says {target.provider}")
    return Launch(adapter.command(ctx), adapter.env(ctx), adapter.files(ctx), adapter.side_models(ctx))


def select_records(records: list[CompletionRecord], limit: int) -> list[CompletionRecord]:
    """A few representative calls: the first, the first of every other (model, path), the last, then the rest."""
    chosen: dict[int, CompletionRecord] = {}
    seen: set[tuple[str, str]] = set()
    ordered = [r for r in records if (r.model, r.path) not in seen and not seen.add((r.model, r.path))]
    for record in [*records[:1], *ordered, *records[-1:], *records]:
        if len(chosen) >= limit:
            break
        chosen.setdefault(record.index, record)
    return sorted(chosen.values(), key=lambda r: r.index)


def _strip_key(path: str) -> str:
    base, _, query = path.partition("?")
    kept = [p for p in query.split("&") if p and not p.startswith("key=")]
    return base + ("?" + "&".join(kept) if kept else "")


class _Tap:
    """ASGI middleware noting every request the harness makes (method, path, status, headers without auth, body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode()
        entry: dict[str, Any] = {"method": scope["method"], "path": _strip_key(scope["path"] + ("?" + query
                                                                                         if query else "")),
                                 "headers": {k.decode().lower(): v.decode() for k, v in scope["headers"]
                                             if k.decode().lower() not in _DROP_HEADERS}}
        chunks: list[bytes] = []

        async def tapped_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def tapped_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)

        self.seen.append(entry)
        await self.app(scope, tapped_receive, tapped_send)
        raw = b"".join(chunks)
        try:
            entry["body"] = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            entry["body"] = raw.decode(errors="replace")


@contextmanager
def _proxy(tokenizer: ChatTokenizer, capture: Path, key: str) -> Iterator[tuple[str, _Tap, Any]]:
    import uvicorn

    from polar_gym.proxy.app import create_app
    from polar_gym.proxy.capture import CaptureJournal
    from polar_gym.proxy.engines.oracle import OracleEngine
    from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry
    from polar_gym.schema import OracleScript

    engine = OracleEngine(tokenizer, default_script=OracleScript(commands=COMMANDS, final_answer=FINAL_ANSWER))
    journal = CaptureJournal(capture)
    service = ProxyService(engine, journal, SessionRegistry(allow_adhoc=True), model_names=[MODEL])
    service.sessions.register(SessionInfo(key, MODEL))  # marks calls with another model name as side requests
    tap = _Tap(create_app(service))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(tap, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 15
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", tap, service
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        journal.close()


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int | None, str, str, float]:
    """Run a CLI in its own process group; on timeout kill the whole group. (exit code or None, out, err, secs)"""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return code, out, err, time.perf_counter() - started


def _base_env(home: Path) -> dict[str, str]:
    node_dir = str(Path(shutil.which("node") or "/usr/bin/node").parent)
    return {"PATH": f"{node_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "USER": os.environ.get("USER", "root"), "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", "CI": "1",
            "TMPDIR": str(home / "tmp"),
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_DATA_HOME": str(home / ".local/share"), "XDG_STATE_HOME": str(home / ".local/state"),
            "DO_NOT_TRACK": "1", "NO_UPDATE_NOTIFIER": "1"}


def _provider_missing(provider: str) -> str | None:
    """Why the proxy cannot serve ``provider`` yet (its front end does not import), or None."""
    from polar_gym.registry import PROVIDERS, RegistryError

    try:
        PROVIDERS.get(provider)
    except (RegistryError, ImportError) as exc:
        return f"polar_gym.proxy.providers.{provider} is not available: {exc}"
    return None


def record(target: Target, binary: Path, tokenizer: ChatTokenizer, out_dir: Path, timeout: float,
           max_saved: int, keep: Path | None) -> dict[str, Any]:
    """Run one target end to end; write its request files; return its summary."""
    pin = PINS[target.harness]
    summary: dict[str, Any] = {"target": target.name, "harness": target.harness, "pi_api": target.pi_api,
                               "package": pin.package, "cli_version": pin.version, "provider": target.provider}
    missing = _provider_missing(target.provider)
    if missing:
        return {**summary, "skipped": missing}
    key = f"rec-{target.name}"
    with tempfile.TemporaryDirectory(prefix=f"polar-rec-{target.name}-") as tmp:
        root = Path(tmp)
        home, work, capture = root / "home", root / "work", root / "capture"
        for d in (home / "tmp", work):
            d.mkdir(parents=True)
        with _proxy(tokenizer, capture, key) as (gateway, tap, service):
            launch = launch_for(target, str(binary), gateway, key, str(home), str(work))
            service.model_names = [MODEL, *launch.side_models]  # what /v1/models lists, as a gateway would
            for name, text in launch.files.items():
                path = Path(name)
                if root not in path.parents:
                    raise ValueError(f"{target.name}: adapter wrote outside the run's temp dir: {path}")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            code, out, err, seconds = _run(launch.argv, {**_base_env(home), **launch.env}, work, timeout)
            time.sleep(0.5)  # let in-flight journal writes land
        from polar_gym.journal import read_session

        records = read_session(capture / key) if (capture / key).exists() else []
        hello = (work / "hello.txt").read_text() if (work / "hello.txt").exists() else None
        if keep is not None:
            shutil.copytree(root, keep / target.name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("node_modules"))
    target_dir = out_dir / target.name
    shutil.rmtree(target_dir, ignore_errors=True)
    target_dir.mkdir(parents=True)
    headers_for = _match_headers(records, tap.seen)
    saved = []
    for rec in select_records(records, max_saved):
        doc = {"harness": target.harness, "cli_version": pin.version, "path": _strip_key(rec.path),
               "provider": rec.provider, "headers": headers_for.get(rec.index, {}), "body": rec.request}
        if target.pi_api:
            doc["pi_api"] = target.pi_api
        name = f"{rec.index:02d}.json"
        (target_dir / name).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        saved.append(name)
    return {
        **summary, "exit_code": code, "timed_out": code is None, "seconds": round(seconds, 1),
        "hello_txt": hello, "completed": code == 0 and hello == "hi",
        "calls": len(records),
        "call_log": [{"index": r.index, "path": _strip_key(r.path), "model": r.model, "stream": r.stream,
                      "status": r.status, "side_request": r.side_request, "finish_reason": r.finish_reason,
                      "body_bytes": len(orjson.dumps(r.request))} for r in records],
        "other_requests": [f"{e['method']} {e['path']} -> {e.get('status')}" for e in tap.seen
                           if not (e["method"] == "POST" and e.get("status") == 200 and isinstance(e.get("body"), dict)
                                   and any(e["body"] == r.request for r in records))],
        "saved": saved,
        "stdout_tail": out[-400:], "stderr_tail": err[-1500:],
    }


def _match_headers(records: list[CompletionRecord], seen: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """Each journaled call's request headers, matched by identical body (the tap sees arrival order)."""
    out: dict[int, dict[str, str]] = {}
    used: set[int] = set()
    for rec in records:
        for i, entry in enumerate(seen):
            if i not in used and entry.get("body") == rec.request:
                used.add(i)
                out[rec.index] = entry["headers"]
                break
    return out


def _reexec_in_netns() -> None:  # pragma: no cover - process glue
    """Run this script again inside a new network namespace whose only interface is loopback."""
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("unshare (util-linux) is needed for a loopback-only network namespace; or pass --allow-network")
    user = [] if os.geteuid() == 0 else ["--map-root-user"]  # rootless: a user namespace owns the net namespace
    cmd = "ip link set lo up && exec " + shlex.join([sys.executable, *sys.argv])
    os.execve(unshare, [unshare, *user, "--net", "--", "sh", "-c", cmd], {**os.environ, _NETNS_FLAG: "1"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", help=f"default: all of {', '.join(TARGETS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per harness run")
    parser.add_argument("--max-saved", type=int, default=4, help="requests saved per target")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--keep", type=Path, help="copy each run's temp dir (home, work, journal) here")
    parser.add_argument("--allow-network", action="store_true", help="do not isolate the CLIs' network")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    if not args.allow_network and os.environ.get(_NETNS_FLAG) != "1":
        _reexec_in_netns()
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    binaries = ensure_installed()
    tokenizer = HFChatTokenizer(TOKENIZER_DIR)
    runs_file = args.out / "runs.json"
    runs: dict[str, Any] = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    for name in args.targets or list(TARGETS):
        target = TARGETS[name]
        print(f"== {name}", flush=True)
        summary = record(target, binaries[target.harness], tokenizer, args.out, args.timeout, args.max_saved,
                         args.keep)
        runs[name] = summary
        args.out.mkdir(parents=True, exist_ok=True)
        runs_file.write_text(json.dumps(dict(sorted(runs.items())), indent=2) + "\n")
        if "skipped" in summary:
            print(f"   skipped: {summary['skipped']}", flush=True)
            continue
        print(f"   exit={summary['exit_code']} completed={summary['completed']} calls={summary['calls']} "
              f"{summary['seconds']} s saved={summary['saved']} other={summary['other_requests']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
