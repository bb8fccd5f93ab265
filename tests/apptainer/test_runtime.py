"""The apptainer runtime against a fake ``apptainer``/``singularity`` on PATH (``fake_apptainer.py``): the real
subprocess and spython code paths run, only the container is simulated (commands run on the host with paths
rewritten). Covers the life cycle, streaming, stdin, timeouts and cancel (process trees), file transfer, error
handling and cleanup ordering."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_gym.apptainer.runtime import ApptainerRuntime
from polar_gym.registry import RUNTIMES
from polar_gym.runtime.base import GATEWAY_INNER_PORT, ExecStatus, GatewayEndpoint
from polar_gym.runtime.errors import SandboxStartError, SandboxStateError, SandboxUnavailable
from polar_gym.schema import RuntimeSpec
from tests._waiting import BOUND, until
from tests.apptainer._apptainer_kit import FakeApptainer, make_fake


def runtime(tmp_path: Path, network: str = "none", **options: object) -> ApptainerRuntime:
    """The options are the operator's (the constructor's): ``binary`` may not come from a request."""
    spec = RuntimeSpec(backend="apptainer", image="/images/task.sif", network=network, env={"BASE": "b"})  # type: ignore[arg-type]
    return ApptainerRuntime(spec, tmp_path / "session", options=dict(options))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_registry_resolves_the_backend() -> None:
    assert RUNTIMES.get("apptainer") is ApptainerRuntime


async def test_life_cycle_exec_env_cwd_and_stop(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    rt = runtime(tmp_path)
    async with rt:
        result = await rt.exec("echo $BASE $EXTRA; pwd", env={"EXTRA": "a,b=c"})
        assert result.ok and result.exit_code == 0
        lines = result.text.splitlines()
        assert lines[0] == "b a,b=c"
        assert lines[1].endswith("/workspace")  # --pwd defaults to spec.workdir, created in the overlay at start
        failed = await rt.exec(["sh", "-c", "echo oops >&2; exit 3"])
        assert failed.status is ExecStatus.FAILED and failed.exit_code == 3 and failed.stderr == b"oops\n"
    verbs = fake_apptainer.verbs()
    assert verbs[:2] == ["--version", "instance start"]
    assert verbs[-1] == "instance stop"
    assert fake_apptainer.instances() == []
    assert not (tmp_path / "session" / "overlay").exists()
    # issue 35: apptainer itself ran with none of the sandbox's variables (they went in an env file), in /
    logged = [json.loads(line) for line in (fake_apptainer.state / "argv.log").read_text().splitlines()]
    assert logged
    for call in logged:  # spython's own calls (--version, instance list / stop) run in the gateway's directory
        if call["args"][:1] == ["exec"] or call["args"][:2] == ["instance", "start"]:
            assert call["cwd"] == "/", call
        assert not {"BASE", "EXTRA"} & set(call["env"]) and "a,b=c" not in call["env"].values(), call
        assert not any(k.startswith(("APPTAINERENV_", "LD_")) for k in call["env"]), call
    env_files = [c["args"][c["args"].index("--env-file") + 1] for c in logged if "--env-file" in c["args"]]
    assert env_files and not any(map(os.path.exists, env_files))  # outside the session, removed after use
    assert not any(f.startswith(str(tmp_path / "session")) for f in env_files)
    # the spython path: spython's Instance.stop built this (--quiet first, -t timeout)
    assert fake_apptainer.calls()[-1] == ["--quiet", "instance", "stop", "-t", "10", rt.instance]


async def test_stdin_and_streaming_callbacks(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    chunks: list[bytes] = []
    async with runtime(tmp_path) as rt:
        result = await rt.exec(["sh", "-c", "cat; echo done >&2"], stdin=b"x" * 200_000, on_stdout=chunks.append)
    assert result.ok and result.stdout == b"x" * 200_000 and result.stderr == b"done\n"
    assert b"".join(chunks) == result.stdout


async def test_timeout_keeps_partial_output_and_kills_the_tree(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    async with runtime(tmp_path) as rt:
        # room for a loaded machine to start the (Python) fake and echo; only the timeout ends the sleeps
        result = await rt.exec("echo started; sleep 300 & echo $! > bg.pid; sleep 300", timeout=5)
        assert result.status is ExecStatus.TIMEOUT and result.stdout == b"started\n"
        assert "timeout" in (result.reason or "")
        bg = int((fake_apptainer.state / f"{rt.instance}.root" / "workspace" / "bg.pid").read_text())
        assert not pid_alive(bg)  # the background grandchild went with the tree
        assert (await rt.exec("echo still usable")).ok
    assert "exec" in fake_apptainer.verbs()


async def test_cancel_kills_every_running_command(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    async with runtime(tmp_path) as rt:
        outs: list[list[bytes]] = [[], [], []]
        tasks = [asyncio.create_task(rt.exec(f"echo {i}; sleep 60", on_stdout=outs[i].append)) for i in range(3)]
        await until(lambda: all(outs), what="the three commands to run")
        await rt.cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks), BOUND)
        assert [r.status for r in results] == [ExecStatus.CANCELLED] * 3
        assert sorted(r.stdout for r in results) == [b"0\n", b"1\n", b"2\n"]
        assert (await rt.exec("true")).ok


async def test_stop_during_exec_cancels_it_and_orders_cleanup(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    rt = runtime(tmp_path)
    await rt.start()
    out: list[bytes] = []
    task = asyncio.create_task(rt.exec("echo running; sleep 60", on_stdout=out.append))
    await until(lambda: out, what="the command to run")
    await rt.stop()
    result = await asyncio.wait_for(task, BOUND)
    assert result.status is ExecStatus.CANCELLED
    verbs = fake_apptainer.verbs()
    # the exec's tree is killed (a second exec) before the instance stops; stop is the last command
    kill = max(i for i, c in enumerate(fake_apptainer.calls()) if "kill-tree" in c)
    assert kill < verbs.index("instance stop") == len(verbs) - 1
    await rt.stop()  # idempotent: no new command
    assert fake_apptainer.verbs() == verbs
    with pytest.raises(SandboxStateError):
        await rt.exec("true")


async def test_files_round_trip(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    blob = os.urandom(3 * 1024 * 1024) + bytes(range(256))
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.bin").write_bytes(blob)
    async with runtime(tmp_path) as rt:
        await rt.upload(blob, "/workspace/deep/blob.bin")
        await rt.upload(tree, "/workspace/tree")
        host_file = tmp_path / "host.txt"
        host_file.write_text("from a host file")
        await rt.upload(host_file, "rel.txt")  # relative to the workdir
        await rt.download("/workspace/deep/blob.bin", tmp_path / "out" / "blob.bin")
        await rt.download("/workspace/tree", tmp_path / "out" / "tree")
        await rt.download("/workspace/rel.txt", tmp_path / "out" / "rel.txt")
        with pytest.raises(SandboxStateError, match="download"):
            await rt.download("/workspace/missing", tmp_path / "out" / "missing")
    assert (tmp_path / "out" / "blob.bin").read_bytes() == blob
    assert (tmp_path / "out" / "tree" / "a.txt").read_text() == "a"
    assert (tmp_path / "out" / "tree" / "sub" / "b.bin").read_bytes() == blob
    assert (tmp_path / "out" / "rel.txt").read_text() == "from a host file"
    assert list((tmp_path / "session" / ".polar_gym").glob("xfer/*")) == []


async def test_missing_binary_is_unavailable_with_a_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    rt = runtime(tmp_path)
    with pytest.raises(SandboxUnavailable, match="module load apptainer"):
        async with rt:
            pass


async def test_broken_binary_is_unavailable(tmp_path: Path, fake_apptainer: FakeApptainer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_APPTAINER_BROKEN", "1")
    with pytest.raises(SandboxUnavailable, match="--version` failed"):
        await runtime(tmp_path).start()


async def test_start_failure_reports_stderr_and_cleans_up(tmp_path: Path, fake_apptainer: FakeApptainer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_START_FAIL", "1")
    rt = runtime(tmp_path)
    with pytest.raises(SandboxStartError, match=r"fake failure starting /images/task\.sif") as info:
        async with rt:
            pass
    assert "exit 255" in str(info.value)
    assert not (tmp_path / "session" / "overlay").exists()
    assert fake_apptainer.instances() == []


async def test_instance_dying_at_start_is_a_start_error(tmp_path: Path, fake_apptainer: FakeApptainer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_START_DIES", "1")
    with pytest.raises(SandboxStartError, match="exited right after starting"):
        async with runtime(tmp_path):
            pass


async def test_crashed_instance_is_reported_not_hung(tmp_path: Path, fake_apptainer: FakeApptainer) -> None:
    async with runtime(tmp_path) as rt:
        out: list[bytes] = []
        running = asyncio.create_task(rt.exec("echo before; sleep 60", on_stdout=out.append))
        await until(lambda: out, what="the command to run")
        fake_apptainer.kill_instance(rt.instance)
        during = await asyncio.wait_for(running, BOUND)
        assert during.status is ExecStatus.CRASHED and during.stdout == b"before\n"
        assert "is gone" in (during.reason or "")
        after = await rt.exec("echo hi")
        assert after.status is ExecStatus.CRASHED
        assert not await rt.alive()
    # stop after a crash: no error, nothing left
    assert fake_apptainer.instances() == []


async def test_exit_255_from_a_live_instance_is_just_a_failure(tmp_path: Path,
                                                               fake_apptainer: FakeApptainer) -> None:
    async with runtime(tmp_path) as rt:
        result = await rt.exec("exit 255")
    assert result.status is ExecStatus.FAILED and result.exit_code == 255


async def test_failed_graceful_stop_is_forced(tmp_path: Path, fake_apptainer: FakeApptainer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(tmp_path)
    await rt.start()
    monkeypatch.setenv("FAKE_STOP_FAIL", "1")
    await rt.stop()
    stops = [c for c in fake_apptainer.calls() if "stop" in c]
    assert stops == [["--quiet", "instance", "stop", "-t", "10", rt.instance],
                     ["--quiet", "instance", "stop", "--force", rt.instance]]
    assert fake_apptainer.instances() == []


async def test_apptainer_name_only_uses_the_thin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake(tmp_path / "fake2", names=("apptainer",))
    monkeypatch.setenv("PATH", f"{fake.bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("FAKE_APPTAINER_STATE", str(fake.state))
    rt = runtime(tmp_path, overlay="image", overlay_size_mb=16)
    async with rt:
        assert rt.binary == str(fake.bin_dir / "apptainer")
        assert (tmp_path / "session" / "overlay.img").stat().st_size == 16 * 1024 * 1024
        assert (await rt.exec("true")).ok
    calls = fake.calls()
    assert calls[1] == ["overlay", "create", "--fakeroot", "--sparse", "--size", "16",
                        str(tmp_path / "session" / "overlay.img")]
    assert ["instance", "list", "--json", rt.instance] in calls
    assert calls[-1] == ["--quiet", "instance", "stop", "-t", "10", rt.instance]
    assert not (tmp_path / "session" / "overlay.img").exists()


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from the gateway"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway_server() -> Iterator[GatewayEndpoint]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield GatewayEndpoint("127.0.0.1", server.server_address[1])
    server.shutdown()
    server.server_close()


async def test_gateway_mode_relays_to_the_gateway(tmp_path: Path, fake_apptainer: FakeApptainer,
                                                  gateway_server: GatewayEndpoint) -> None:
    """The fake runs the relay helper on the host, so this needs the inner port free here."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", GATEWAY_INNER_PORT))
        except OSError:
            pytest.skip(f"port {GATEWAY_INNER_PORT} is busy on this host (the fake has no network namespace)")
    spec = RuntimeSpec(backend="apptainer", image="/images/task.sif", network="gateway")
    rt = ApptainerRuntime(spec, tmp_path / "session", gateway=gateway_server)
    assert rt.gateway_url == f"http://127.0.0.1:{GATEWAY_INNER_PORT}"
    async with rt:
        code = f"import urllib.request; print(urllib.request.urlopen('{rt.gateway_url}/x', timeout=10).read())"
        result = await rt.exec(["python3", "-c", code])
        assert result.ok, result.stderr
        assert b"hello from the gateway" in result.stdout
    start = next(c for c in fake_apptainer.calls() if c[:2] == ["instance", "start"])
    assert any(a.endswith(":/polar/.bin/relay:ro") for a in start)
    assert not (tmp_path / "session" / "gateway.sock").exists()


async def test_gateway_mode_without_an_endpoint_fails_to_start(tmp_path: Path,
                                                               fake_apptainer: FakeApptainer) -> None:
    with pytest.raises(SandboxStartError, match="gateway endpoint"):
        async with runtime(tmp_path, network="gateway"):
            pass
