"""Check an image or a sandbox set-up by hand: run one command in a fresh sandbox.

    python -m polar_gym.runtime exec --backend local [--image DIR] [--network none|host|gateway]
                                     [--gateway HOST:PORT] [--timeout S] [--env K=V] [--cwd DIR] -- CMD...
    python -m polar_gym.runtime build-relay

``exec`` streams the command's output, exits with its exit code (124 on timeout, 125 when the sandbox crashed or
could not start, 130/143 when interrupted) and tears the sandbox down also on SIGINT / SIGTERM.
``build-relay`` compiles the sandbox helper once (scripts/setup.sh calls it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from typing import BinaryIO

from polar_gym.registry import RUNTIMES
from polar_gym.runtime.base import ExecStatus, GatewayEndpoint, OutputCallback, Runtime
from polar_gym.runtime.errors import SandboxError
from polar_gym.schema import RuntimeSpec

__all__ = ["main", "parse_args", "run_exec"]

EXIT_TIMEOUT = 124
EXIT_SANDBOX = 125


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.runtime", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("exec", help="run one command in a fresh sandbox")
    ex.add_argument("--backend", default="local", help="a RUNTIMES name or a dotted path (default: local)")
    ex.add_argument("--image", default=None)
    ex.add_argument("--network", choices=["none", "host", "gateway"], default="none")
    ex.add_argument("--gateway", default=None, metavar="HOST:PORT", help="the proxy to relay to (network gateway)")
    ex.add_argument("--timeout", type=float, default=None, metavar="S")
    ex.add_argument("--env", action="append", default=[], metavar="K=V")
    ex.add_argument("--cwd", default=None)
    ex.add_argument("--session-dir", default=None, help="keep the session directory here (default: a temp dir)")
    ex.add_argument("command", nargs="+", help="the command (after --)")
    sub.add_parser("build-relay", help="compile the sandbox helper into the cache")
    return parser.parse_args(argv)


def _endpoint(text: str | None) -> GatewayEndpoint | None:
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return GatewayEndpoint(host or "127.0.0.1", int(port))


def _write(stream: BinaryIO) -> OutputCallback:
    def write(chunk: bytes) -> None:
        stream.write(chunk)
        stream.flush()
    return write


async def run_exec(args: argparse.Namespace) -> int:
    spec = RuntimeSpec(backend=args.backend, image=args.image, network=args.network)
    runtime_cls = RUNTIMES.get(args.backend)
    env = dict(item.split("=", 1) for item in args.env)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    interrupted: list[int] = []

    def on_signal(signum: int) -> None:
        interrupted.append(signum)
        if main_task is not None:
            main_task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, on_signal, signum)
    with contextlib.ExitStack() as stack:
        session = args.session_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="polar-session-"))
        os.makedirs(session, exist_ok=True)
        runtime: Runtime = runtime_cls(spec, session, gateway=_endpoint(args.gateway))
        try:
            try:
                await runtime.start()
                result = await runtime.exec(args.command, env=env, cwd=args.cwd, timeout=args.timeout,
                                            on_stdout=_write(sys.stdout.buffer),
                                            on_stderr=_write(sys.stderr.buffer))
            finally:
                await asyncio.shield(runtime.stop())
        except asyncio.CancelledError:
            return 128 + (interrupted[0] if interrupted else signal.SIGINT)
        except SandboxError as exc:
            print(f"polar_gym.runtime: {exc}", file=sys.stderr)
            return EXIT_SANDBOX
    if result.status is ExecStatus.TIMEOUT:
        print(f"polar_gym.runtime: timed out after {args.timeout} s", file=sys.stderr)
        return EXIT_TIMEOUT
    if result.status in (ExecStatus.CRASHED, ExecStatus.CANCELLED):
        print(f"polar_gym.runtime: {result.status.value}: {result.reason}", file=sys.stderr)
        return EXIT_SANDBOX
    if result.reason:
        print(f"polar_gym.runtime: {result.reason}", file=sys.stderr)
    return result.exit_code if result.exit_code is not None else EXIT_SANDBOX


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.action == "build-relay":
        from polar_gym.runtime.relay import build_relay

        print(build_relay())
        return 0
    return asyncio.run(run_exec(args))


if __name__ == "__main__":
    sys.exit(main())
