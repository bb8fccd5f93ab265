"""Issue 11, faults 1, 2 and 7 on the local backend: what an agent inside the sandbox can do to the host.

Fault 1 (root inside was host root with every capability: ``mount -o remount,bind,rw /var`` wrote the host), fault 2
(the sandbox saw /etc/shadow, /root, the checkout, host /tmp and host Unix sockets) and fault 7 (no default limits:
1,000 processes, a 1 GB allocation, 8 x 200 MB under a 256 MB limit, unbounded disk, 1,000 relay connections).

The module runs twice in CI: as whoever runs the suite (root here) and, from
:func:`test_the_same_checks_pass_as_an_unprivileged_user`, as uid 65534 under Debian's python3.11. So it loads no
conftest and imports nothing of tests/ (the unprivileged run reads only polar_gym and the venv's packages).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polar_gym.runtime.base import ExecStatus, GatewayEndpoint
from polar_gym.runtime.errors import SandboxStartError
from polar_gym.runtime.local import LocalRuntime, disk_usage
from polar_gym.schema import RuntimeSpec
from tests._unprivileged import require_outer_root_run, rerun_with_the_local_runtime
from tests._waiting import until

ROOT = Path(__file__).parents[2]
ROOT_USER = os.geteuid() == 0

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def session(tmp_path: Path) -> Path:
    path = tmp_path / "session"
    path.mkdir()
    return path


@contextlib.asynccontextmanager
async def sandbox(session: Path, **kwargs: object) -> AsyncIterator[LocalRuntime]:
    options = kwargs.pop("options", None)
    gateway = kwargs.pop("gateway", None)
    kwargs.setdefault("network", "none")
    runtime = LocalRuntime(RuntimeSpec(**kwargs), session, gateway=gateway, options=options)  # type: ignore[arg-type]
    async with runtime:
        yield runtime


def _present(*paths: str) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def _world_dir(prefix: str, parent: str = "/tmp") -> Path:
    """A fresh directory on the host that anyone may enter."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    path.chmod(0o755)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "polar_gym.runtime", *args], capture_output=True, timeout=120,
                          cwd=tempfile.gettempdir())


# -- fault 1: nothing inside is host root ------------------------------------------------------------------------


def test_fault1_remount_inside_does_not_write_the_host() -> None:
    """The issue's command line, verbatim but for a unique file name."""
    target = f"/var/tmp/polar-fault1-{uuid.uuid4().hex[:12]}"
    proc = _cli("exec", "--backend", "local", "--network", "none", "--", "sh", "-c",
                f"mount -o remount,bind,rw /var && echo x > {target}")
    try:
        assert proc.returncode != 0, proc
        assert not os.path.exists(target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)


async def test_fault1_no_capabilities_no_new_privileges_and_not_host_root(session: Path) -> None:
    async with sandbox(session) as rt:
        status = await rt.exec("grep -E '^(CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status; "
                               "echo made > /polar/owned")
        assert status.ok, status
        fields = dict(line.split(":\t") for line in status.text.splitlines())
        assert fields == {"CapPrm": "0000000000000000", "CapEff": "0000000000000000", "CapBnd": "0000000000000000",
                          "CapAmb": "0000000000000000", "NoNewPrivs": "1"}
        for attempt in ("mount -o remount,rw /", "mount -o remount,bind,rw /usr", "mount -o remount,bind,rw /etc",
                        "mount -t tmpfs none /usr", "umount /etc", "touch /usr/polar-x", "touch /etc/polar-x",
                        "unshare -U -r true", "chroot / true"):
            result = await rt.exec(attempt)
            assert result.status is ExecStatus.FAILED, (attempt, result)
    owner = os.stat(session / "owned").st_uid
    # as root the sandbox runs as nobody on the host; as a user, as that user (never as anyone more privileged)
    assert owner == (65534 if ROOT_USER else os.geteuid())
    assert _present("/usr/polar-x", "/etc/polar-x") == []


# -- fault 2: the sandbox sees only what it needs ----------------------------------------------------------------


