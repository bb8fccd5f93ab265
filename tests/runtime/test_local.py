"""The local (bubblewrap) backend beyond the conformance suite: golden command lines, the relay on its own (C and
Python), an unpacked image as root, bwrap failures, and the command line's clean-up on signals."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import polar_gym.runtime as runtime_pkg
from polar_gym.runtime import bwrap as bwrap_mod
from polar_gym.runtime import limits as limits_mod
from polar_gym.runtime import local as local_mod
from polar_gym.runtime import loopback as loopback_mod
from polar_gym.runtime import relay as relay_mod
from polar_gym.runtime.base import RELAY_PATH, ExecStatus
from polar_gym.runtime.bwrap import (
    Launch,
    Mask,
    RootEntry,
    SandboxLayout,
    WorkdirError,
    bwrap_argv,
    cgroup_wrap,
    env_args,
    launcher_argv,
    plan_workdir,
    sandbox_env,
)
from polar_gym.runtime.errors import SandboxError, SandboxStartError
from polar_gym.runtime.local import LocalRuntime, confine
from polar_gym.runtime.loopback import LoopbackAllocator
from polar_gym.runtime.relay import build_relay, helper_argv
from polar_gym.schema import RuntimeSpec
from tests._waiting import BOUND
from tests.runtime._runtime_kit import processes_with

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

ROOT = Path(__file__).parents[2]
ENTRIES = (RootEntry("bin", "symlink", "usr/bin"), RootEntry("etc", "dir"), RootEntry("usr", "dir"))


def test_exports() -> None:
    for module in (runtime_pkg, bwrap_mod, local_mod, relay_mod, limits_mod):
        assert all(hasattr(module, name) for name in module.__all__)
    assert RELAY_PATH == "/polar/.bin/relay"


def test_bwrap_argv_golden() -> None:
    layout = SandboxLayout(root="/", entries=ENTRIES, session_dir="/s", workdir="/workspace",
                           workdir_host="/s/workspace", network="gateway", relay="/cache/relay",
                           masks=(Mask("/etc/shadow", "file"), Mask("/etc/ssl/private", "dir")),
                           extra_ro=(("/h/npm", "/h/npm"),), launch=Launch(helper="/cache/relay", stage="/media",
                                                                            uid=65534, gid=65534),
                           root_inside=True)
    assert bwrap_argv(layout, ["sh", "-c", "x"], cwd="/workspace/sub", status_fd=3, bwrap="/usr/bin/bwrap") == [
        "/usr/bin/bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--unshare-net", "--die-with-parent", "--new-session", "--hostname", "polar", "--cap-drop", "ALL",
        "--disable-userns", "--uid", "0", "--gid", "0",
        "--symlink", "usr/bin", "/bin", "--ro-bind", "/etc", "/etc", "--ro-bind", "/usr", "/usr",
        "--ro-bind", "/media/empty", "/etc/shadow", "--tmpfs", "/etc/ssl/private", "--remount-ro", "/etc/ssl/private",
        "--dev", "/dev", "--size", str(64 * 1024 * 1024), "--tmpfs", "/dev/shm", "--proc", "/proc",
        "--ro-bind-try", "/sys", "/sys", "--dir", "/var", "--symlink", "../tmp", "/var/tmp",
        "--bind", "/media/1", "/tmp", "--bind", "/media/0", "/polar", "--bind", "/media/2", "/workspace",
        "--ro-bind", "/media/3/relay", "/polar/.bin/relay", "--ro-bind", "/media/4", "/h/npm",
        "--remount-ro", "/", "--chdir", "/workspace/sub", "--json-status-fd", "3", "--", "sh", "-c", "x"]
    assert launcher_argv(layout, ["bwrap", "x"], watchdog_for=42) == [
        "/cache/relay", "-S", "/media", "-B", "/s", "-B", "/s/tmp", "-B", "/s/workspace", "-B", "/cache",
        "-B", "/h/npm", "-U", "65534", "-G", "65534", "-W", "42", "--", "bwrap", "x"]


def test_without_a_compiled_helper_bwrap_runs_directly() -> None:
    layout = SandboxLayout(root="/", entries=ENTRIES, session_dir="/s", workdir="/polar/w", workdir_host=None,
                           network="none", masks=(Mask("/etc/shadow", "file"),), launch=Launch(cgroup_procs=("/c",)))
    argv = bwrap_argv(layout, ["true"], cwd="/polar/w")
    assert argv[argv.index("/etc/shadow") - 1] == "/dev/null" and "--uid" not in argv
    assert argv[argv.index("/polar") - 1] == "/s" and launcher_argv(layout, argv) == argv
    assert cgroup_wrap(["/c"], ["bwrap"])[-3:] == ["/c", "--", "bwrap"]


def test_secret_masks_cover_what_others_cannot_read(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "ssl" / "private").mkdir(parents=True)
    (etc / "ssl" / "private").chmod(0o700)
    (etc / "shadow").write_text("root:x")
    (etc / "shadow").chmod(0o640)
    (etc / "hosts").write_text("127.0.0.1 localhost")
    (etc / "munge").mkdir()
    (etc / "munge" / "munge.key").write_text("k")
    (etc / "munge" / "munge.key").chmod(0o400)
    masks = bwrap_mod.secret_masks.__wrapped__(str(etc))
    assert masks == (Mask(str(etc / "munge" / "munge.key"), "file"), Mask(str(etc / "shadow"), "file"),
                     Mask(str(etc / "ssl" / "private"), "dir"))


def test_bwrap_argv_host_network_and_image_root() -> None:
    layout = SandboxLayout(root="/img", entries=ENTRIES[1:], session_dir="/s", workdir="/polar/work",
                           workdir_host=None, network="host")
    argv = bwrap_argv(layout, ["true"], cwd="/polar/work")
    assert "--unshare-net" not in argv
    assert argv[argv.index("--ro-bind") + 1: argv.index("--ro-bind") + 3] == ["/img/etc", "/etc"]
    assert "/workspace" not in argv and RELAY_PATH not in argv


def test_helper_argv_golden() -> None:
    assert helper_argv("/polar/.bin/relay", ["sh", "-c", "x"], gateway=True, nproc=16, data_bytes=1024,
                       file_bytes=2048, max_connections=8, cpus=[0, 1]) == [
        "/polar/.bin/relay", "-n", "16", "-m", "1024", "-f", "2048", "-c", "0,1", "-l", "18080",
        "-u", "/polar/gateway.sock", "-k", "8", "--", "sh", "-c", "x"]
    assert helper_argv("r", ["true"]) == ["r", "--", "true"]


def test_sandbox_env_starts_from_nothing() -> None:
    env = sandbox_env({"A": "spec", "B": "spec"}, {"B": "exec"}, loopback_ip="127.77.0.9", gateway_url="http://g")
    assert env == {"PATH": bwrap_mod.DEFAULT_PATH, "HOME": "/polar/home", "LANG": "C.UTF-8", "TERM": "dumb",
                   "POLAR_SESSION_DIR": "/polar", "POLAR_LOOPBACK_IP": "127.77.0.9", "POLAR_GATEWAY_URL": "http://g",
                   "A": "spec", "B": "exec"}


def test_the_commands_env_goes_through_bwraps_args_fd_not_its_command_line() -> None:
    """Issue 35: ``--args FD`` first, then ``--clearenv`` and one ``--setenv`` per variable in the fd's NUL-separated
    text (any byte but NUL, a newline included); nothing of it on bwrap's command line."""
    assert env_args({"K": "a\nb", "E": ""}) == b"--clearenv\0--setenv\0K\0a\nb\0--setenv\0E\0\0"
    for bad in ({"K": "a\0b"}, {"A=B": "1"}, {"": "1"}):
        with pytest.raises(ValueError, match="cannot be set"):
            env_args(bad)
    layout = SandboxLayout(root="/", entries=(), session_dir="/s", workdir="/polar", workdir_host=None,
                           network="none")
    assert bwrap_argv(layout, ["true"], cwd="/polar", args_fd=7)[:4] == ["bwrap", "--args", "7", "--unshare-user"]
    assert "--args" not in bwrap_argv(layout, ["true"], cwd="/polar")


