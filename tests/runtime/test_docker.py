"""The docker backend: golden command lines for every operation, error mapping through fake CLIs (real scripts,
not mocks), and podman checks the shared conformance suite does not make (limits as the engine sees them, the
in-container kill scripts, crashes, labels, cp edge cases)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.runtime.docker import (
    EXEC_WRAPPER,
    KEEPALIVE,
    KILL_SCRIPT,
    LABEL,
    DockerCommands,
    DockerRuntime,
    cli_env,
    container_name,
    session_id_for,
)
from polar_gym.runtime.docker_commands import env_file_text
from polar_gym.runtime.docker_files import unpack_download
from polar_gym.runtime.errors import (
    RuntimeOptionError,
    SandboxEnvError,
    SandboxError,
    SandboxStartError,
    SandboxStateError,
    SandboxUnavailable,
)
from polar_gym.runtime.podman_host import default_cli
from polar_gym.runtime.testimage import (
    TEST_IMAGE,
    ensure_test_image,
    find_static_busybox,
    import_argv,
    is_static_elf,
    rootfs_entries,
    write_rootfs_tar,
)
from polar_gym.schema import RuntimeSpec
from tests._waiting import until, until_sync
from tests.runtime._docker import PODMAN_CLI, direct_run_args, leftover_containers, make_docker, require_podman

PODMAN = DockerCommands(cli=("podman", "--runtime", "runc"), run_args=("--ulimit", "nofile=1024:1024"))
INIT = ["-c", KEEPALIVE, "polar-init", "/polar/.polar-docker/ready"]  # then the workdir


# -- golden command lines -----------------------------------------------------------------------------------------

def test_run_minimal() -> None:
    argv = DockerCommands().run(name="polar-s1", session_id="s1", image="img:1", session_dir=Path("/srv/s1"),
                                workdir="/workspace")
    assert argv == ["docker", "run", "-d", "--name", "polar-s1", "--label", "polar_gym.session=s1",
                    "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "-v", "/srv/s1:/polar", "--network", "none",
                    "--entrypoint", "/bin/sh", "img:1", *INIT, "/workspace"]


def test_run_everything() -> None:
    argv = PODMAN.run(name="polar-s1", session_id="s1", image="img:1", session_dir=Path("/srv/s1"), workdir="/w",
                      env_file="/tmp/polar-docker-x/env-1", network="host", cpus=1.5, memory_mb=512,
                      max_processes=64)
    assert argv == ["podman", "--runtime", "runc", "run", "-d", "--name", "polar-s1",
                    "--label", "polar_gym.session=s1", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "-v", "/srv/s1:/polar", "--network", "host",
                    "--env-file", "/tmp/polar-docker-x/env-1", "--cpus", "1.5", "--memory", "512m",
                    "--pids-limit", "64",
                    "--entrypoint", "/bin/sh", "--ulimit", "nofile=1024:1024", "img:1", *INIT, "/w"]


def test_run_with_a_lease_passes_it_to_pid_1() -> None:
    argv = DockerCommands().run(name="polar-s1", session_id="s1", image="img:1", session_dir=Path("/srv/s1"),
                                workdir="/w", lease=(Path("/tmp/polar-lease-x"), 10.0, 3))
    assert argv[-8:] == [*INIT, "/w", "/run/polar-lease/lease", "10", "3"]
    # the gateway's own directory, read-only inside: the agent can neither forge the lease nor plant a link in it
    assert argv[argv.index("/tmp/polar-lease-x:/run/polar-lease:ro") - 1] == "-v"


def test_run_gateway_makes_the_relay_the_entrypoint() -> None:
    argv = DockerCommands().run(name="polar-s1", session_id="s1", image="img:1", session_dir=Path("/srv/s1"),
                                workdir="/workspace", network="gateway", relay=Path("/cache/relay"),
                                max_connections=64)
    assert argv == ["docker", "run", "-d", "--name", "polar-s1", "--label", "polar_gym.session=s1",
                    "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "-v", "/srv/s1:/polar", "--network", "none",
                    "-v", "/cache/relay:/polar/.bin/relay:ro", "--entrypoint", "/polar/.bin/relay", "img:1",
                    "-l", "18080", "-u", "/polar/gateway.sock", "-k", "64", "--", "/bin/sh", *INIT, "/workspace"]


def test_exec() -> None:
    assert DockerCommands().exec("polar-s1", ["ls", "-l"], marker="/polar/.polar-docker/exec/t") == [
        "docker", "exec", "-i", "polar-s1", "/bin/sh", "-c", EXEC_WRAPPER, "polar-exec",
        "/polar/.polar-docker/exec/t", "ls", "-l"]
    assert PODMAN.exec("c", ["true"], marker="/m", env_file="/p/env-2", cwd="/tmp") == [
        "podman", "--runtime", "runc", "exec", "-i", "--env-file", "/p/env-2", "-w", "/tmp", "c", "/bin/sh", "-c",
        EXEC_WRAPPER, "polar-exec", "/m", "true"]


def test_the_cli_environment_is_ours_and_a_sandboxs_values_go_in_an_env_file() -> None:
    """Issue 35: a sandbox's variables (a session key, a task's LD_PRELOAD) are neither on the CLI's command line
    nor in its environment; the CLI keeps the gateway's engine settings and nothing a loader reads."""
    gateway = {"PATH": "/usr/bin", "HOME": "/root", "XDG_RUNTIME_DIR": "/run/user/0", "CONTAINERS_CONF": "/c.conf",
               "DOCKER_HOST": "unix:///d.sock", "LD_PRELOAD": "/x.so", "OPENAI_API_KEY": "sk-gateway", "TERM": "x"}
    assert cli_env(gateway) == {"PATH": "/usr/bin", "HOME": "/root", "XDG_RUNTIME_DIR": "/run/user/0",
                                "CONTAINERS_CONF": "/c.conf", "DOCKER_HOST": "unix:///d.sock", "LANG": "C.UTF-8"}
    assert env_file_text({"OPENAI_API_KEY": "sk-secret", "HOME": "/polar/home", "E": "", "Q": " a=b #c 'd' "}) == (
        "OPENAI_API_KEY=sk-secret\nHOME=/polar/home\nE=\nQ= a=b #c 'd' \n")


