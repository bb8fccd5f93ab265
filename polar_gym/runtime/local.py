"""The ``local`` backend: a rootless bubblewrap sandbox that starts in milliseconds.

Design: every exec is its own ``bwrap`` invocation over the same mounts; the sandbox's state lives in the session
directory (``/polar``, the workdir, ``HOME=/polar/home``, ``/tmp``), so nothing has to stay alive between execs.
Why not one long-lived sandbox that execs enter: each exec then gets its own pid namespace, and killing the outer
bwrap (started in its own session; the inner one has ``--die-with-parent``) makes the kernel kill every process of
that exec, including ones that called setsid or daemonized, with no cgroup needed. Entering a long-lived sandbox
would need nsenter plus our own process tracking, and a crash would take every exec down at once. The price: a
background process does not outlive the exec that started it, and each exec has its own loopback network (servers
meant for later execs must be started in the same command).

Isolation: user, mount, pid, ipc, uts (and cgroup where possible) namespaces; a network namespace in modes ``none``
and ``gateway``; ``--die-with-parent`` and ``--new-session``; every capability dropped (``--cap-drop ALL``), no new
privileges, no nested user namespaces (``--disable-userns``). What the sandbox sees (polar_gym/runtime/bwrap.py):
the system directories read-only with /etc's secrets masked, its own session directory (``/polar``, ``/tmp``, the
workdir), the helper, and the read-only extras the gateway binds (``ro_binds``: the harness install) or a request
exposes (``expose``); not /root, /home, /var, /run, host /tmp, the project checkout, other sessions, nor any host
Unix socket (their directories are not there; abstract sockets belong to the host's network namespace). With
``spec.image`` (an unpacked image directory) the image is the root instead. The environment is built from scratch
and handed *into* the sandbox: bwrap reads ``--clearenv --setenv NAME VALUE ...`` from an anonymous file
(``--args FD``), while the launcher and bwrap themselves start with a fixed environment of ours in ``/``
(:mod:`polar_gym.runtime.hostenv`): a task's ``LD_PRELOAD`` once ran inside bwrap on the host (issue 35).

Who the sandbox is on the host: bwrap is started through the compiled helper (``relay.c``, host side), which stages
the bind sources in a private mount namespace and, when the gateway runs as root, drops to ``sandbox_uid`` (65534,
nobody) first, so uid 0 inside is that unprivileged uid outside: it cannot write host files, remount anything or
read what "others" may not. The session directory is chowned to it, and so is every upload. Each bind source is
opened with O_NOFOLLOW, so a symlink a sandbox puts in place of its own tmp or workdir ends the next exec (CRASHED,
with the reason) instead of binding a host path. As a user, the launcher stages inside a user namespace of its own
and the sandbox is that user (as before). Without the compiled
helper (no gcc), bwrap starts directly: as root the sandbox is then uid 0 with no capabilities and every host mount
read-only (weaker: host-root-owned files in the session directory stay writable to it); a warning says so.

Options: from the request only ``hostname``, ``expose`` (a list of host paths bound read-only at the same path,
each under one of the gateway's ``expose_roots``, else a start error) and ``links`` ({"/name": target}: a symlink
at the top of the root into ``/polar`` or ``/tmp``, whose target directory is created; Harbor tasks write to
/logs/verifier and read /tests); from the gateway's configuration also
``bwrap`` (binary), ``ro_binds`` ({host: inside}), ``expose_roots``, ``sandbox_uid``/``sandbox_gid``,
``stage_dir`` and the limits below.

Limits, each with a default (:data:`DEFAULTS`, override through the options of the same name; ``0`` turns one off):

- processes: ``spec.max_processes`` else ``max_processes`` (512). RLIMIT_NPROC set inside by the helper (it counts
  the sandbox's own user namespace); as root also a pids cgroup (v1, or v2 where delegated).
- memory: ``spec.memory_mb`` else ``memory_mb`` (1024) for the whole sandbox, through a memory cgroup (v1
  ``memory.limit_in_bytes`` + ``memsw``, or v2 ``memory.max``) when one is writable (as root); otherwise the
  fallback is RLIMIT_DATA per process (heap and anonymous memory of each process, not a total over the tree).
  /dev/shm is a 64 MiB tmpfs of the sandbox's own.
- disk: ``disk_mb`` (10240) for the session directory (``/polar``, ``/tmp``, the workdir): RLIMIT_FSIZE caps any one
  file at it, and while an exec runs a watchdog sums the directory's blocks (every 0.25 s, or 20x the time one
  walk takes, at most 10 s) and kills the exec, FAILED with a reason, once the total is over. The bound is the
  limit plus what can be written between two looks.
- gateway connections: ``max_connections`` (64) at once, in the in-sandbox relay (more wait in its backlog) and on
  the host side (more are closed).
- ``cpus`` pins the exec to ceil(cpus) CPUs by affinity (no fractional shares; a process may widen it again).

Network ``host`` shares the host network and allocates a distinct 127.x.y.z per sandbox (``POLAR_LOOPBACK_IP``),
advisory only. ``gateway`` relays 127.0.0.1:GATEWAY_INNER_PORT to the gateway's proxy (polar_gym/runtime/relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import posixpath
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TextIO

from polar_gym.runtime.base import (
    RELAY_PATH,
    ExecResult,
    ExecStatus,
    GatewayEndpoint,
    OutputCallback,
    Runtime,
)
from polar_gym.runtime.bwrap import (
    SYSTEM_DIRS,
    Launch,
    RootEntry,
    SandboxLayout,
    WorkdirError,
    bwrap_argv,
    cgroup_wrap,
    env_args_fd,
    launcher_argv,
    list_root,
    plan_links,
    plan_workdir,
    sandbox_env,
    secret_masks,
)
from polar_gym.runtime.errors import SandboxStartError, SandboxStateError, SandboxUnavailable
from polar_gym.runtime.files import confine, copy_in, copy_out
from polar_gym.runtime.hostenv import HOST_CWD, check_sandbox_env, host_env
from polar_gym.runtime.limits import SandboxCgroup, cgroup_name, chown_tree, disk_usage
from polar_gym.runtime.loopback import LoopbackAllocator
from polar_gym.runtime.processes import start_process
from polar_gym.runtime.relay import RELAY_FALLBACK, GatewayRelay, helper_argv, relay_program
from polar_gym.schema import RuntimeSpec

__all__ = ["DEFAULTS", "LocalRuntime", "LoopbackAllocator", "SandboxCgroup", "confine", "disk_usage"]

_CHUNK = 65536
#: default limits (see the module docstring); a gateway overrides them through its runtime options
DEFAULTS: dict[str, int] = {"max_processes": 512, "memory_mb": 1024, "disk_mb": 10240, "max_connections": 64,
                            "sandbox_uid": 65534}
#: where the launcher may mount its staging tmpfs (in its private mount namespace): the first that exists
_STAGE_DIRS = ("/media", "/srv", "/mnt")
#: how the launcher's own errors begin (a bind source it refused, a cgroup it could not join)
_LAUNCHER = "polar relay: "
log = logging.getLogger(__name__)
_cpu_counter = itertools.count()


@dataclass(eq=False)
class _Running:
    proc: asyncio.subprocess.Process
    status_fd: int = -1
    killed: ExecStatus | None = None
    reason: str | None = None  # why a limit killed it (killed is then FAILED)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    status_raw: bytearray = field(default_factory=bytearray)

    def status(self) -> dict[str, Any]:
        """bwrap's status documents so far (child-pid as soon as the sandbox exists, exit-code at the end)."""
        if self.status_fd >= 0:
            self.status_raw += _drain(self.status_fd)
        return _parse_status(bytes(self.status_raw))


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


