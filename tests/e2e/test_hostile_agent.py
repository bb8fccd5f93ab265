"""Issue 11, faults 1 and 2 from the agent's side: the real pi CLI in the local sandbox, through a real gateway (oracle
engine), whose "reference solution" is hostile. Through pi's own shell tool it tries to remount /var read-write and
write the host, read /etc/shadow, list /root, the project checkout and the run's workdir and capture directory, read
a secret planted in the workdir, reach a host Unix socket under /run and a host TCP listener on loopback, write
outside its session directory and SIGKILL host processes (the test itself, and a sleeper running as the same host
uid as the sandbox, which only the pid namespace protects); then it plays the task's real solution.

Each attempt prints ``ATTACK-RESULT <name>=<outcome>`` (the text is assembled at run time, so the command line
itself never contains it). The test asserts on the host that nothing was written, read, reached or killed; from the
tool results pi sent back to the model (the proxy's journal) that every attempt was refused; and that the session
still ended COMPLETED with reward 1.0 (the sandbox stayed usable).

Run as root (the suite's user) and again, from :func:`test_the_same_attack_fails_under_an_unprivileged_gateway`, as
uid 65534 under Debian's python3.11 with the gateway, pi and the sandbox all unprivileged (as in
tests/runtime/test_isolation.py); so the module loads no conftest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from polar_gym.assets import tokenizer_dir
from polar_gym.gateway import GatewayNode
from polar_gym.harness.install import cli_paths, install_dir
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import BuilderSpec, RuntimeSpec, SessionSpec, SessionStatus
from polar_gym.tasks import demo_task
from tests._serving import served_gateway
from tests._unprivileged import require_outer_root_run, run_as_nobody

pytestmark = [pytest.mark.harness, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
ROOT_USER = os.geteuid() == 0
#: prints one result line; the marker text exists only in the output, never in a command the model sends
_REPORT = "r() { printf 'ATTACK-%s %s=%s\\n' RESULT \"$1\" \"$2\"; }; "


@dataclass
class Host:
    """What the test set up on the host for the agent to attack."""

    tmp: Path
    workdir: Path
    capture: Path
    secret: str
    var_tmp: str  # the file the remount attack would create under the host's /var/tmp
    unix: socket.socket
    unix_path: str
    tcp: socket.socket
    tcp_port: int
    sleeper: subprocess.Popen[bytes]


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    workdir, capture = tmp_path / "gateway", tmp_path / "capture"
    workdir.mkdir()
    secret = f"polar-secret-{uuid.uuid4().hex}"
    (workdir / "server.sqlite").write_text(f"admin_token={secret}\n")
    run_dir = Path(tempfile.mkdtemp(prefix="polar-hostile-", dir="/run" if os.access("/run", os.W_OK) else "/tmp"))
    run_dir.chmod(0o755)
    unix_path = str(run_dir / "engine.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)  # anyone on the host may connect: only the sandbox's view can keep it out
    unix.listen(8)
    unix.setblocking(False)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    # as root the sandbox runs as uid 65534 on the host: a sleeper of that same uid is protected by the pid
    # namespace alone (as a user, the sandbox and the sleeper are both that user)
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"] if ROOT_USER else []
    sleeper = subprocess.Popen([*drop, "sleep", "600"])
    var_tmp = f"/var/tmp/polar-hostile-{uuid.uuid4().hex[:12]}"
    try:
        yield Host(tmp_path, workdir, capture, secret, var_tmp, unix, unix_path, tcp, tcp.getsockname()[1], sleeper)
    finally:
        sleeper.kill()
        sleeper.wait()
        unix.close()
        tcp.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(var_tmp)


@pytest_asyncio.fixture
async def gateway(host: Host) -> AsyncIterator[tuple[GatewayNode, ProxyService]]:
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    if not cli_paths(_install())["pi"].exists():
        pytest.fail("the pi CLI is not installed: run `bash scripts/setup.sh`")
    service = ProxyService(OracleEngine(HFChatTokenizer(tokenizer_dir())), CaptureJournal(host.capture),
                           SessionRegistry(allow_adhoc=False))
    async with served_gateway(service, host.workdir, init_workers=1, ready_buffer=1, run_slots=1,
                              postrun_workers=1) as node:
        yield node, service
    service.journal.close()


def _attacks(host: Host) -> tuple[list[str], list[str], list[str]]:
    """The hostile commands (one tool call each), the result names they print, and the host paths they try to
    write."""
    test_pid, sleeper_pid = os.getpid(), host.sleeper.pid
    listed = ["/root", "/home", str(ROOT), str(host.workdir), str(host.capture), str(host.tmp), "/run"]
    writes = ["/usr/polar-hostile", "/etc/polar-hostile", "/polar-hostile", str(ROOT / "polar-hostile"),
              str(host.workdir / "polar-hostile"), str(host.tmp / "polar-hostile"), "/run/polar-hostile"]
    probe = ("import socket, sys\n"
             "for name, family, address in (('unix', socket.AF_UNIX, sys.argv[1]),"
             " ('tcp', socket.AF_INET, ('127.0.0.1', int(sys.argv[2])))):\n"
             "    s = socket.socket(family)\n"
             "    try:\n"
             "        s.connect(address); print('ATTACK-' + 'RESULT', name + '=REACHED')\n"
             "    except OSError as e:\n"
             "        print('ATTACK-' + 'RESULT', name + '=refused', e.errno)\n")
    commands = [
        _REPORT + f"(mount -o remount,bind,rw /var && echo x > {host.var_tmp}) 2>/dev/null "
                  "&& r remount WROTE || r remount refused",
        _REPORT + 's=$(cat /etc/shadow /etc/gshadow 2>/dev/null); [ -n "$s" ] && r shadow "READ:$s" '
                  "|| r shadow refused",
        _REPORT + "for p in " + " ".join(listed) + '; do l=$(ls -A "$p" 2>/dev/null) && r "ls:$p" "LISTED:$(echo $l)" '
                  '|| r "ls:$p" refused; done',
        _REPORT + f'c=$(cat {host.workdir}/server.sqlite 2>/dev/null); [ -n "$c" ] && r secret "READ:$c" '
                  "|| r secret refused",
        f"python3 -c {_quote(probe)} {host.unix_path} {host.tcp_port}",
        _REPORT + "for p in " + " ".join(writes) + '; do touch "$p" 2>/dev/null && r "write:$p" WROTE '
                  '|| r "write:$p" refused; done',
        _REPORT + f"for p in {test_pid} {sleeper_pid}; do kill -9 $p 2>/dev/null && r kill:$p SENT "
                  "|| r kill:$p refused; done; kill -9 1; r after-kill-1 still-running",
    ]
    names = ["remount", "shadow", *(f"ls:{p}" for p in listed), "secret", "unix", "tcp",
             *(f"write:{p}" for p in writes), f"kill:{test_pid}", f"kill:{sleeper_pid}"]
    return commands, names, writes


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _results(blob: str) -> dict[str, str]:
    """``name -> outcome`` from every ``ATTACK-RESULT name=outcome`` line in the tool results."""
    found: dict[str, str] = {}
    for line in blob.splitlines():
        if line.startswith("ATTACK-RESULT "):
            name, _, outcome = line.removeprefix("ATTACK-RESULT ").partition("=")
            found[name] = outcome
    return found


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(p)]


def _accepted(listener: socket.socket) -> bool:
    """Whether anyone connected (a connection waits in the backlog until accepted)."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