@pytest.mark.parametrize(("env", "match"), [
    ({"K": "a\nb"}, "'K' holds a newline"), ({"K": "a\rb"}, "'K' holds a newline"),
    ({"A B": "1"}, "'A B' cannot be passed"), ({"#K": "1"}, "'#K' cannot be passed"), ({"": "1"}, "'' cannot"),
    ({"K": "x" * 65534}, "'K' is longer than"),
])
def test_an_env_file_refuses_what_it_cannot_carry(env: dict[str, str], match: str) -> None:
    with pytest.raises(SandboxEnvError, match=match):
        env_file_text(env)
    assert env_file_text({"K": "x" * 65533}).endswith("x\n")  # 65535 bytes with "K=": the longest line


def test_kill_copy_inspect_list_remove() -> None:
    c = DockerCommands(shell="/bin/bash")
    assert c.kill_tree("c", 42) == ["docker", "exec", "c", "/bin/bash", "-c", KILL_SCRIPT, "polar-kill", "tree", "42"]
    assert c.kill_all("c") == ["docker", "exec", "c", "/bin/bash", "-c", KILL_SCRIPT, "polar-kill", "all", "0"]
    assert c.copy_in("c") == ["docker", "cp", "-", "c:/"]
    assert c.copy_out("c", "/a b/x") == ["docker", "cp", "c:/a b/x", "-"]
    assert c.logs("c") == ["docker", "logs", "c"]
    assert c.is_running("c") == ["docker", "inspect", "-f", "{{.State.Running}}", "c"]
    assert c.list_session("s1") == ["docker", "ps", "-a", "-q", "--filter", "label=polar_gym.session=s1"]
    assert c.remove(["c", "abc123"]) == ["docker", "rm", "-f", "c", "abc123"]
    assert c.restart("c") == ["docker", "restart", "-t", "0", "c"]