def test_plan_workdir(tmp_path: Path) -> None:
    (tmp_path / "etc" / "exists").mkdir(parents=True)
    assert plan_workdir("/workspace", ENTRIES, tmp_path, "/s") == "/s/workspace"
    assert plan_workdir("/polar/w", ENTRIES, tmp_path, "/s") is None
    assert plan_workdir("/etc/exists", ENTRIES, tmp_path, "/s") == "/s/workspace"
    for bad in ("/etc/missing", "relative", "/"):
        with pytest.raises(WorkdirError):
            plan_workdir(bad, ENTRIES, tmp_path, "/s")


def test_confine(tmp_path: Path) -> None:
    areas = [("/workspace", str(tmp_path / "w")), ("/polar", str(tmp_path))]
    (tmp_path / "w").mkdir()
    assert confine(areas, "a/b", "/workspace") == tmp_path / "w" / "a" / "b"
    assert confine(areas, "/polar/x", "/workspace") == tmp_path / "x"
    assert confine(areas, "/polar", "/workspace") == tmp_path
    os.symlink("/etc", tmp_path / "w" / "out")
    for bad in ("/etc/passwd", "../../etc", "out/passwd"):
        with pytest.raises(SandboxError):
            confine(areas, bad, "/workspace")


def test_loopback_allocator_hands_out_distinct_addresses(tmp_path: Path) -> None:
    alloc = LoopbackAllocator(tmp_path)
    held = [alloc.acquire() for _ in range(20)]
    assert len({ip for ip, _ in held}) == 20 and all(ip.startswith("127.77.") for ip, _ in held)
    for _, handle in held:
        LoopbackAllocator.release(handle)