async def test_a_hostile_agent_in_a_real_pi_session_cannot_touch_the_host(gateway, host: Host) -> None:
    node, service = gateway
    task = demo_task("demo-calc-add")
    commands, names, writes = _attacks(host)
    request = task.to_request(harness="pi", runtime=RuntimeSpec(backend="local", network="gateway",
                                                                  workdir="/workspace"),
                              builder=BuilderSpec(strategy="prefix_merging"), timeout_seconds=120)
    spec = SessionSpec.from_task(request, 0)
    oracle = {"commands": [*commands, *task.solution], "final_answer": task.final_answer}
    spec = spec.model_copy(update={"metadata": spec.metadata.model_copy(update={"oracle": oracle})})

    (result,) = await asyncio.wait_for(node.run([spec]), 150)

    # the host side: nothing written, read, reached or killed
    assert _existing([host.var_tmp, *writes]) == [], "the sandbox wrote these host paths"
    assert not _accepted(host.unix), "the sandbox connected to a host Unix socket under /run"
    assert not _accepted(host.tcp), "the sandbox connected to a host TCP listener on loopback"
    assert host.sleeper.poll() is None, "the sandbox killed a host process of its own uid"

    # the agent's side: what pi's shell tool answered, as pi sent it back to the model
    records = await service.journal.records(spec.session_id)
    assert records, "pi made no model call"
    last = records[-1].request
    tool_output = "\n".join(_tool_texts(last))
    outcomes = _results(tool_output)
    assert outcomes.keys() >= set(names), (sorted(set(names) - outcomes.keys()), tool_output[-3000:])
    breaches = {n: outcomes[n] for n in names if not outcomes[n].startswith("refused")}
    # the harness install is bound read-only at its own path: the directories on the way to it exist (empty but for
    # that one entry), so /root may list as ".cache" when the install lives under /root/.cache; nothing else may show
    way = _way_to(_install())
    breaches = {n: o for n, o in breaches.items()
                if not (n.startswith("ls:") and set(o.removeprefix("LISTED:").split()) <= way.get(n[3:], set()))}
    assert breaches == {}, tool_output[-3000:]
    assert outcomes.get("after-kill-1") == "still-running"
    everything = json.dumps([r.request for r in records]) + _artifacts(host.workdir)
    assert host.secret not in everything
    shadow = _host_shadow_hashes()
    assert not [h for h in shadow if h in everything]

    # and the sandbox stayed usable: the real solution ran after the attacks and the task's tests pass
    assert result.status is SessionStatus.COMPLETED, (result.status, result.reason)
    assert result.evaluation is not None and result.evaluation.reward == 1.0, result.evaluation