def test_cli_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_DOCKER_CLI", "podman --runtime runc")
    monkeypatch.setenv("POLAR_DOCKER_RUN_ARGS", "--ulimit nofile=1024:1024")
    assert DockerRuntime(RuntimeSpec(), tmp_path).commands == PODMAN
    options = {"cli": ["docker"], "run_args": []}
    assert DockerRuntime(RuntimeSpec(), tmp_path, options=options).commands.cli == ("docker",)  # options win


def test_options_names_and_addresses(tmp_path: Path) -> None:
    spec = RuntimeSpec(backend="docker", image="i", options={"shell": "/bin/ash"})  # a request may set the shell
    rt = DockerRuntime(spec, tmp_path / "sess", options={"session_id": "task 7/sample 2", "cli": "podman",
                                                          "run_args": ["--pull", "never"]})
    assert rt.commands == DockerCommands(cli=("podman",), run_args=("--pull", "never"), shell="/bin/ash")
    assert rt.session_id == "task-7-sample-2" and rt.container == "polar-task-7-sample-2"
    assert DockerRuntime(RuntimeSpec(), tmp_path).commands.cli == default_cli()  # podman (runc) here, else docker
    a, b = session_id_for(tmp_path / "a" / "s", {}), session_id_for(tmp_path / "b" / "s", {})
    assert a.startswith("s-") and a != b  # same directory name, different sessions
    assert container_name("x") == "polar-x"


def test_fault3_host_command_lines_cannot_come_from_the_spec(tmp_path: Path) -> None:
    for key, value in (("cli", ["sh", "-c", "id > /tmp/proof"]), ("run_args", ["-v", "/:/host"]),
                       ("session_id", "another-session")):
        with pytest.raises(RuntimeOptionError, match=repr(key)):
            DockerRuntime(RuntimeSpec(backend="docker", image="i", options={key: value}), tmp_path)


def test_testimage_recipe(tmp_path: Path) -> None:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"binary")
    entries = rootfs_entries(busybox, ["sh", "ls", "busybox", "sh"])
    by_path = {e.path: e for e in entries}
    assert by_path["bin/sh"].kind == "symlink" and by_path["bin/sh"].target == "busybox"
    assert by_path["bin/busybox"].kind == "file" and by_path["bin/busybox"].source == busybox
    assert by_path["tmp"].mode == 0o1777 and "etc/passwd" in by_path
    with tarfile.open(write_rootfs_tar(entries, tmp_path / "r.tar")) as tar:
        names = tar.getnames()
        assert tar.extractfile("bin/busybox").read() == b"binary"  # type: ignore[union-attr]
    assert names.count("bin/sh") == 1 and "bin/ls" in names
    assert import_argv(["podman"], Path("/r.tar"), "t:1")[:3] == ["podman", "import", "--change"]
    assert import_argv(["podman"], Path("/r.tar"), "t:1")[-2:] == ["/r.tar", "t:1"]
    assert not is_static_elf(busybox)
    if (found := find_static_busybox()) is not None:
        assert is_static_elf(found)