def test_build_relay_is_keyed_by_source(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    path = build_relay(tmp_path)
    assert path.parent.name.startswith("relay-") and os.access(path, os.X_OK)
    assert build_relay(tmp_path) == path


def test_build_relay_stops_at_the_first_compiler_that_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The later compilers are fallbacks: a later one overwrote gcc's build with its own (a musl binary whose error
    texts differ from glibc's) on every machine that had both."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    called = tmp_path / "second-compiler-ran"
    second = tmp_path / "cc2"
    second.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    second.chmod(0o755)
    monkeypatch.setattr(relay_mod, "relay_compilers", lambda: [[shutil.which("gcc")], [str(second)]])
    path = build_relay(tmp_path / "cache")
    assert os.access(path, os.X_OK) and not called.exists()


# -- the relay on its own -----------------------------------------------------------------------------------------


def _relay_programs() -> list[str]:
    programs = [str(relay_mod.RELAY_FALLBACK)]
    if shutil.which("gcc"):
        programs.insert(0, str(build_relay()))
    return programs


@pytest.mark.parametrize("program", _relay_programs(), ids=lambda p: Path(p).name)
async def test_relay_many_connections_and_half_close(program: str, tmp_path: Path) -> None:
    """Many concurrent clients each send 200 KB then half-close; the Unix-side server answers after EOF.

    At 100 connections the Python fallback used to lose a few (one run in two on a busy machine): asyncio holds a
    half-closed client's task only weakly, and a garbage collection closed it before the answer came."""
    clients = 100
    sock_path = str(tmp_path / "u.sock")

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # until the client's half-close arrives
        writer.write(b"len=%d;" % len(data) + data[-16:])
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(upstream, sock_path)
    import socket as socket_mod

    with socket_mod.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        program, "-l", str(port), "-u", sock_path, "--", "sleep", "60", start_new_session=True)
    try:
        async def client(i: int) -> bytes:
            end = asyncio.get_running_loop().time() + BOUND  # until the relay listens
            while True:
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                except OSError:
                    assert asyncio.get_running_loop().time() < end, "the relay never listened"
                    await asyncio.sleep(0.05)
            payload = bytes([i % 256]) * 200_000
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            answer = await reader.read()
            writer.close()
            return answer

        answers = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients))), 60)
        assert answers == [b"len=200000;" + bytes([i % 256]) * 16 for i in range(clients)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and the relay it forked share the process group
        await proc.wait()
        server.close()


# -- the backend --------------------------------------------------------------------------------------------------


async def test_unpacked_image_directory_as_root(tmp_path: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("needs a busybox binary for the image")
    image = tmp_path / "rootfs"
    (image / "bin").mkdir(parents=True)
    shutil.copy(busybox, image / "bin" / "busybox")
    os.symlink("busybox", image / "bin" / "sh")
    (image / "etc").mkdir()
    (image / "etc" / "os-release").write_text("ID=polar-test\n")
    (tmp_path / "s").mkdir()
    async with LocalRuntime(RuntimeSpec(image=str(image), network="none"), tmp_path / "s") as rt:
        result = await rt.exec("cat /etc/os-release; busybox ls /")
        assert result.ok, result
        lines = result.stdout.decode().split()
        assert lines[0] == "ID=polar-test"
        assert "usr" not in lines and {"bin", "etc", "polar", "tmp", "workspace"} <= set(lines)
        assert (await rt.exec("busybox touch /etc/x")).status is ExecStatus.FAILED


async def test_bad_image_and_bad_workdir_are_start_errors(tmp_path: Path) -> None:
    with pytest.raises(SandboxStartError):
        await LocalRuntime(RuntimeSpec(image=str(tmp_path / "nope"), network="none"), tmp_path).start()
    with pytest.raises(SandboxStartError):
        await LocalRuntime(RuntimeSpec(workdir="/etc/not-there", network="none"), tmp_path).start()
    with pytest.raises(SandboxStartError):
        await LocalRuntime(RuntimeSpec(network="gateway"), tmp_path).start()


async def test_a_bwrap_failure_is_crashed_with_the_reason(tmp_path: Path) -> None:
    spec = RuntimeSpec(network="none")
    async with LocalRuntime(spec, tmp_path, options={"ro_binds": {str(tmp_path / "missing"): "/extra"}}) as rt:
        result = await rt.exec("true")
    assert result.status is ExecStatus.CRASHED
    assert result.reason is not None and "missing" in result.reason


async def test_fallback_relay_serves_the_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_mod, "relay_program", lambda: relay_mod.RELAY_FALLBACK)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 8\r\n\r\nfallback")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    from polar_gym.runtime.base import GatewayEndpoint

    try:
        async with LocalRuntime(RuntimeSpec(network="gateway"), tmp_path,
                                gateway=GatewayEndpoint("127.0.0.1", port)) as rt:
            result = await rt.exec(f"busybox timeout 10 busybox wget -q -O - {rt.gateway_url}/")
            assert result.stdout == b"fallback", result
    finally:
        server.close()


async def test_limits_reach_the_sandbox(tmp_path: Path) -> None:
    async with LocalRuntime(RuntimeSpec(network="none", cpus=1, memory_mb=256, max_processes=64), tmp_path) as rt:
        result = await rt.exec("busybox nproc; ulimit -p; ulimit -d")
        assert result.ok, result
        # as root the whole sandbox's memory is a cgroup's (no per-process rlimit); otherwise RLIMIT_DATA
        data = "unlimited" if os.geteuid() == 0 else str(256 * 1024)
        assert result.stdout.decode().split() == ["1", "64", data]


@pytest.mark.skipif(os.geteuid() != 0, reason="the memory limit is a cgroup only as root (as a user an rlimit, whose "
                    "overrun is an allocation failure, not an OOM kill)")
async def test_an_oom_kill_the_command_survives_is_reported(tmp_path: Path) -> None:
    """A child killed at the memory limit while its parent exits 0 (OpenClaw's agent process did so) is counted."""
    hog = "python3 -c 'b = bytearray(512 * 2**20); print(len(b))'"
    async with LocalRuntime(RuntimeSpec(network="none", memory_mb=128), tmp_path) as rt:
        quiet = await rt.exec("echo fine")
        killed = await rt.exec(f"{hog}; echo parent lives on")
    assert (quiet.ok, quiet.oom_kills) == (True, 0)
    assert killed.ok and killed.stdout == b"parent lives on\n", killed
    assert killed.oom_kills >= 1


# -- the command line ---------------------------------------------------------------------------------------------


def _cli(*args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "polar_gym.runtime", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)  # type: ignore[call-overload]


def test_cli_runs_one_command_and_returns_its_exit_code() -> None:
    proc = _cli("exec", "--backend", "local", "--network", "none", "--env", "X=42", "--", "sh", "-c",
                "echo out $X; echo err >&2; exit 3")
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (3, b"out 42\n", b"err\n")


def test_cli_timeout_exit_code() -> None:
    proc = _cli("exec", "--timeout", "5", "--", "sh", "-c", "echo before; sleep 300")
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (124, b"before\n")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_tears_the_sandbox_down_when_killed(sig: signal.Signals) -> None:
    marker = f"climark{uuid.uuid4().hex[:10]}"
    proc = _cli("exec", "--env", f"M={marker}", "--", "sh", "-c", f"busybox sleep 300 & echo up; wait # {marker}")
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"up\n"
    assert len(processes_with(marker)) >= 3  # bwrap (outer and pid 1), sh, sleep
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert processes_with(marker) == []


_CANCEL_THEN_EXIT = """
import asyncio, sys
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec

async def main(delay: float) -> None:
    runtime = LocalRuntime(RuntimeSpec(network="none", env={"POLAR_TEST_MARKER": sys.argv[2]}), sys.argv[3])
    await runtime.start()
    running = asyncio.create_task(runtime.exec(["sleep", "300"]))
    await asyncio.sleep(delay)
    await runtime.cancel()
    await asyncio.gather(running, return_exceptions=True)
    # and the process ends right here: no event loop left to run delayed kills

asyncio.run(main(float(sys.argv[1])))
"""


@pytest.mark.parametrize("delay", [0.0, 0.001, 0.003, 0.006, 0.01, 0.02, 0.05])
def test_a_cancel_while_the_sandbox_starts_leaves_nothing_even_if_the_process_exits_at_once(tmp_path: Path,
                                                                                             delay: float) -> None:
    """A cancel that lands while bwrap is still creating the sandbox, in a process that exits right after
    (a launcher stopping on Ctrl-C): the inner bwrap must not outlive it."""
    marker = f"polarcancelrace{uuid.uuid4().hex[:10]}"
    proc = subprocess.run([sys.executable, "-c", _CANCEL_THEN_EXIT, str(delay), marker, str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert processes_with(marker) == []


async def test_without_a_stage_directory_bwrap_starts_directly_with_no_capabilities(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented fallback (no /media, /srv or /mnt): no staging and, as root, no uid drop; still no capability,
    no new privileges and a read-only view of the system."""
    monkeypatch.setattr(local_mod, "_STAGE_DIRS", ())
    async with LocalRuntime(RuntimeSpec(network="none"), tmp_path) as rt:
        result = await rt.exec("grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; touch /usr/x || echo read-only")
    assert result.text.split() == ["CapEff:", "0000000000000000", "NoNewPrivs:", "1", "read-only"], result


def test_the_loopback_lock_directory_is_ours_and_no_file_in_it_is_opened_through_a_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35's lesson for every file a root gateway opens in a shared /tmp: a lock directory planted as a link (or
    another user's) is refused, an older one of ours is narrowed to 0700, and a lock file is never followed."""
    victim = tmp_path / "victim"
    victim.mkdir()
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    with pytest.raises(SandboxStartError, match="refusing the loopback lock directory"):
        LoopbackAllocator(planted).acquire()
    assert list(victim.iterdir()) == []
    older = tmp_path / "older"
    older.mkdir(mode=0o755)
    older.chmod(0o755)
    ip, handle = LoopbackAllocator(older, prefix=78).acquire()
    LoopbackAllocator.release(handle)
    assert stat.S_IMODE(older.stat().st_mode) == 0o700 and (older / ip).is_file()
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    target = tmp_path / "target"
    monkeypatch.setattr(loopback_mod.random, "randrange", lambda n: 0)  # the first address tried: 127.79.0.1
    (linked / "127.79.0.1").symlink_to(target)
    with pytest.raises(OSError):  # ELOOP: not opened through the link
        LoopbackAllocator(linked, prefix=79).acquire()
    assert not target.exists()