class LocalRuntime(Runtime):
    """bubblewrap sandbox; options and limits in the module docstring."""

    name: ClassVar[str] = "local"
    request_options: ClassVar[frozenset[str]] = frozenset({"hostname", "expose", "links"})

    def __init__(self, spec: RuntimeSpec, session_dir: str | Path, *, gateway: GatewayEndpoint | None = None,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, session_dir, gateway=gateway, options=options)
        self._layout: SandboxLayout | None = None
        self._running: set[_Running] = set()
        self._kill_epoch = 0
        self._relay: GatewayRelay | None = None
        self._loopback: TextIO | None = None
        self._cgroup: SandboxCgroup | None = None
        self._cgroup_limits: set[str] = set()
        self._cpus: list[int] | None = None
        self._stopped = False
        self._bwrap = str(self.options.get("bwrap", "bwrap"))
        #: (uid, gid) on the host that the sandbox runs as, when the gateway is root and drops to it
        self.owner: tuple[int, int] | None = None

    def limit(self, name: str) -> int | None:
        """A limit's value: the spec's field, else the option of that name, else :data:`DEFAULTS`; 0 is none."""
        value = getattr(self.spec, name, None) if name in ("max_processes", "memory_mb") else None
        if value is None:
            value = self.options.get(name, DEFAULTS.get(name))
        return int(value) if value else None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._stopped:
            raise SandboxStateError("this sandbox was stopped; make a new one")
        check_sandbox_env(self.spec.env, "runtime env")
        bwrap = shutil.which(self._bwrap)
        if bwrap is None:
            raise SandboxUnavailable("bubblewrap is not installed: apt-get install bubblewrap "
                                     "(or bash scripts/setup.sh)")
        self._bwrap = bwrap
        root = Path(self.spec.image) if self.spec.image else Path("/")
        if not root.is_dir():
            raise SandboxStartError(f"the local backend needs an unpacked image directory, not {self.spec.image!r}")
        if os.geteuid() == 0:
            procs, memory = self.limit("max_processes"), self.limit("memory_mb")
            self._cgroup, self._cgroup_limits = await asyncio.to_thread(
                SandboxCgroup.create, cgroup_name(), procs,
                memory * 1024 * 1024 if memory else None)
        self._layout = await asyncio.to_thread(self._prepare, root)
        if self.spec.network == "gateway":
            if self.gateway is None:
                raise SandboxStartError("network 'gateway' needs a gateway endpoint")
            self._relay = GatewayRelay(self.session_dir.resolve(), self.gateway,
                                       max_connections=self.limit("max_connections"))
            await self._relay.start()
            if self.owner is not None:
                os.chown(self._relay.path, *self.owner)
        elif self.spec.network == "host":
            self.loopback_ip, self._loopback = LoopbackAllocator().acquire()
        if self.spec.cpus is not None:
            available = sorted(os.sched_getaffinity(0))
            n = max(1, min(len(available), math.ceil(self.spec.cpus)))
            first = next(_cpu_counter)
            self._cpus = sorted(available[(first + i) % len(available)] for i in range(n))

    def _launch(self, relay: str) -> Launch:
        """How bwrap starts: through the compiled helper (staging; as root, dropping to the sandbox uid), or, with
        only the Python fallback helper, directly (a warning: as root the sandbox is then uid 0 without caps)."""
        cgroups = self._cgroup.procs_files if self._cgroup is not None else ()
        if relay == str(RELAY_FALLBACK):
            if os.geteuid() == 0:
                log.warning("no compiled sandbox helper (gcc missing?): the local sandbox runs as uid 0 with every "
                            "capability dropped instead of as an unprivileged uid; run scripts/setup.sh")
            return Launch(cgroup_procs=cgroups)
        stage = str(self.options.get("stage_dir") or next((d for d in _STAGE_DIRS if os.path.isdir(d)), ""))
        if not stage:
            log.warning("no directory to stage the sandbox's mounts on (%s; or the local runtime option stage_dir): "
                        "bwrap starts directly%s", ", ".join(_STAGE_DIRS),
                        ", as uid 0 with every capability dropped" if os.geteuid() == 0 else "")
            return Launch(cgroup_procs=cgroups)
        if os.geteuid() == 0:
            uid = int(self.options.get("sandbox_uid", DEFAULTS["sandbox_uid"]))
            gid = int(self.options.get("sandbox_gid", uid))
            self.owner = (uid, gid)
            return Launch(helper=relay, stage=stage, uid=uid, gid=gid, cgroup_procs=cgroups)
        return Launch(helper=relay, stage=stage, cgroup_procs=cgroups)

    def _exposed(self) -> tuple[tuple[str, str], ...]:
        """The request's ``expose`` paths, each checked against the gateway's ``expose_roots``."""
        paths = self.options.get("expose") or []
        if isinstance(paths, str):
            paths = [paths]
        roots = [os.path.realpath(str(r)) for r in self.options.get("expose_roots") or []]
        allowed = ", ".join(roots) or "none"
        out = []
        for path in paths:
            if not isinstance(path, str) or not posixpath.isabs(path):
                raise SandboxStartError(f"runtime.options.expose: {path!r} is not an absolute path")
            inside = posixpath.normpath(path)
            real = os.path.realpath(inside)
            if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
                raise SandboxStartError(
                    f"runtime.options.expose: {path!r} is not under a root this gateway lets requests expose (the "
                    f"gateway's expose_roots, GatewayConfig.expose_roots: {allowed})")
            if not os.path.exists(real):
                raise SandboxStartError(f"runtime.options.expose: {path!r} does not exist on the gateway host")
            first = inside.strip("/").split("/")[0]
            if first in ("", "proc", "dev", "sys", "polar") or inside == "/tmp":
                raise SandboxStartError(f"runtime.options.expose: {path!r} would cover a part of the sandbox itself")
            out.append((real, inside))
        return tuple(out)

    def _links(self, entries: tuple[RootEntry, ...]) -> tuple[tuple[str, str], ...]:
        try:
            return plan_links(self.options.get("links") or {}, {e.name for e in entries}, self.spec.workdir)
        except WorkdirError as exc:
            raise SandboxStartError(str(exc)) from exc

    def _prepare(self, root: Path) -> SandboxLayout:
        session = self.session_dir.resolve()
        for sub in ("home", "tmp", ".bin"):
            (session / sub).mkdir(parents=True, exist_ok=True)
        host_root = root == Path("/")
        entries = list_root(root, SYSTEM_DIRS if host_root else None)
        try:
            workdir_host = plan_workdir(self.spec.workdir, entries, root, str(session))
        except WorkdirError as exc:
            raise SandboxStartError(str(exc)) from exc
        relay = str(relay_program())
        (session / ".bin" / "relay").touch()  # the mount point
        extra = tuple((str(h), str(i)) for h, i in dict(self.options.get("ro_binds") or {}).items())
        launch = self._launch(relay)
        layout = SandboxLayout(root=str(root), entries=entries, session_dir=str(session),
                               workdir=posixpath.normpath(self.spec.workdir), workdir_host=workdir_host,
                               network=self.spec.network, relay=relay,
                               hostname=str(self.options.get("hostname", "polar")),
                               extra_ro=extra + self._exposed(), masks=secret_masks() if host_root else (),
                               launch=launch, root_inside=launch.uid is not None,
                               links=self._links(entries))
        confine(layout.writable(), layout.workdir, "/").mkdir(parents=True, exist_ok=True)
        for inside, _ in layout.links:
            confine(layout.writable(), inside, "/").mkdir(parents=True, exist_ok=True)
        if self.owner is not None:
            chown_tree(session, *self.owner)
        return layout

    async def stop(self) -> None:
        self._stopped = True
        await self._kill_all(ExecStatus.CANCELLED)
        if self._relay is not None:
            await self._relay.stop()
            self._relay = None
        if self._loopback is not None:
            LoopbackAllocator.release(self._loopback)
            self._loopback = None
        if self._cgroup is not None:
            await self._cgroup.remove()
            self._cgroup = None

    async def cancel(self) -> None:
        await self._kill_all(ExecStatus.CANCELLED)

    async def _kill_all(self, status: ExecStatus) -> None:
        self._kill_epoch += 1  # execs still starting see this and kill themselves once they exist
        running = list(self._running)
        for r in running:
            self._kill(r, status)
        if self._cgroup is not None:
            self._cgroup.kill_all()
        for r in running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.done.wait(), 10)
            # the delayed looks scheduled by _kill never run if the process exits right after this (a launcher
            # stopping on Ctrl-C): an inner bwrap created while the kill landed would then outlive everything
            _kill_reported_child(r)

    @staticmethod
    def _kill(r: _Running, status: ExecStatus) -> None:
        """Kill the started process's children: the sandbox's pid 1 (the kernel then kills its whole pid
        namespace) so that the outer bwrap reaps it and exits, or, behind the helper's watchdog, the outer bwrap
        (the watchdog then kills the process group, pid 1 included); then, in case it does not go, the process
        group (``--die-with-parent`` takes the namespace down with it, but leaves pid 1 as a zombie for init)."""
        if r.killed is None:
            r.killed = status
        pid = r.proc.pid
        try:
            inner = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            inner = []
        for child in inner:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)

        def outer() -> None:
            if r.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

        if inner:
            asyncio.get_running_loop().call_later(0.5, outer)
        else:
            outer()
        # A kill that lands while the outer bwrap is still creating the sandbox finds no child yet, and the inner
        # bwrap (its own session) may outlive the outer one. bwrap reports the sandbox's pid on the status fd as
        # soon as it exists: look again shortly and kill that pid too.
        loop = asyncio.get_running_loop()
        for delay in (0.02, 0.1, 0.3, 1.0, 2.0):
            loop.call_later(delay, _kill_reported_child, r)

    # -- exec --------------------------------------------------------------------------------------------------

    def command_argv(self, command: list[str] | str, *, cwd: str | None = None, status_fd: int | None = None,
                     args_fd: int | None = None) -> list[str]:
        """The host command line for one exec (launcher, bwrap, the helper, the command); bwrap reads the command's
        environment from ``args_fd`` (:func:`~polar_gym.runtime.bwrap.env_args`)."""
        layout = self._layout
        if layout is None:
            raise SandboxStateError("the sandbox is not started")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        exempt = os.geteuid() == 0 and layout.launch.uid is None  # host root ignores RLIMIT_NPROC
        memory = self.limit("memory_mb")
        disk = self.limit("disk_mb")
        argv = helper_argv(RELAY_PATH, argv, gateway=self.spec.network == "gateway",
                           nproc=None if exempt else self.limit("max_processes"),
                           data_bytes=memory * 1024 * 1024 if memory and "memory" not in self._cgroup_limits
                           else None,
                           file_bytes=disk * 1024 * 1024 if disk else None,
                           max_connections=self.limit("max_connections"), cpus=self._cpus)
        inside_cwd = posixpath.normpath(posixpath.join(layout.workdir, cwd or "."))
        full = bwrap_argv(layout, argv, cwd=inside_cwd, status_fd=status_fd, bwrap=self._bwrap, args_fd=args_fd)
        if layout.launch.helper is not None:
            return launcher_argv(layout, full, watchdog_for=os.getpid())
        if layout.launch.cgroup_procs:
            return cgroup_wrap(layout.launch.cgroup_procs, full)
        return full

    def command_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The sandboxed command's environment; it reaches bwrap through an args fd, never the host's environment."""
        url = self.gateway_url if self.spec.network == "gateway" or self.gateway is not None else None
        return sandbox_env(self.spec.env, env, loopback_ip=self.loopback_ip, gateway_url=url)

    async def exec(self, command: list[str] | str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float | None = None, stdin: bytes | None = None,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> ExecResult:
        if self._stopped or self._layout is None:
            raise SandboxStateError("the sandbox is not running")
        check_sandbox_env(env, "the exec's env")
        started = time.monotonic()
        epoch = self._kill_epoch
        oom_before = self._oom_kills()
        env_fd = env_args_fd(self.command_env(env))
        status_r, status_w = os.pipe()
        try:
            argv = self.command_argv(command, cwd=cwd, status_fd=status_w, args_fd=env_fd)
            # the launcher and bwrap start with an environment and a working directory of ours (issue 35)
            proc = await start_process(
                *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=host_env(), cwd=HOST_CWD,
                pass_fds=(status_w, env_fd), start_new_session=True)
        except OSError as exc:
            os.close(status_r)
            return ExecResult(status=ExecStatus.CRASHED, reason=f"cannot start bwrap: {exc}",
                              seconds=time.monotonic() - started)
        except asyncio.CancelledError:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
            os.close(env_fd)
        run = _Running(proc, status_r)
        self._running.add(run)
        if self._kill_epoch != epoch:  # cancel() or stop() ran while this exec was starting
            self._kill(run, ExecStatus.CANCELLED)
        out, err = bytearray(), bytearray()
        readers = [asyncio.create_task(_read(proc.stdout, out, on_stdout)),
                   asyncio.create_task(_read(proc.stderr, err, on_stderr))]
        if stdin is not None:
            readers.append(asyncio.create_task(_feed(proc, stdin)))
        disk = self.limit("disk_mb")
        watchdog = asyncio.create_task(self._watch_disk(run, disk * 1024 * 1024)) if disk else None
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                self._kill(run, ExecStatus.TIMEOUT)
                await proc.wait()
            status = run.status()
            if run.killed is None and status.get("exit-code") is None:
                self._kill(run, ExecStatus.CRASHED)  # bwrap died on its own: make sure its namespace goes too
            # all output is in once every sandbox process has closed the pipes (the kernel kills them with pid 1)
            _, pending = await asyncio.wait(readers, timeout=10)
            for task in pending:
                task.cancel()
            child = status.get("child-pid")
            if isinstance(child, int):
                for _ in range(500):
                    if _gone(child):
                        break
                    await asyncio.sleep(0.01)
        except BaseException:  # our caller was cancelled: take the sandbox down before letting go
            self._kill(run, ExecStatus.CANCELLED)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            run.status()
            # whatever ended the exec (a cancel of our caller, bwrap killed from outside, e.g. by scancel's SIGTERM),
            # the sandbox's pid 1 must not outlive it: the delayed looks _kill scheduled may never run if this
            # process exits next, and the inner bwrap (its own session) ignores a SIGTERM sent to the job
            _kill_reported_child(run)
            run.status_fd = -1
            os.close(status_r)
            self._running.discard(run)
            run.done.set()
        # every sandbox process is gone: take off the setuid / setgid bits it may have left on its files
        await asyncio.to_thread(disk_usage, self.session_dir.resolve(), clear_setid=True)
        result = _result(run, proc.returncode, status, bytes(out), bytes(err), time.monotonic() - started)
        result.oom_kills = self._oom_kills() - oom_before
        return result

    def _oom_kills(self) -> int:
        """The sandbox's OOM kills so far; 0 without a memory cgroup of ours (as a user the limit is an rlimit, whose
        overrun is an allocation failure the process itself reports)."""
        return self._cgroup.oom_kills() if self._cgroup is not None and "memory" in self._cgroup_limits else 0

    async def _watch_disk(self, run: _Running, limit: int) -> None:
        """Kill ``run`` once the session directory holds more than ``limit`` bytes (see the module docstring)."""
        session = self.session_dir.resolve()
        while run.proc.returncode is None:
            began = time.monotonic()
            used = await asyncio.to_thread(disk_usage, session, clear_setid=True)
            if used > limit:
                run.reason = (f"the session directory holds {used // 2**20} MiB, over its disk limit of "
                              f"{limit // 2**20} MiB (local runtime option disk_mb)")
                self._kill(run, ExecStatus.FAILED)
                return
            await asyncio.sleep(min(10.0, max(0.25, 20 * (time.monotonic() - began))))  # <= 5 % of a CPU

    # -- files -------------------------------------------------------------------------------------------------

    def host_path(self, inside: str) -> Path:
        """The host path behind ``inside`` (relative paths are from the workdir); only writable areas."""
        if self._layout is None:
            raise SandboxStateError("the sandbox is not started")
        return confine(self._layout.writable(), inside, self._layout.workdir)

    async def upload(self, data: bytes | Path, dst: str) -> None:
        if self._stopped:
            raise SandboxStateError("the sandbox is not running")
        await asyncio.to_thread(copy_in, data, self.host_path(dst), self.owner)

    async def download(self, src: str, dst: Path) -> None:
        if self._stopped:
            raise SandboxStateError("the sandbox is not running")
        await asyncio.to_thread(copy_out, self.host_path(src), Path(dst))


async def _read(stream: asyncio.StreamReader | None, sink: bytearray, callback: OutputCallback | None) -> None:
    assert stream is not None
    while chunk := await stream.read(_CHUNK):
        sink += chunk
        if callback is not None:
            callback(chunk)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()


def _drain(fd: int) -> bytes:
    """Whatever is readable on the status pipe now (never blocks)."""
    os.set_blocking(fd, False)
    raw = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, _CHUNK):
            raw += chunk
    return raw


def _kill_reported_child(run: _Running) -> None:
    child = run.status().get("child-pid") if run.status_fd >= 0 else None
    if isinstance(child, int) and not _gone(child):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def _parse_status(raw: bytes) -> dict[str, Any]:
    """bwrap's --json-status-fd documents (child-pid, then exit-code), merged; written before bwrap exits."""
    merged: dict[str, Any] = {}
    decoder = json.JSONDecoder()
    text, pos = raw.decode(errors="replace"), 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(obj, dict):
            merged.update(obj)
    return merged