def test_download_merges_into_an_existing_directory(tmp_path: Path) -> None:
    src = tmp_path / "src" / "d"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "new.txt").write_text("new")
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        tar.add(src, arcname="d")
    dst = tmp_path / "out"
    (dst / "sub").mkdir(parents=True)
    (dst / "old.txt").write_text("old")
    unpack_download(tmp_path / "a.tar", dst)
    assert (dst / "old.txt").read_text() == "old" and (dst / "sub" / "new.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".polar")] == []


# -- errors through fake CLIs ---------------------------------------------------------------------------------------

def _fake_cli(tmp_path: Path, script: str) -> str:
    path = tmp_path / "fake-docker"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


def _rt(tmp_path: Path, cli: str, image: str | None = "img:1", network: str = "none") -> DockerRuntime:
    spec = RuntimeSpec(backend="docker", image=image, network=network)  # type: ignore[arg-type]
    return DockerRuntime(spec, tmp_path / "s", options={"cli": [cli]})


async def test_missing_cli_is_unavailable_with_a_hint(tmp_path: Path) -> None:
    rt = _rt(tmp_path, "/nonexistent/docker")
    with pytest.raises(SandboxUnavailable, match="apt-get install podman"):
        await rt.start()
    await rt.stop()


async def test_dead_daemon_is_unavailable(tmp_path: Path) -> None:
    cli = _fake_cli(tmp_path, 'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. '
                              'Is the docker daemon running?" >&2; exit 1')
    with pytest.raises(SandboxUnavailable, match="not reachable"):
        await _rt(tmp_path, cli).start()


async def test_failed_run_is_a_start_error_with_stderr_and_cleans_up(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    cli = _fake_cli(tmp_path, f'echo "$*" >> {log}; [ "$1" = run ] && {{ echo "image not known" >&2; exit 125; }}; '
                              "exit 0")
    rt = _rt(tmp_path, cli)
    async with asyncio.timeout(30):
        with pytest.raises(SandboxStartError, match="image not known"):
            async with rt:
                pass
    calls = log.read_text().splitlines()
    assert calls[0].startswith("run -d --name polar-s-")
    assert any(c.startswith("rm -f polar-s-") for c in calls)  # stop after a failed start removes it
    assert not (tmp_path / "s" / ".polar-docker").exists()


async def test_container_that_exits_at_start_is_reported(tmp_path: Path) -> None:
    cli = _fake_cli(tmp_path, 'case "$1" in inspect) echo false;; logs) echo "exec format error";; esac; exit 0')
    with pytest.raises(SandboxStartError, match="exited during start: exec format error"):
        await _rt(tmp_path, cli).start()


async def test_needs_an_image_and_a_gateway(tmp_path: Path) -> None:
    cli = _fake_cli(tmp_path, "exit 0")
    with pytest.raises(SandboxStartError, match=r"runtime\.image"):
        await _rt(tmp_path, cli, image=None).start()
    with pytest.raises(SandboxStartError, match="gateway endpoint"):
        await _rt(tmp_path, cli, network="gateway").start()


async def test_operations_need_a_running_sandbox(tmp_path: Path) -> None:
    rt = _rt(tmp_path, _fake_cli(tmp_path, "exit 0"))
    with pytest.raises(SandboxStateError):
        await rt.exec(["true"])
    with pytest.raises(SandboxStateError):
        await rt.upload(b"x", "/x")
    with pytest.raises(SandboxStateError):
        await rt.download("/x", tmp_path / "x")
    await rt.cancel()  # nothing to do, no error
    await rt.stop()
    await rt.stop()


async def test_stop_tolerates_an_already_removed_container(tmp_path: Path) -> None:
    cli = _fake_cli(tmp_path, '[ "$1" = rm ] && { echo "Error: No such container: polar-x" >&2; exit 1; }; exit 0')
    rt = _rt(tmp_path, cli)
    rt._created = True  # as after a run whose container was removed behind our back
    await rt.stop()
    cli = _fake_cli(tmp_path, '[ "$1" = rm ] && { echo "permission denied" >&2; exit 1; }; exit 0')
    rt = _rt(tmp_path, cli)
    rt._created = True
    with pytest.raises(SandboxError, match="permission denied"):
        await rt.stop()


# -- podman on this machine -----------------------------------------------------------------------------------------

@pytest.fixture
def podman() -> None:
    require_podman()


def _spec(**fields: object) -> RuntimeSpec:
    return RuntimeSpec(backend="docker", **{"network": "none", **fields})  # type: ignore[arg-type]


def _podman(*args: str) -> str:
    return subprocess.run([*PODMAN_CLI, *args], capture_output=True, text=True, check=True).stdout.strip()


async def _running(rt: DockerRuntime, command: str) -> bool:
    """Whether a process in the container runs ``command`` (what a test waits for instead of a fixed sleep)."""
    return command in (await rt.exec("ps -o args")).text


@pytest.mark.usefixtures("podman")
async def test_labels_limits_and_env_as_the_engine_sees_them(tmp_path: Path) -> None:
    spec = RuntimeSpec(backend="docker", network="none", cpus=0.5, memory_mb=64, max_processes=32,
                       env={"FOO": "bar"}, workdir="/workspace/dir")
    async with make_docker(spec, tmp_path / "s") as rt:
        assert isinstance(rt, DockerRuntime)
        got = _podman("inspect", "--format", "{{index .Config.Labels \"polar_gym.session\"}} {{.HostConfig.Memory}} "
                      "{{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}}", rt.container).split()
        assert got == [rt.session_id, str(64 * 2**20), str(5 * 10**8), "32"]
        result = await rt.exec('pwd; echo "$FOO $POLAR_SESSION_DIR"; cat /sys/fs/cgroup/pids.max '
                               "/sys/fs/cgroup/pids/pids.max 2>/dev/null")
        assert result.text.split() == ["/workspace/dir", "bar", "/polar", "32"]
        assert leftover_containers(rt.session_id)
    assert leftover_containers(rt.session_id) == []


@pytest.mark.usefixtures("podman")
async def test_no_capabilities_no_new_privileges_and_default_limits(tmp_path: Path) -> None:
    """Issue 11 for the docker backend: root in the container has no capability and cannot gain any; a spec that
    sets no limit still gets the default pids and memory limits; only the session directory is mounted (and the
    gateway's lease directory, read-only)."""
    async with make_docker(_spec(), tmp_path / "s") as rt:
        assert isinstance(rt, DockerRuntime)
        got = _podman("inspect", "--format", "{{.HostConfig.Memory}} {{.HostConfig.PidsLimit}} "
                      "{{range .Mounts}}{{.Destination}} {{end}}", rt.container).split()
        assert got[:2] == [str(1024 * 2**20), "512"] and sorted(got[2:]) == ["/polar", "/run/polar-lease"]
        result = await rt.exec("grep -E '^(CapPrm|CapEff|CapBnd|NoNewPrivs):' /proc/self/status; "
                               "mount -t tmpfs none /mnt 2>/dev/null && echo mounted")
        fields = dict(line.split(":\t") for line in result.text.splitlines())
        assert fields == {"CapPrm": "0000000000000000", "CapEff": "0000000000000000",
                          "CapBnd": "0000000000000000", "NoNewPrivs": "1"}, result.text


@pytest.mark.usefixtures("podman")
async def test_pids_limit_stops_a_fork_flood(tmp_path: Path) -> None:
    async with make_docker(_spec(max_processes=16), tmp_path / "s") as rt:
        assert isinstance(rt, DockerRuntime)
        started = _podman("inspect", "-f", "{{.State.StartedAt}}", rt.container)
        result = await rt.exec("i=0; while [ $i -lt 40 ]; do sleep 30 & i=$((i+1)); done 2>&1; echo spawned",
                               timeout=60)
        assert b"can't fork" in result.stdout + result.stderr or b"Resource temporarily" in result.stdout
        # cancel: its kill script usually cannot start inside any more and the container is restarted; when the
        # flood left a pid free it runs instead. Either way the flood is gone and the sandbox is usable again.
        await rt.cancel()
        restarted = _podman("inspect", "-f", "{{.State.StartedAt}}", rt.container) != started
        ps = (await rt.exec("ps -o args")).text
        assert "sleep 30" not in ps, (restarted, ps)
        assert (await rt.exec(["true"])).ok


@pytest.mark.usefixtures("podman")
async def test_timeout_kills_only_that_exec_and_cancel_spares_pid1(tmp_path: Path) -> None:
    async with make_docker(_spec(), tmp_path / "s") as rt:
        other = asyncio.create_task(rt.exec("sleep 4243; echo late"))
        await until(lambda: _running(rt, "sleep 4243"), what="the other exec to run")
        # the timeout leaves a loaded machine room for podman exec and the echo; only the timeout ends the sleeps
        timed = await rt.exec("echo partial; sleep 4242 & setsid sleep 4242; echo never", timeout=5)
        assert timed.status.value == "timeout" and timed.stdout == b"partial\n"
        ps = (await rt.exec("ps -o pid,args")).text
        assert "sleep 4242" not in ps and "sleep 4243" in ps  # the other exec runs on
        await rt.exec("setsid sh -c 'sleep 4244 &'")  # a daemon left behind by a finished exec
        await rt.cancel()
        assert (await other).status.value == "cancelled"
        ps = (await rt.exec("ps -o pid,args")).text
        assert "4243" not in ps and "4244" not in ps
        assert re.search(r"^\s*1 .*polar-init", ps, re.M)  # PID 1 survived


@pytest.mark.usefixtures("podman")
async def test_crashed_container_is_reported_not_hung(tmp_path: Path) -> None:
    async with make_docker(_spec(), tmp_path / "s") as rt:
        assert isinstance(rt, DockerRuntime)
        running = asyncio.create_task(rt.exec("sleep 600"))
        await until(lambda: _running(rt, "sleep 600"), what="the exec to run")
        _podman("kill", rt.container)
        async with asyncio.timeout(30):
            result = await running
        assert result.status.value == "crashed" and "died" in (result.reason or "")
        with pytest.raises(SandboxStateError):
            await rt.exec(["true"])
    assert leftover_containers(rt.session_id) == []


@pytest.mark.usefixtures("podman")
async def test_exec_that_cannot_start_is_crashed(tmp_path: Path) -> None:
    async with make_docker(_spec(), tmp_path / "s") as rt:
        result = await rt.exec(["true"], cwd="/does/not/exist")
        assert result.status.value == "crashed" and "chdir" in (result.reason or "")
        missing = await rt.exec(["no-such-command"])
        assert missing.status.value == "failed" and missing.exit_code == 127


@pytest.mark.usefixtures("podman")
async def test_large_streams_in_and_out(tmp_path: Path) -> None:
    data = os.urandom(8 * 2**20)
    async with make_docker(_spec(), tmp_path / "s") as rt:
        chunks: list[bytes] = []
        result = await rt.exec("cat", stdin=data, on_stdout=chunks.append)
        assert result.ok and result.stdout == data == b"".join(chunks) and len(chunks) > 1


@pytest.mark.usefixtures("podman")
async def test_stop_removes_every_container_of_the_session(tmp_path: Path) -> None:
    rt = make_docker(_spec(), tmp_path / "s")
    await rt.start()
    _podman("run", "-d", *direct_run_args(), "--stop-timeout", "0", "--label", f"{LABEL}={rt.session_id}",
            TEST_IMAGE, "sleep", "600")
    assert len(leftover_containers(rt.session_id)) == 2
    await rt.stop()
    await rt.stop()
    assert leftover_containers(rt.session_id) == []
    assert not (tmp_path / "s" / ".polar-docker").exists()


@pytest.mark.usefixtures("podman")
async def test_bad_image_is_a_start_error_and_leaves_nothing(tmp_path: Path) -> None:
    rt = make_docker(_spec(image="localhost/polar-no-such-image:0"), tmp_path / "s")
    with pytest.raises(SandboxStartError, match="podman run failed"):
        async with rt:
            pass
    assert leftover_containers(rt.session_id) == []


@pytest.mark.usefixtures("podman")
async def test_cp_edge_cases(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "bin").write_bytes(bytes(range(256)) * 64)
    (tree / "link").symlink_to("a/b/bin")
    (tree / "exe").write_text("#!/bin/sh\necho ran\n")
    (tree / "exe").chmod(0o755)
    async with make_docker(_spec(), tmp_path / "s") as rt:
        await rt.upload(tree, "rel/tree")  # relative to the workdir, parents created
        result = await rt.exec("./rel/tree/exe; readlink rel/tree/link; stat -c %u rel/tree/exe")
        assert result.text.split() == ["ran", "a/b/bin", "0"]
        await rt.upload(b"one", "/tmp/f")
        await rt.upload(b"two", "/tmp/f")  # overwrite
        await rt.download("/tmp/f", tmp_path / "f")
        assert (tmp_path / "f").read_bytes() == b"two"
        await rt.download("/workspace/rel/tree", tmp_path / "back")
        assert (tmp_path / "back" / "a" / "b" / "bin").read_bytes() == bytes(range(256)) * 64
        assert os.readlink(tmp_path / "back" / "link") == "a/b/bin"
        with pytest.raises(FileNotFoundError):
            await rt.download("/nope", tmp_path / "nope")
        with pytest.raises(FileNotFoundError):
            await rt.upload(tmp_path / "nope", "/x")


@pytest.mark.usefixtures("podman")
async def test_gateway_relay_survives_cancel(tmp_path: Path) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        spec = RuntimeSpec(backend="docker", network="gateway")
        async with make_docker(spec, tmp_path / "s", GatewayEndpoint("127.0.0.1", port)) as rt:
            fetch = f'wget -q -O - "$POLAR_GATEWAY_URL/x"; echo; wget -q -O - http://127.0.0.1:{port}/ || echo no'
            assert (await rt.exec(fetch)).text.split() == ["ok", "no"]
            await rt.cancel()
            assert (await rt.exec(fetch)).text.split() == ["ok", "no"]
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.usefixtures("podman")
def test_test_image_is_built_once_from_a_rootfs() -> None:
    tag = f"localhost/polar-test-busybox:pytest-{os.getpid()}"
    try:
        assert ensure_test_image(PODMAN_CLI, tag) == tag
        created = _podman("image", "inspect", "--format", "{{.Id}}", tag)
        assert ensure_test_image(PODMAN_CLI, tag) == tag  # idempotent: the same image, not a new import
        assert _podman("image", "inspect", "--format", "{{.Id}}", tag) == created
        run = _podman("run", "--rm", *direct_run_args(), "--network", "none", tag, "sh", "-c",
                      "ls -ld /tmp | cut -c1-10; whoami; echo $PATH")
        assert run.split() == ["drwxrwxrwt", "root", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    finally:
        subprocess.run([*PODMAN_CLI, "rmi", "-f", tag], capture_output=True)


_OWNER = """
import asyncio, sys
from pathlib import Path
from polar_gym.runtime.docker import DockerRuntime
from polar_gym.schema import RuntimeSpec
from tests.runtime._docker import podman_options
from polar_gym.runtime.testimage import TEST_IMAGE

async def main(session_dir):
    options = {**podman_options(), "lease_seconds": 3}
    rt = DockerRuntime(RuntimeSpec(image=TEST_IMAGE, network="none"), Path(session_dir), options=options)
    await rt.start()
    print(rt.container, rt._lease.directory, flush=True)
    await rt.exec("sleep 600")

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.usefixtures("podman")
def test_a_container_outlives_no_sigkilled_gateway(tmp_path: Path) -> None:
    """A detached container does not die with the process that ran it: PID 1 ends it once the lease the gateway
    rewrites stops changing (3 s here), and not while it changes."""
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    session = tmp_path / "s"
    session.mkdir()
    owner = subprocess.Popen([sys.executable, str(script), str(session)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    container = ""
    try:
        assert owner.stdout is not None
        container, _, lease_dir = owner.stdout.readline().strip().partition(" ")
        assert container and lease_dir, "the owner did not start its container"
        lease = Path(lease_dir) / "lease"
        # alive through two whole lease periods (PID 1 looks every second and gives up after 3 unchanged looks)
        until_sync(lambda: lease.is_file() and int(lease.read_text() or 0) >= 12, what="12 lease renewals")
        assert _container_running(container)
        owner.kill()
        owner.wait()
        until_sync(lambda: not _container_running(container), what="the orphaned container to stop")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
        if container:
            subprocess.run([*PODMAN_CLI, "rm", "-f", container], capture_output=True, timeout=120)


def _container_running(name: str) -> bool:
    done = subprocess.run([*PODMAN_CLI, "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True,
                          timeout=60)
    return done.returncode == 0 and done.stdout.strip() == "true"


@pytest.mark.usefixtures("podman")
async def test_the_agent_can_neither_forge_the_lease_nor_plant_a_link_in_it(tmp_path: Path) -> None:
    """The lease lives in the gateway's own directory, read-only inside: in the session directory an agent could
    keep its container alive past its gateway, or plant a symlink where a root gateway writes next."""
    async with make_docker(_spec(), tmp_path / "s") as rt:
        assert isinstance(rt, DockerRuntime) and rt._lease is not None
        host = rt._lease.directory
        forged = await rt.exec("echo 999999 > /run/polar-lease/lease || echo refused; "
                               "ln -s /etc/passwd /run/polar-lease/.lease.5 || echo refused too")
        assert "refused" in forged.text and "refused too" in forged.text, forged
        assert not (host / ".lease.5").exists() and (host / "lease").read_text().strip() != "999999"
        assert not (tmp_path / "s" / ".polar-docker" / "lease").exists()
    assert not host.exists()  # released with the sandbox