async def test_fault2_the_sandbox_sees_only_what_it_needs(session: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-session"
    other.mkdir()
    (other / "server.sqlite").write_text("admin tokens")
    host_tmp = _world_dir("polar-host-tmp-")
    try:
        hidden = ["/root", "/home", str(ROOT), str(ROOT / "pyproject.toml"), str(other), str(host_tmp), "/run",
                  "/var/run", "/var/lib", "/opt", "/srv", "/mnt", "/media/0", str(Path.home())]
        script = "; ".join(f'[ -e "{p}" ] && echo "VISIBLE {p}"' for p in hidden)
        async with sandbox(session) as rt:
            result = await rt.exec(f"{script}; wc -c < /etc/shadow 2>/dev/null || echo unreadable; "
                                   f"ls /tmp; ls /; python3 -c 'print(40 + 2)'; node -e 'console.log(7)'")
    finally:
        shutil.rmtree(host_tmp)
    lines = result.text.split("\n")
    assert not [line for line in lines if line.startswith("VISIBLE")], result.text
    assert lines[0] in ("0", "unreadable")  # /etc/shadow is masked by an empty file
    listing = set(lines[1:-3])
    assert listing == {"bin", "dev", "etc", "lib", "lib64", "polar", "proc", "sbin", "sys", "tmp", "usr", "var",
                       "workspace"} - ({"lib64"} if not _present("/lib64") else set())
    assert lines[-3:] == ["42", "7", ""]  # the system's interpreters still run


@pytest.mark.parametrize("network", ["none", "gateway"])
async def test_fault2_no_host_unix_socket_is_reachable(session: Path, tmp_path: Path, network: str) -> None:
    """Listening sockets in host directories (/run, where container engines keep theirs, and host /tmp) and in the
    abstract namespace cannot be reached; one placed in the session directory can (so the probe itself works)."""
    shared = _world_dir("polar-sock-", "/run" if os.access("/run", os.W_OK) else "/tmp")
    paths = [str(tmp_path / "host.sock"), str(shared / "host.sock")]
    abstract = f"\0polar-test-{uuid.uuid4().hex[:10]}"
    listeners = []
    for address in [*paths, abstract, str(session / "own.sock")]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(8)
        if not address.startswith("\0"):
            os.chmod(address, 0o777)
        listeners.append(s)
    probe = ("import socket, sys\n"
             "for a in sys.argv[1:]:\n"
             "    s = socket.socket(socket.AF_UNIX)\n"
             "    a = a.replace('@', '\\0', 1) if a.startswith('@') else a\n"
             "    try:\n"
             "        s.connect(a); print('reached')\n"
             "    except OSError as e:\n"
             "        print('refused', e.errno)\n")
    upstream = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    try:
        async with sandbox(session, network=network, gateway=GatewayEndpoint("127.0.0.1", port)) as rt:
            result = await rt.exec(["python3", "-c", probe, *paths, "@" + abstract[1:], "/polar/own.sock"])
    finally:
        for s in listeners:
            s.close()
        upstream.close()
        shutil.rmtree(shared)
    assert result.ok, result
    answers = result.text.split()
    assert [a for a in answers if a in ("reached", "refused")] == ["refused"] * 3 + ["reached"], result.text


async def test_fault2_expose_binds_only_paths_under_the_gateways_roots(session: Path, tmp_path: Path) -> None:
    data = tmp_path / "datasets"
    (data / "task1").mkdir(parents=True)
    (data / "task1" / "input.txt").write_text("payload")
    data.chmod(0o755)
    (data / "task1").chmod(0o755)
    exposed = str(data / "task1")
    spec_options = {"expose": [exposed]}
    runtime = LocalRuntime(RuntimeSpec(network="none", options=spec_options), session,
                           options={"expose_roots": [str(data)]})
    async with runtime as rt:
        result = await rt.exec(f"cat {exposed}/input.txt; touch {exposed}/x || echo read-only")
        assert result.text == "payloadread-only\n", result
    for roots in ([], [str(tmp_path / "elsewhere")]):
        refused = LocalRuntime(RuntimeSpec(network="none", options=spec_options), session,
                               options={"expose_roots": roots})
        with pytest.raises(SandboxStartError, match="expose_roots"):
            await refused.start()
        await refused.stop()


async def test_fault2_a_symlink_in_place_of_its_own_tmp_is_refused_not_followed(session: Path) -> None:
    async with sandbox(session) as rt:
        swap = await rt.exec("rm -rf /polar/tmp && ln -s /etc /polar/tmp && echo swapped")
        assert swap.text == "swapped\n", swap
        after = await rt.exec("ls /tmp")
    assert after.status is ExecStatus.CRASHED, after
    assert after.reason is not None and "symbolic links" in after.reason


async def test_fault2_an_upload_never_writes_through_a_link_the_sandbox_planted(session: Path, tmp_path: Path
                                                                                 ) -> None:
    """A directory upload merges into the workspace; links the sandbox left there are replaced, not followed (as
    root, following one would write any host file)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("host data")
    payload = tmp_path / "payload"
    (payload / "d").mkdir(parents=True)
    (payload / "d" / "x").write_text("uploaded")
    (payload / "sub").mkdir()
    (payload / "sub" / "y").write_text("uploaded too")
    async with sandbox(session) as rt:
        plant = await rt.exec(f"mkdir -p d && ln -s {victim} d/x && ln -s {tmp_path} sub && echo planted")
        assert plant.text == "planted\n", plant
        await rt.upload(payload, "/workspace")
        inside = await rt.exec("cat d/x; echo; cat sub/y; echo; [ -L d/x ] || [ -L sub ] || echo no-links")
    assert victim.read_text() == "host data" and not (tmp_path / "y").exists()
    assert inside.text == "uploaded\nuploaded too\nno-links\n", inside


# -- fault 7: default limits -------------------------------------------------------------------------------------


async def test_fault7_default_limits_stop_a_fork_flood_and_a_1gb_allocation(session: Path) -> None:
    async with sandbox(session) as rt:
        flood = await rt.exec("i=0; while [ $i -lt 1000 ]; do sleep 60 & i=$((i+1)); done; echo all-started",
                              timeout=120)
        await rt.cancel()
        assert b"all-started" not in flood.stdout and not flood.ok, flood
        big = await rt.exec(["python3", "-c", "b = b'x' * (1 << 30); print('allocated')"], timeout=120)
        assert b"allocated" not in big.stdout and not big.ok, big
        small = await rt.exec(["python3", "-c", "b = b'x' * (64 << 20); print('allocated')"], timeout=120)
        assert small.ok and small.text == "allocated\n", small


_EIGHT = """
import os
children = []
for i in range(8):
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in [ready_r, go_w] + [fd for c in children for fd in c[1:3]]:
            os.close(fd)  # a write end of go held here (its own or a sibling's) would keep EOF from ever coming
        block = b"x" * (60 << 20)  # touched: really resident
        os.write(ready_w, b"1")
        os.read(go_r, 1)  # hold it until every sibling holds its own (or died trying)
        os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    children.append([pid, ready_r, go_w, None])
while any(c[3] is None for c in children):
    for c in children:
        if c[3] is None:
            if os.waitpid(c[0], os.WNOHANG)[0]:
                c[3] = "died"
    import select
    readable, _, _ = select.select([c[1] for c in children if c[3] is None], [], [], 0.05)
    for c in children:
        if c[1] in readable and os.read(c[1], 1):
            c[3] = "ready"
for c in children:
    os.close(c[2])
held = sum(1 for c in children if c[3] == "ready" and os.waitpid(c[0], 0)[1] == 0)
print("held", held)
"""


@pytest.mark.skipif(not ROOT_USER, reason="a memory limit over the whole sandbox needs a writable memory cgroup (as "
                                          "root); as a user the documented fallback is RLIMIT_DATA per process")
async def test_fault7_memory_limit_covers_the_whole_sandbox(session: Path) -> None:
    """8 processes of 60 MB each under memory_mb=256: they cannot all hold their memory at once."""
    async with sandbox(session, memory_mb=256) as rt:
        result = await rt.exec(["python3", "-c", _EIGHT], timeout=120)
    assert result.text.startswith("held ") and int(result.text.split()[1]) < 8, result


async def test_fault7_disk_limit_bounds_the_session_directory(session: Path) -> None:
    async with sandbox(session, options={"disk_mb": 20}) as rt:
        one = await rt.exec("dd if=/dev/zero of=/polar/big bs=1M count=100 2>/dev/null && echo wrote")
        assert one.text == "" and not one.ok, one
        assert (session / "big").stat().st_size <= 20 * 2**20
        await rt.exec("rm -f /polar/big")
        many = await rt.exec("i=0; while [ $i -lt 400 ]; do dd if=/dev/zero of=/workspace/f$i bs=1M count=1 "
                             "2>/dev/null || exit 9; busybox usleep 10000; i=$((i+1)); done; echo wrote-all",
                             timeout=300)
    assert many.status is ExecStatus.FAILED and b"wrote-all" not in many.stdout, many
    assert many.reason is not None and "disk limit" in many.reason
    assert disk_usage(session) < 300 * 2**20


_CONNECT = """
import socket, sys
held = []
for i in range(150):
    for family, address in ((socket.AF_INET, ("127.0.0.1", 18080)), (socket.AF_UNIX, "/polar/gateway.sock")):
        s = socket.socket(family)
        s.connect(address)
        held.append(s)
print("opened", flush=True)
sys.stdin.read()
"""


async def test_fault7_relay_connections_are_capped(session: Path) -> None:
    """300 connections from inside (150 through the relay, 150 straight to the gateway socket): the gateway sees at
    most 64 at once."""
    open_now, most, total = [0], [0], [0]
    gone = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_now[0] += 1
        total[0] += 1
        most[0] = max(most[0], open_now[0])
        with contextlib.suppress(OSError):
            await reader.read()
        open_now[0] -= 1
        writer.close()
        if open_now[0] == 0:
            gone.set()

    upstream = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    out: list[bytes] = []
    try:
        async with sandbox(session, network="gateway", gateway=GatewayEndpoint("127.0.0.1", port)) as rt:
            task = asyncio.create_task(rt.exec(["python3", "-c", _CONNECT], on_stdout=out.append, timeout=120))
            await until(lambda: b"opened" in b"".join(out) or task.done(), what="the 300 connections")
            assert b"opened" in b"".join(out)
            # the cap's worth of connections reach the gateway side (a condition, however slow the machine) ...
            await until(lambda: most[0] >= 32, what="32 connections at the gateway side")
            # ... then until it stops changing (every connection is in, queued or refused by now), so an excess
            # over the cap would be seen
            seen = -1
            while seen != total[0]:
                seen = total[0]
                await asyncio.sleep(1.0)
            await rt.cancel()
            await task
    finally:
        upstream.close()
    assert b"opened" in b"".join(out)
    assert 32 <= most[0] <= 64, most[0]


# -- the same, as an unprivileged user ---------------------------------------------------------------------------


def test_the_same_checks_pass_as_an_unprivileged_user(tmp_path: Path) -> None:
    """This module again, as uid 65534 under Debian's /usr/bin/python3.11 (the venv's site-packages bound where
    that user can reach them; the relay helper copied into a cache of its own)."""
    require_outer_root_run()
    rerun_with_the_local_runtime(Path(__file__), min_passed=10, timeout=1200)


def test_the_setuid_sweep_clears_the_sandboxs_files_and_follows_no_link(tmp_path: Path) -> None:
    """A sandbox may chmod u+s its own files (they would run as their owner for anyone on the host who reaches
    them): the walk that counts the session directory takes the bits off. A link it planted to a host directory or
    a host setuid file is never followed: the host file keeps its mode."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    host_file = host_dir / "setuid-host-tool"
    host_file.write_bytes(b"#!/bin/sh\n")
    host_file.chmod(0o4755)
    session = tmp_path / "session"
    (session / "deep").mkdir(parents=True)
    planted = session / "deep" / "tool"
    planted.write_bytes(b"x" * 4096)
    planted.chmod(0o6755)
    (session / "to-dir").symlink_to(host_dir)
    (session / "to-file").symlink_to(host_file)
    used = disk_usage(session, clear_setid=True)
    assert used >= 4096
    assert planted.stat().st_mode & 0o7777 == 0o755
    assert host_file.stat().st_mode & 0o7777 == 0o4755
    assert disk_usage(session) == used  # the links added nothing: nothing behind them was counted