def _result(run: _Running, returncode: int | None, status: dict[str, Any], out: bytes, err: bytes,
            seconds: float) -> ExecResult:
    code = status.get("exit-code")
    if run.killed is ExecStatus.FAILED:
        return ExecResult(status=ExecStatus.FAILED, stdout=out, stderr=err, seconds=seconds, reason=run.reason)
    if run.killed in (ExecStatus.TIMEOUT, ExecStatus.CANCELLED):
        reason = "timed out" if run.killed is ExecStatus.TIMEOUT else "cancelled"
        return ExecResult(status=run.killed, stdout=out, stderr=err, seconds=seconds, reason=reason)
    if isinstance(code, int):
        return ExecResult(status=ExecStatus.OK if code == 0 else ExecStatus.FAILED, exit_code=code, stdout=out,
                          stderr=err, seconds=seconds)
    lines = [line for line in err.decode(errors="replace").splitlines() if line.startswith(("bwrap: ", _LAUNCHER))]
    if lines and lines[-1].startswith("bwrap: execvp "):  # the sandbox is fine, the command does not exist
        missing = "No such file" in lines[-1]
        return ExecResult(status=ExecStatus.FAILED, exit_code=127 if missing else 126, stdout=out, stderr=err,
                          seconds=seconds, reason=lines[-1].removeprefix("bwrap: "))
    if returncode is not None and returncode < 0:
        reason = f"the sandbox was killed by signal {-returncode}"
    elif lines:
        reason = lines[-1].removeprefix(_LAUNCHER)
    else:
        reason = f"the sandbox exited with {returncode} without running the command to its end"
    return ExecResult(status=ExecStatus.CRASHED, exit_code=None, stdout=out, stderr=err, seconds=seconds,
                      reason=reason)
