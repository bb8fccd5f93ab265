"""The runtime guarantees of issue 4, checked on every backend that runs here (the ``backend`` fixture).

Leaks are checked by scanning, not by trusting the backend: every test's spec carries a unique marker in the
environment (and most commands carry it in argv), and after each test no host process may carry it, no mount may
name the session directory, and the backend's own check (containers) must come back empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from polar_gym.runtime.base import ExecStatus, GatewayEndpoint, Runtime
from polar_gym.runtime.errors import SandboxError
from tests._waiting import BOUND, until
from tests.runtime._runtime_kit import Backend, mounts_with, processes_with

MakeRuntime = Callable[..., Runtime]


# -- helpers ------------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def http_server(body: bytes) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A one-line HTTP server on host loopback; yields its port and the requests it saw."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


def wget(url: str, timeout: int = 5) -> str:
    # (busybox 1.35's own -T option crashes, so an outer timeout bounds the fetch)
    return f"busybox timeout {timeout} busybox wget -q -O - {url}"


async def wait_for_text(chunks: list[bytes], text: bytes, task: asyncio.Task[object], limit: float = BOUND) -> None:
    """Until ``text`` was streamed or the command ended (the caller asserts which)."""
    await until(lambda: text in b"".join(chunks) or task.done(), limit, f"{text!r} or the command's end")


# -- exec basics --------------------------------------------------------------------------------------------------


async def test_exit_codes_env_and_cwd(make_runtime: MakeRuntime, marker: str) -> None:
    async with make_runtime(env={"FROM_SPEC": "spec-value"}) as rt:
        ok = await rt.exec(["sh", "-c", "echo $FROM_SPEC $FROM_EXEC; pwd"], env={"FROM_EXEC": "exec-value"})
        assert ok.status is ExecStatus.OK and ok.exit_code == 0
        assert ok.stdout.decode().split("\n")[0] == "spec-value exec-value"
        workdir = ok.stdout.decode().split("\n")[1]
        failed = await rt.exec("echo to-stderr >&2; exit 7")
        assert (failed.status, failed.exit_code, failed.stderr) == (ExecStatus.FAILED, 7, b"to-stderr\n")
        assert (await rt.exec("mkdir -p sub/dir")).ok
        here = await rt.exec("pwd", cwd="sub/dir")
        assert here.stdout.decode().strip() == f"{workdir}/sub/dir"
        absolute = await rt.exec("pwd", cwd="/polar")
        assert absolute.stdout == b"/polar\n"
        echoed = await rt.exec(["cat"], stdin=b"fed through stdin\x00\xff")
        assert echoed.stdout == b"fed through stdin\x00\xff"
        missing = await rt.exec(["no-such-command-anywhere"])
        assert missing.status is ExecStatus.FAILED and missing.exit_code in (126, 127)


async def test_state_persists_between_execs(make_runtime: MakeRuntime) -> None:
    async with make_runtime() as rt:
        assert (await rt.exec("echo kept > state.txt && echo home > $HOME/h && echo t > /tmp/t")).ok
        again = await rt.exec("cat state.txt $HOME/h /tmp/t")
        assert again.stdout == b"kept\nhome\nt\n"


async def test_concurrent_execs(make_runtime: MakeRuntime) -> None:
    async with make_runtime() as rt:
        results = await asyncio.gather(*(rt.exec(f"echo {i}") for i in range(8)))
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]


async def test_output_streams_before_the_command_ends(make_runtime: MakeRuntime, session_dir: Path) -> None:
    async with make_runtime() as rt:
        chunks: list[bytes] = []
        task = asyncio.create_task(rt.exec(
            "echo first; while [ ! -e /polar/go ]; do busybox usleep 20000; done; echo second",
            on_stdout=chunks.append, timeout=30))
        await wait_for_text(chunks, b"first", task)  # type: ignore[arg-type]
        assert b"first" in b"".join(chunks) and not task.done()
        (session_dir / "go").touch()
        result = await task
        assert result.ok and result.stdout == b"first\nsecond\n" == b"".join(chunks)


async def test_timeout_keeps_partial_output(make_runtime: MakeRuntime, marker: str) -> None:
    async with make_runtime() as rt:
        # the timeout leaves a loaded machine room to run the echos; only the timeout can end the sleep
        result = await rt.exec("echo partial; echo err-part >&2; busybox sleep 300", timeout=5,
                               env={"EXEC_MARK": f"{marker}-exec"})
        assert result.status is ExecStatus.TIMEOUT
        assert result.stdout == b"partial\n" and result.stderr == b"err-part\n"
        assert processes_with(f"{marker}-exec") == []  # that exec's whole tree, while the sandbox lives on
        assert (await rt.exec("echo still usable")).ok


# -- cancel, stop, crash ------------------------------------------------------------------------------------------


TREE = ("busybox sleep 300 & busybox setsid busybox sleep 301 & (busybox sleep 302 &); "
        "sh -c 'busybox sleep 303 & wait' & echo started; wait # {marker}")


async def _start_tree(rt: Runtime, marker: str) -> tuple[asyncio.Task[object], list[bytes]]:
    chunks: list[bytes] = []
    task = asyncio.create_task(rt.exec(TREE.format(marker=marker), on_stdout=chunks.append,
                                       env={"EXEC_MARK": f"{marker}-tree"}))
    await wait_for_text(chunks, b"started", task)  # type: ignore[arg-type]
    assert b"started" in b"".join(chunks), "the process tree did not start"
    # the scan must see the whole tree: sh, 4 sleeps, the subshells
    await until(lambda: len(processes_with(f"{marker}-tree")) >= 6, what="the whole tree in the /proc scan")
    return task, chunks  # type: ignore[return-value]


async def test_cancel_kills_the_whole_tree(make_runtime: MakeRuntime, marker: str, session_dir: Path) -> None:
    async with make_runtime() as rt:
        task, _ = await _start_tree(rt, marker)
        await rt.cancel()
        result = await asyncio.wait_for(task, 30)
        assert result.status is ExecStatus.CANCELLED  # type: ignore[attr-defined]
        assert result.stdout == b"started\n"  # type: ignore[attr-defined]
        assert processes_with(f"{marker}-tree") == []
        assert (await rt.exec("echo alive")).stdout == b"alive\n"  # cancel keeps the sandbox
    assert processes_with(marker) == []
    assert mounts_with(str(session_dir)) == []


async def test_stop_kills_everything_and_is_idempotent(make_runtime: MakeRuntime, marker: str,
                                                       session_dir: Path) -> None:
    rt = make_runtime()
    await rt.start()
    task, _ = await _start_tree(rt, marker)
    await rt.stop()
    result = await asyncio.wait_for(task, 30)
    assert result.status is ExecStatus.CANCELLED  # type: ignore[attr-defined]
    assert processes_with(marker) == []
    assert mounts_with(str(session_dir)) == []
    await rt.stop()
    await rt.stop()
    with pytest.raises(SandboxError):
        await rt.exec("true")


async def test_stop_without_start_is_harmless(make_runtime: MakeRuntime) -> None:
    rt = make_runtime()
    await rt.stop()
    await rt.stop()


async def test_a_crashed_sandbox_is_reported(make_runtime: MakeRuntime, marker: str) -> None:
    async with make_runtime() as rt:
        task, _ = await _start_tree(rt, marker)
        # kill the sandbox from outside: every process carrying the marker, lowest pid (the outermost) first
        for line in sorted(processes_with(marker), key=lambda p: int(p.split(":")[0])):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        result = await asyncio.wait_for(task, 30)  # never hangs
        assert result.status is ExecStatus.CRASHED, result  # type: ignore[attr-defined]
        assert result.reason  # type: ignore[attr-defined]


# -- network ------------------------------------------------------------------------------------------------------


async def test_network_none_has_no_network(make_runtime: MakeRuntime) -> None:
    async with http_server(b"host-secret") as (port, seen), make_runtime(network="none") as rt:
        tcp = await rt.exec(wget(f"http://127.0.0.1:{port}/"))
        assert tcp.status is ExecStatus.FAILED and b"host-secret" not in tcp.stdout
        dns = await rt.exec("busybox nslookup example.com")
        assert dns.status is ExecStatus.FAILED
        assert seen == []


async def test_network_host_reaches_host_loopback(make_runtime: MakeRuntime, backend: Backend,
                                                  tmp_path: Path) -> None:
    async with http_server(b"host-hello") as (port, _), make_runtime(network="host") as rt:
        reached = await rt.exec(wget(f"http://127.0.0.1:{port}/"))
        assert reached.stdout == b"host-hello"
        if rt.loopback_ip is not None:  # backends sharing the host network hand out one address per sandbox
            assert (await rt.exec("echo $POLAR_LOOPBACK_IP")).stdout.decode().strip() == rt.loopback_ip
            other_dir = tmp_path / "other"
            other_dir.mkdir()
            other = backend.make(backend.spec("other-" + rt.loopback_ip, network="host"), other_dir, None)
            async with other:
                assert other.loopback_ip is not None and other.loopback_ip != rt.loopback_ip


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[object]:
    from tests._serving import oracle_service, serve

    yield from serve(oracle_service(tmp_path / "capture"))


async def test_gateway_only_reaches_the_proxy_and_nothing_else(make_runtime: MakeRuntime, proxy: object) -> None:
    url: str = proxy.url  # type: ignore[attr-defined]
    host, port = url.removeprefix("http://").split(":")
    async with http_server(b"other-secret") as (other_port, seen):
        async with make_runtime(network="gateway", gateway=GatewayEndpoint(host, int(port))) as rt:
            health = await rt.exec(wget(f"{rt.gateway_url}/health"))
            assert health.ok, health
            body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
            chat = await rt.exec(
                f"busybox timeout 10 busybox wget -q -O - --header 'Authorization: Bearer sess-relay' "
                f"--header 'Content-Type: application/json' --post-data '{body}' {rt.gateway_url}/v1/chat/completions")
            assert chat.ok, chat
            assert "choices" in json.loads(chat.stdout)
            assert len(proxy.completions("sess-relay")) == 1  # type: ignore[attr-defined]
            parallel = await asyncio.gather(*(rt.exec(wget(f"{rt.gateway_url}/health")) for _ in range(4)))
            assert all(r.ok for r in parallel)
            # nothing else: neither another host server nor the proxy's own host port
            other = await rt.exec(wget(f"http://127.0.0.1:{other_port}/"))
            assert not other.ok and b"other-secret" not in other.stdout
            if int(port) != 18080:
                direct = await rt.exec(wget(f"http://127.0.0.1:{port}/health"))
                assert not direct.ok
            assert (await rt.exec("busybox nslookup example.com")).status is ExecStatus.FAILED
        assert seen == []


# -- files --------------------------------------------------------------------------------------------------------


async def test_upload_download_round_trip(make_runtime: MakeRuntime, tmp_path: Path) -> None:
    every_byte = bytes(range(256)) * 257
    big = os.urandom(50 * 1024 * 1024 + 7)
    (tmp_path / "big.bin").write_bytes(big)
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "deep.bin").write_bytes(every_byte[::-1])
    (tree / "empty").write_bytes(b"")
    (tree / "a" / "x.txt").write_text("text\n")
    (tree / "emptydir").mkdir()
    async with make_runtime() as rt:
        await rt.upload(every_byte, "bytes.bin")
        await rt.upload(tmp_path / "big.bin", "/tmp/big.bin")
        await rt.upload(tree, "/polar/up/tree")
        inside = await rt.exec("busybox sha256sum bytes.bin /tmp/big.bin /polar/up/tree/a/b/deep.bin")
        sums = [line.split()[0] for line in inside.stdout.decode().splitlines()]
        expected = [hashlib.sha256(d).hexdigest() for d in (every_byte, big, every_byte[::-1])]
        assert sums == expected
        out = tmp_path / "out"
        await rt.download("bytes.bin", out / "bytes.bin")
        await rt.download("/tmp/big.bin", out / "big.bin")
        await rt.download("/polar/up/tree", out / "tree")
        assert (await rt.exec("busybox mkdir -p made/in && echo -n inside > made/in/f")).ok
        await rt.download("made", out / "made")
    assert (out / "bytes.bin").read_bytes() == every_byte
    assert (out / "big.bin").read_bytes() == big
    assert sorted(str(p.relative_to(out / "tree")) for p in (out / "tree").rglob("*")) == \
        sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    assert (out / "tree" / "a" / "b" / "deep.bin").read_bytes() == every_byte[::-1]
    assert (out / "made" / "in" / "f").read_bytes() == b"inside"


async def test_files_cannot_escape_the_sandbox(make_runtime: MakeRuntime, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    async with make_runtime() as rt:
        attempts = ["../" * 12 + str(outside / "dotdot").lstrip("/"), str(outside / "absolute")]
        assert (await rt.exec(f"ln -s {outside} link")).ok
        attempts.append("link/through-symlink")
        for dst in attempts:
            with contextlib.suppress(SandboxError, OSError):
                await rt.upload(b"pwned", dst)
        assert sorted(os.listdir(outside)) == []
        (outside / "secret").write_text("host secret")
        with pytest.raises((SandboxError, OSError)):
            await rt.download("link/secret", tmp_path / "leak")
        assert not (tmp_path / "leak").exists()


# -- resource limits ----------------------------------------------------------------------------------------------


async def test_max_processes_blocks_a_fork_bomb(make_runtime: MakeRuntime, backend: Backend, marker: str) -> None:
    if "max_processes" not in backend.limits:
        pytest.skip(f"{backend.name} has no process limit")
    async with make_runtime(max_processes=16) as rt:
        out: list[bytes] = []
        task = asyncio.create_task(rt.exec(
            f"for i in $(busybox seq 60); do busybox sleep 300 & done; echo spawned; wait # {marker}",
            on_stdout=out.append, timeout=BOUND))
        most = 0

        def bomb_over() -> bool:  # every fork was tried (or the shell gave up); sample the count meanwhile
            nonlocal most
            most = max(most, len(processes_with(marker)))
            return b"spawned" in b"".join(out) or task.done()

        await until(bomb_over, what="the fork loop to end")
        most = max(most, len(processes_with(marker)))
        await rt.cancel()
        result = await task
        assert most < 30, f"{most} processes under a limit of 16"
        assert result.status is not ExecStatus.OK


async def test_memory_limit_stops_an_allocation(make_runtime: MakeRuntime, backend: Backend) -> None:
    if "memory_mb" not in backend.limits:
        pytest.skip(f"{backend.name} has no memory limit")
    async with make_runtime(memory_mb=64) as rt:
        small = await rt.exec("busybox dd if=/dev/zero of=/dev/null bs=4M count=1")
        assert small.ok, small
        big = await rt.exec("busybox dd if=/dev/zero of=/dev/null bs=256M count=1")
        assert not big.ok