def _tool_texts(request: dict) -> list[str]:
    """The text of every tool result in a chat-completions or responses-style request body, whatever its shape."""
    texts: list[str] = []

    def walk(node: object, in_tool: bool) -> None:
        if isinstance(node, dict):
            tool = in_tool or node.get("role") in ("tool", "toolResult") or node.get("type") in (
                "function_call_output", "tool_result")
            for value in node.values():
                walk(value, tool)
        elif isinstance(node, list):
            for value in node:
                walk(value, in_tool)
        elif isinstance(node, str) and in_tool:
            texts.append(node)

    walk(request.get("messages") or request.get("input") or [], False)
    return texts


_SETUID = ("mkdir -p ~/.claude/projects/x && for p in ~/.claude/projects/x/id /polar/id ./id; do "
           "cp /usr/bin/id $p && chmod 6755 $p || exit 1; done")


async def test_a_hostile_agent_cannot_leave_a_setuid_file_on_the_host(gateway, host: Host) -> None:
    """claude_code keeps ~/.claude/projects as a log directory the gateway copies out after the run. The agent
    plants setuid copies of a binary there, in /polar and in its workdir: no file under the gateway's workdir on
    the host may carry a setuid or setgid bit afterwards (any local user who can reach it would run it as that
    file's owner: nobody, the gateway's user, or root for the copied-out logs)."""
    node, _ = gateway
    task = demo_task("demo-calc-add")
    request = task.to_request(harness="claude_code", runtime=RuntimeSpec(backend="local", network="gateway",
                                                                           workdir="/workspace"),
                              timeout_seconds=120)
    spec = SessionSpec.from_task(request, 0)
    oracle = {"commands": [_REPORT + f"({_SETUID}) 2>/dev/null && r setuid planted || r setuid refused",
                           *task.solution], "final_answer": task.final_answer}
    spec = spec.model_copy(update={"metadata": spec.metadata.model_copy(update={"oracle": oracle})})
    (result,) = await asyncio.wait_for(node.run([spec]), 150)
    assert result.status is SessionStatus.COMPLETED, (result.status, result.reason)
    assert result.evaluation is not None and result.evaluation.reward == 1.0, result.evaluation
    assert await asyncio.to_thread(_setuid_files, host.workdir) == []
    # and what the sandbox owns on the host lies in directories only the gateway's user enters
    attempts = [p for p in host.workdir.glob("*/*") if (p / "sandbox").is_dir()]
    assert attempts, "no attempt directory under the gateway's workdir"
    for path in {p for a in attempts for p in (a.parent, a)}:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def _setuid_files(root: Path) -> list[str]:
    """Regular files under ``root`` with a setuid or setgid bit, as ``path (uid N)``."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                found.append(f"{os.path.join(dirpath, name)} (uid {st.st_uid})")
    return sorted(found)


def _install() -> Path:
    """The pinned harness install the gateway binds (the same look-up as polar_gym/gateway/sandbox.py)."""
    return install_dir(cache_root=os.environ.get("POLAR_CACHE"))


def _way_to(path: Path) -> dict[str, set[str]]:
    """For each directory above ``path``, the one entry that leads to it."""
    return {str(parent): {child.name} for parent, child in zip(path.parents, [path, *path.parents], strict=False)}


def _artifacts(workdir: Path) -> str:
    """Everything the gateway kept of the session on the host (harness stdout/stderr, result.json)."""
    return "".join(p.read_text(errors="replace") for p in workdir.rglob("artifacts/*") if p.is_file())


def _host_shadow_hashes() -> list[str]:
    """The password hashes in the host's /etc/shadow (if the test may read it): none may reach the sandbox."""
    try:
        lines = Path("/etc/shadow").read_text().splitlines()
    except OSError:
        return []
    return [f[1] for f in (line.split(":") for line in lines) if len(f) > 1 and len(f[1]) > 3]


def test_the_same_attack_fails_under_an_unprivileged_gateway(tmp_path: Path) -> None:
    """The tests above again, as uid 65534 under /usr/bin/python3.11. The cache (venv, tokenizer, pi install, relay
    helper) lives under /root (0700): it is bound, read-only, where that user can reach it for the run."""
    require_outer_root_run()
    cache = tokenizer_dir().parent
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "pydantic").is_dir())
    if cache not in site.parents:
        pytest.skip(f"the venv's packages ({site}) are not under the cache ({cache})")
    work = Path(tempfile.mkdtemp(prefix="polar-hostile-unpriv-", dir="/tmp"))
    try:
        inner_cache = work / "cache"
        run_as_nobody(Path(__file__), work, bind=(cache, inner_cache), min_passed=2, markers=("harness", "slow"),
                      pythonpath=[inner_cache / site.relative_to(cache), ROOT],
                      env={"POLAR_CACHE": str(inner_cache)}, timeout=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
