"""The two halves of "gateway only" networking, shared by every backend, and the in-sandbox helper that also applies
resource limits.

Host side, :class:`GatewayRelay` is an asyncio Unix-socket server in the session directory
(``<session>/gateway.sock``, so ``/polar/gateway.sock`` inside) that forwards each connection to the gateway's TCP
endpoint. Inside, the helper (``relay.c``, built statically with gcc or zig; ``relay_fallback.py`` where neither
is there) listens on ``127.0.0.1:GATEWAY_INNER_PORT`` and forwards to that socket. A sandbox without a network
namespace route to the host can then reach the proxy and nothing else. Backends mount the helper read-only at
:data:`~base.RELAY_PATH`.

The gateway tells a sandbox's connections from the operator's by their peer address: each connection a relay
opens to the gateway is in :func:`is_relay_peer` (its local address and port, unique while it is open) until it
closes, so the gateway's app answers such a caller its model routes only. Exact for the relays of the gateway's
own process (every backend's, started by its sandbox stages); a sandbox has no other way to the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from polar_gym.runtime.base import GATEWAY_INNER_PORT, SESSION_MOUNT, GatewayEndpoint

__all__ = [
    "GATEWAY_SOCKET",
    "RELAY_FALLBACK",
    "RELAY_SOURCE",
    "GatewayRelay",
    "build_relay",
    "cache_dir",
    "helper_argv",
    "is_relay_peer",
    "relay_compiler",
    "relay_compilers",
    "relay_program",
]

RELAY_SOURCE = Path(__file__).with_name("relay.c")
RELAY_FALLBACK = Path(__file__).with_name("relay_fallback.py")
#: the gateway socket's name in the session directory (``/polar/gateway.sock`` inside)
GATEWAY_SOCKET = "gateway.sock"
_SUN_PATH_MAX = 107
#: the local (address, port) of every open relay connection to a gateway in this process
_PEERS: set[tuple[str, int]] = set()


def is_relay_peer(client: tuple[str, int] | None) -> bool:
    """Whether a connection whose peer is ``client`` (an ASGI scope's ``client``) was opened by a sandbox's relay."""
    return client is not None and (client[0], client[1]) in _PEERS


def cache_dir() -> Path:
    return Path(os.environ.get("POLAR_CACHE") or Path.home() / ".cache" / "polar_gym")


def _relay_target(cache: Path | None = None) -> Path:
    digest = hashlib.sha256(RELAY_SOURCE.read_bytes()).hexdigest()[:16]
    return (cache or cache_dir()) / f"relay-{digest}" / "relay"


def relay_compilers() -> list[list[str]]:
    """The C compiler commands for the static helper, to try in order: gcc when it is on PATH (root and CI
    set-ups), then the zig toolchain set-up fetched from PyPI for users without gcc or without libc6-dev's static
    libc (``python -m polar_gym.assets zig``; it links statically against its own musl)."""
    found = []
    gcc = shutil.which("gcc")
    if gcc is not None:
        found.append([gcc])
    from polar_gym.assets import zig_path

    zig = zig_path()
    if zig.is_file():
        found.append([str(zig), "cc", "-target", f"{platform.machine()}-linux-musl"])
    return found


def relay_compiler() -> list[str] | None:
    """The first of :func:`relay_compilers`, or None."""
    return next(iter(relay_compilers()), None)


def _compiler_env(argv: list[str], cache: Path) -> dict[str, str] | None:
    """zig keeps its build cache under the polar_gym cache, not in ~/.cache/zig or the working directory."""
    if Path(argv[0]).name != "zig":
        return None
    zig_cache = str(cache / "zig-cache")
    return {**os.environ, "ZIG_GLOBAL_CACHE_DIR": zig_cache, "ZIG_LOCAL_CACHE_DIR": zig_cache}


def build_relay(cache: Path | None = None, cc: str | None = None) -> Path:
    """Compile relay.c statically into ``<cache>/relay-<sha of source>/relay`` (once; keyed by the source), with
    ``cc`` or else the first of :func:`relay_compilers` that succeeds.

    Blocking (runs the compiler): call it from set-up or a thread. Raises ``FileNotFoundError`` without a compiler
    and ``subprocess.CalledProcessError`` when the build fails.
    """
    target = _relay_target(cache)
    if target.is_file():
        return target
    compilers = [[cc]] if cc is not None else relay_compilers()
    if not compilers:
        raise FileNotFoundError("no C compiler for the sandbox helper: apt-get install gcc libc6-dev, or "
                                "python -m polar_gym.assets zig")
    target.parent.mkdir(parents=True, exist_ok=True)
    for i, compiler in enumerate(compilers):
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / "relay"
            try:
                subprocess.run([*compiler, "-O2", "-static", "-o", str(out), str(RELAY_SOURCE)], check=True,
                               capture_output=True, env=_compiler_env(compiler, cache or cache_dir()))
            except subprocess.CalledProcessError:
                if i == len(compilers) - 1:
                    raise
                continue  # gcc without libc6-dev's libc.a: the next compiler
            out.chmod(0o755)
            os.replace(out, target)  # atomic: concurrent builders never see a half-written binary
            return target
    return target


def relay_program(cache: Path | None = None) -> Path:
    """The helper to mount into sandboxes: the compiled relay, built now if gcc is there, else the Python script
    (set-up builds it with zig where gcc is missing)."""
    target = _relay_target(cache)
    if target.is_file():
        return target
    if shutil.which("gcc"):
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            return build_relay(cache)
    return RELAY_FALLBACK


def helper_argv(helper: str, command: Sequence[str], *, gateway: bool = False, nproc: int | None = None,
                data_bytes: int | None = None, file_bytes: int | None = None, max_connections: int | None = None,
                cpus: Sequence[int] | None = None, socket_path: str = f"{SESSION_MOUNT}/{GATEWAY_SOCKET}") -> list[str]:
    """The in-sandbox command line: helper options, then ``--`` and the command."""
    argv = [helper]
    if nproc is not None:
        argv += ["-n", str(nproc)]
    if data_bytes is not None:
        argv += ["-m", str(data_bytes)]
    if file_bytes is not None:
        argv += ["-f", str(file_bytes)]
    if cpus:
        argv += ["-c", ",".join(str(c) for c in cpus)]
    if gateway:
        argv += ["-l", str(GATEWAY_INNER_PORT), "-u", socket_path]
        if max_connections is not None:
            argv += ["-k", str(max_connections)]
    return [*argv, "--", *command]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.IncompleteReadError):
        writer.close()


class GatewayRelay:
    """Host half of the relay: ``<session_dir>/gateway.sock`` → the gateway's TCP endpoint, at most
    ``max_connections`` at once (more are closed at once: the sandbox can reach the socket without the in-sandbox
    relay, which holds its own connections to the same cap)."""

    def __init__(self, session_dir: Path, endpoint: GatewayEndpoint, *, max_connections: int | None = 64) -> None:
        self.path = session_dir / GATEWAY_SOCKET
        self.endpoint = endpoint
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if len(str(self.path)) <= _SUN_PATH_MAX:
                sock.bind(str(self.path))
            else:  # too long for sun_path: bind through a short /proc/self/fd path to the directory
                fd = os.open(self.path.parent, os.O_PATH)
                try:
                    sock.bind(f"/proc/self/fd/{fd}/{GATEWAY_SOCKET}")
                finally:
                    os.close(fd)
        except OSError:
            sock.close()
            raise
        # held before the first await: a start cancelled while it begins serving leaves stop() a socket to close
        self._server = await asyncio.start_unix_server(self._handle, sock=sock, backlog=1024, start_serving=False)
        await self._server.start_serving()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self.max_connections is not None and len(self._tasks) >= self.max_connections:
            writer.close()
            return
        self._tasks.add(task)
        try:
            try:
                up_r, up_w = await asyncio.open_connection(self.endpoint.host, self.endpoint.port)
            except OSError:
                return
            local = up_w.get_extra_info("sockname")
            peer = (str(local[0]), int(local[1]))
            _PEERS.add(peer)  # before a byte is forwarded: the gateway sees no request of it unmarked
            try:
                await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
            finally:
                up_w.close()
                _PEERS.discard(peer)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
