#!/usr/bin/env python3
"""The sandbox helper in pure Python, for hosts without gcc: the same command line and behaviour as relay.c.

    relay_fallback.py [-n NPROC] [-m BYTES] [-f BYTES] [-c CPUS] [-l PORT -u SOCKET [-k MAXCONN]] -- CMD...

Standard library only, because it runs inside the sandbox with whatever python3 the sandbox's root provides.
"""

from __future__ import annotations

import asyncio
import getopt
import os
import resource
import socket
import sys

__all__ = ["main"]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction keeps flowing
    except OSError:
        writer.close()


async def _serve(listener: socket.socket, path: str, max_connections: int = 64) -> None:
    slots = asyncio.Semaphore(max_connections)
    # asyncio's stream protocol holds its reader only weakly, and the loop stops watching a client that has
    # half-closed: without these references a connection waiting for its answer is garbage collected and closed.
    live: set[asyncio.Task[None]] = set()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        live.add(task)
        try:
            async with slots:  # at the cap, an accepted connection waits here before it reaches the gateway
                await _forward(client_r, client_w)
        finally:
            live.discard(task)

    async def _forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        for attempt in range(100):
            try:
                up_r, up_w = await asyncio.open_unix_connection(path)
                break
            except BlockingIOError:  # the Unix side's accept backlog is full (EAGAIN): wait, as relay.c's connect does
                await asyncio.sleep(0.01 * min(attempt + 1, 10))
            except OSError:
                client_w.close()
                return
        else:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
        client_w.close()
        up_w.close()

    server = await asyncio.start_server(handle, sock=listener, backlog=1024)
    await server.serve_forever()


def main(argv: list[str]) -> int:
    opts, cmd = getopt.getopt(argv, "n:m:f:c:l:u:k:")
    values = dict(opts)
    if "-n" in values:
        resource.setrlimit(resource.RLIMIT_NPROC, (int(values["-n"]),) * 2)
    if "-m" in values:
        resource.setrlimit(resource.RLIMIT_DATA, (int(values["-m"]),) * 2)
    if "-f" in values:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(values["-f"]),) * 2)
    if "-c" in values:
        os.sched_setaffinity(0, {int(c) for c in values["-c"].split(",")})
    if not cmd:
        print("polar relay: no command", file=sys.stderr)
        return 2
    if "-l" in values and "-u" in values:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(values["-l"])))
        listener.listen(1024)
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            asyncio.run(_serve(listener, values["-u"], int(values.get("-k", 64))))
            os._exit(0)
        listener.close()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"polar relay: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
