"""The rootless Apptainer backend: one Apptainer *instance* per session.

``start`` runs ``instance start --fakeroot --containall [--net --network none] --overlay <session>/overlay
--bind <session>:/polar IMAGE NAME``; ``exec`` runs ``exec --pwd DIR instance://NAME CMD``; ``stop`` runs ``instance
stop`` (then ``--force``) and removes the overlay. Command lines come from :mod:`polar_gym.apptainer.commands`.

What goes through spython and what does not (spython blocks, so its calls run in a worker thread):

- through spython: the install check (``check_install``: ``BINARY --version``), the liveness check
  (``Client.instances``: ``instance list --json NAME``) and ``instance stop`` (``Instance.stop``), whenever the
  binary is the ``singularity`` on PATH (the only name spython calls; Apptainer installs it too);
- a thin asyncio subprocess instead: ``instance start`` (spython's ``Instance.start`` logs and drops the exit code
  and stderr, so a failure could not be reported; its captured mode may hang on the daemon's inherited pipe, so we
  send the output to files), ``exec`` (spython's ``execute`` cannot stream both pipes to callbacks, feed stdin, time
  out or kill a process tree), ``overlay create`` (no spython command), and list/stop when the binary is not
  spython's ``singularity``.

Host side: every apptainer command runs with a fixed environment of ours
(:func:`~polar_gym.apptainer.commands.host_environment`) in ``/``; an exec's environment (the spec's and the exec's
own) goes in a 0600 ``--env-file`` in a private 0700 host directory the sandbox does not see, removed once the exec
ends. ``APPTAINERENV_*`` in the CLI's environment carried a task's values into a host process (issue 35).

Killing: each exec records its pid inside (``/polar/.polar_gym/exec/N.pid``); a timeout or ``cancel`` kills that
tree from a second exec (:data:`~polar_gym.apptainer.commands.KILL_TREE_SCRIPT`), then the host-side ``exec``
process group. ``stop`` also stops the instance, which ends every process in its PID namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_gym.apptainer import commands as cmd
from polar_gym.apptainer.commands import INNER_STATE, ApptainerOptions
from polar_gym.apptainer.gateway import ApptainerRelay
from polar_gym.private_files import new_private_file
from polar_gym.runtime.base import ExecResult, ExecStatus, GatewayEndpoint, OutputCallback, Runtime
from polar_gym.runtime.errors import SandboxStartError, SandboxStateError, SandboxUnavailable
from polar_gym.runtime.hostenv import HOST_CWD, check_sandbox_env
from polar_gym.runtime.processes import start_process
from polar_gym.schema import RuntimeSpec

__all__ = ["INSTALL_HINT", "ApptainerRuntime", "resolve_binary"]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "Apptainer is not available: neither the configured binary nor `apptainer`/`singularity` is on PATH. On a "
    "cluster try `module load apptainer` (or singularity); otherwise install Apptainer >= 1.1 "
    "(https://apptainer.org/docs/admin/main/installation.html, the unprivileged install script works without root) "
    "or set RuntimeSpec.options.binary to its full path. See docs/apptainer.md."
)

#: seconds to wait for a killed process's pipes to close before giving up on the rest of its output
_DRAIN_SECONDS = 5.0
#: seconds for one control command (list, kill-tree, mkdir)
_CONTROL_TIMEOUT = 60.0
_STATE_DIR = ".polar_gym"  # host side of commands.INNER_STATE


def resolve_binary(binary: str) -> str:
    """The full path of the Apptainer CLI, falling back from ``singularity`` to ``apptainer`` and back."""
    candidates = [binary]
    if os.path.basename(binary) in ("singularity", "apptainer") and os.sep not in binary:
        candidates += [b for b in ("singularity", "apptainer") if b != binary]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    raise SandboxUnavailable(f"{INSTALL_HINT} (looked for {', '.join(candidates)})")


@dataclass(eq=False)  # identity hash: kept in a set while it runs
class _Running:
    """One exec in flight: the host process, where its inner pid lands, and whether we killed it."""

    proc: asyncio.subprocess.Process
    pidfile: Path
    killed_by: ExecStatus | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)


class ApptainerRuntime(Runtime):
    """A rootless Apptainer instance per session; see the module docstring for the commands it runs."""

    name = "apptainer"
    request_options = cmd.REQUEST_OPTIONS

    def __init__(self, spec: RuntimeSpec, session_dir: str | Path, *, gateway: GatewayEndpoint | None = None,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, session_dir, gateway=gateway, options=options)
        self.opts = ApptainerOptions.from_options(self.options)
        self.session_dir = self.session_dir.resolve()
        self.instance = cmd.instance_name(self.session_dir, uuid.uuid4().hex[:8])
        self.binary: str | None = None
        self._use_spython = False
        self._state = "new"  # new → starting → running → stopped
        self._running: set[_Running] = set()
        self._counter = itertools.count(1)
        self._stop_lock = asyncio.Lock()
        self._relay: ApptainerRelay | None = None  # in "gateway" mode: the relay's host half and helper
        self.log_dir = self.session_dir / _STATE_DIR / "apptainer"
        #: private host directory (0700) for env files; made on first use, removed by stop()
        self._host_dir: Path | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._state != "new":
            raise SandboxStateError(f"apptainer instance {self.instance} was already started")
        self._state = "starting"
        check_sandbox_env(self.spec.env, "runtime env")
        self.binary = await self._check_install()
        (self.session_dir / _STATE_DIR / "exec").mkdir(parents=True, exist_ok=True)
        (self.session_dir / _STATE_DIR / "xfer").mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await self._prepare_overlay()
        workdir = self.opts.workdir_host(self.session_dir)
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=True)
        if self.spec.network == "gateway":
            self._relay = await ApptainerRelay.open(self, self.instance)
        argv = cmd.instance_start_argv(self.spec, self._opts(), self.session_dir, self.instance,
                                       relay=self._relay.program if self._relay is not None else None)
        code, err = await self._run_logged(argv, "start", self.opts.start_timeout)
        if code != 0:
            raise SandboxStartError(f"apptainer instance start failed (exit {code}) for {self.instance}: "
                                    f"{_tail(err)}\ncommand: {' '.join(argv)}")
        self._state = "running"
        if not await self.alive():
            raise SandboxStartError(f"apptainer instance {self.instance} exited right after starting: {_tail(err)}")
        if workdir is None and self.opts.overlay != "none":
            made = await self.exec(["mkdir", "-p", self.spec.workdir], cwd="/", timeout=_CONTROL_TIMEOUT)
            if not made.ok:
                raise SandboxStartError(f"could not create the workdir {self.spec.workdir}: {made.stderr!r}")
        if self._relay is not None:
            await self._relay.start_inner()

    async def stop(self) -> None:
        """Kill execs, stop the relay, stop the instance (gracefully, then ``--force``), remove the overlay."""
        async with self._stop_lock:
            if self._state == "stopped":
                return
            started = self._state == "running"
            self._state = "stopped"
            if started:
                await self._kill_all(ExecStatus.CANCELLED)
            if self._relay is not None:
                await self._relay.close()
                self._relay = None
            if started or self.binary is not None:
                await self._stop_instance()
            self._remove_overlay()
            if self._host_dir is not None:
                shutil.rmtree(self._host_dir, ignore_errors=True)
                self._host_dir = None
            shutil.rmtree(self.session_dir / _STATE_DIR / "xfer", ignore_errors=True)
            shutil.rmtree(self.session_dir / _STATE_DIR / "exec", ignore_errors=True)

    async def cancel(self) -> None:
        await self._kill_all(ExecStatus.CANCELLED)

    # ------------------------------------------------------------------ exec

    async def exec(self, command: list[str] | str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float | None = None, stdin: bytes | None = None,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> ExecResult:
        if self._state != "running":
            raise SandboxStateError(f"apptainer instance {self.instance} is {self._state}, not running")
        assert self.binary is not None
        check_sandbox_env(env, "the exec's env")
        merged = {**self.spec.env, **(env or {})}
        env_file = await asyncio.to_thread(self._write_env_file, merged) if merged else None
        try:
            return await self._exec(command, env_file, cwd=cwd, timeout=timeout, stdin=stdin, on_stdout=on_stdout,
                                    on_stderr=on_stderr)
        finally:
            if env_file is not None:
                env_file.unlink(missing_ok=True)

    def _write_env_file(self, env: dict[str, str]) -> Path:
        """A 0600 env file (:func:`~polar_gym.apptainer.commands.env_file_text`) in the private host directory."""
        if self._host_dir is None or not self._host_dir.is_dir():
            self._host_dir = Path(tempfile.mkdtemp(prefix="polar-apptainer-"))
        return new_private_file(self._host_dir, cmd.env_file_text(env).encode("utf-8", "surrogateescape"), "env-")

    async def _exec(self, command: list[str] | str, env_file: Path | None, *, cwd: str | None,
                    timeout: float | None, stdin: bytes | None, on_stdout: OutputCallback | None,
                    on_stderr: OutputCallback | None) -> ExecResult:
        assert self.binary is not None
        number = next(self._counter)
        pidfile = self.session_dir / _STATE_DIR / "exec" / f"{number}.pid"
        argv = cmd.exec_argv(self.binary, self.instance, command, cwd=cwd or self.spec.workdir,
                             pidfile=f"{INNER_STATE}/exec/{number}.pid",
                             env_file=str(env_file) if env_file is not None else None)
        began = time.monotonic()
        proc = await start_process(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cmd.host_environment(),
            cwd=HOST_CWD, start_new_session=True)
        run = _Running(proc, pidfile)
        self._running.add(run)
        readers = [asyncio.create_task(_pump(proc.stdout, run.stdout, on_stdout)),
                   asyncio.create_task(_pump(proc.stderr, run.stderr, on_stderr))]
        feeder = asyncio.create_task(_feed(proc, stdin)) if stdin is not None else None
        try:
            try:
                # wait for the process, not its pipes: a daemon left behind may hold them open (drained below)
                await asyncio.wait_for(_exited(proc), timeout)
            except TimeoutError:
                await self._kill(run, ExecStatus.TIMEOUT)
            except asyncio.CancelledError:
                await self._kill(run, ExecStatus.CANCELLED)
                raise
            finally:
                await _drain(proc, readers, feeder)
        finally:
            self._running.discard(run)
            pidfile.unlink(missing_ok=True)
        return await self._result(run, time.monotonic() - began, timeout)

    async def _result(self, run: _Running, seconds: float, timeout: float | None) -> ExecResult:
        code = run.proc.returncode
        out, err = bytes(run.stdout), bytes(run.stderr)
        if run.killed_by is ExecStatus.TIMEOUT:
            return ExecResult(status=ExecStatus.TIMEOUT, exit_code=code, stdout=out, stderr=err, seconds=seconds,
                              reason=f"killed after the {timeout:g} s timeout")
        if run.killed_by is not None:
            return ExecResult(status=run.killed_by, exit_code=code, stdout=out, stderr=err, seconds=seconds,
                              reason="killed by cancel() or stop()")
        if code == 0:
            return ExecResult(status=ExecStatus.OK, exit_code=0, stdout=out, stderr=err, seconds=seconds)
        # 255 is what apptainer exits with when it cannot run the command at all (but a command may exit 255 too)
        if (code is None or code < 0 or code == 255) and not await self.alive():
            return ExecResult(status=ExecStatus.CRASHED, exit_code=code, stdout=out, stderr=err, seconds=seconds,
                              reason=f"apptainer instance {self.instance} is gone: {_tail(err)}")
        return ExecResult(status=ExecStatus.FAILED, exit_code=code, stdout=out, stderr=err, seconds=seconds)

    # ------------------------------------------------------------------ files

    async def upload(self, data: bytes | Path, dst: str) -> None:
        """Stage on the host under the session dir, then ``cp`` into place inside (so overlay files work too)."""
        staged_host, staged_inner = self._staging()
        try:
            is_dir = await asyncio.to_thread(_stage, data, staged_host)
            if is_dir:
                script = 'mkdir -p "$2" && cp -a "$1"/. "$2"/'
            else:
                script = 'mkdir -p "$(dirname "$2")" && cp "$1" "$2"'
            await self._checked(["/bin/sh", "-c", script, "upload", staged_inner, dst], f"upload to {dst}")
        finally:
            _remove(staged_host)

    async def download(self, src: str, dst: Path) -> None:
        staged_host, staged_inner = self._staging()
        try:
            await self._checked(["cp", "-a", src, staged_inner], f"download of {src}")
            await asyncio.to_thread(_unstage, staged_host, Path(dst))
        finally:
            _remove(staged_host)

    def _staging(self) -> tuple[Path, str]:
        token = uuid.uuid4().hex
        return (self.session_dir / _STATE_DIR / "xfer" / token, f"{INNER_STATE}/xfer/{token}")

    async def _checked(self, argv: list[str], what: str) -> None:
        result = await self.exec(argv, cwd=self.spec.workdir, timeout=_CONTROL_TIMEOUT * 10)
        if not result.ok:
            raise SandboxStateError(f"{what} failed in {self.instance} ({result.status.value}, exit "
                                    f"{result.exit_code}): {_tail(result.stderr)}")

    # ------------------------------------------------------------------ instance control

    async def alive(self) -> bool:
        """Whether ``instance list`` still shows our instance (and its pid, when given, still exists)."""
        if self.binary is None:
            return False
        entries = await self._list()
        for entry in entries:
            if entry.get("instance") == self.instance:
                pid = entry.get("pid")
                return not isinstance(pid, int) or _pid_exists(pid)
        return False

    async def _list(self) -> list[dict[str, Any]]:
        if self._use_spython:
            found = await asyncio.to_thread(_spython_list, self.instance)
        else:
            code, out, _ = await _run(cmd.instance_list_argv(self._bin(), self.instance), _CONTROL_TIMEOUT)
            found = _parse_list(out) if code == 0 else []
        return found

    async def _stop_instance(self) -> None:
        if self.binary is None:
            return
        code = await self._instance_stop(force=False)
        if code != 0 and await self.alive():
            log.warning("apptainer instance stop of %s failed (exit %s); forcing", self.instance, code)
            await self._instance_stop(force=True)

    async def _instance_stop(self, *, force: bool) -> int:
        if self._use_spython and not force:
            return await asyncio.to_thread(_spython_stop, self.instance, self.opts.stop_timeout)
        argv = cmd.instance_stop_argv(self._bin(), self.instance, timeout=self.opts.stop_timeout, force=force)
        code, _, err = await _run(argv, self.opts.stop_timeout + _CONTROL_TIMEOUT)
        if code != 0:
            log.info("%s: exit %s: %s", " ".join(argv), code, _tail(err))
        return code

    async def _kill_all(self, status: ExecStatus) -> None:
        await asyncio.gather(*(self._kill(run, status) for run in list(self._running)))

    async def _kill(self, run: _Running, status: ExecStatus) -> None:
        """Kill the tree inside (by its recorded pid), then the host-side ``exec`` process group."""
        if run.killed_by is None:
            run.killed_by = status
        pid = _read_pid(run.pidfile)
        if pid is not None and self.binary is not None:
            code, _, err = await _run(cmd.kill_tree_argv(self.binary, self.instance, [pid]), _CONTROL_TIMEOUT)
            if code != 0:
                log.info("kill-tree in %s exited %s: %s", self.instance, code, _tail(err))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ helpers

    def _opts(self) -> ApptainerOptions:
        """The options with the resolved binary, so every command names the same executable."""
        return ApptainerOptions(**{**self.opts.__dict__, "binary": self._bin()})

    def _bin(self) -> str:
        if self.binary is None:
            raise SandboxStateError("apptainer binary not resolved yet (start() first)")
        return self.binary

    async def _check_install(self) -> str:
        binary = resolve_binary(self.opts.binary)
        from spython.utils import check_install

        if not await asyncio.to_thread(check_install, binary):
            raise SandboxUnavailable(f"`{binary} --version` failed. {INSTALL_HINT}")
        # spython always runs the literal name "singularity"; use it only when that is the binary we resolved
        self._use_spython = shutil.which("singularity") == binary
        return binary

    async def _prepare_overlay(self) -> None:
        path = self.opts.overlay_path(self.session_dir)
        if self.opts.overlay == "dir" and path is not None:
            path.mkdir(parents=True, exist_ok=True)
        elif self.opts.overlay == "image" and path is not None and not path.exists():
            argv = cmd.overlay_create_argv(self._bin(), path, self.opts.overlay_size_mb, fakeroot=self.opts.fakeroot)
            code, _, err = await _run(argv, _CONTROL_TIMEOUT * 5)
            if code != 0:
                raise SandboxStartError(f"apptainer overlay create failed (exit {code}): {_tail(err)}")

    def _remove_overlay(self) -> None:
        path = self.opts.overlay_path(self.session_dir)
        if path is not None and (path.exists() or path.is_symlink()):
            try:
                _remove(path, strict=True)
            except OSError as exc:  # e.g. files owned by a subuid under fakeroot with /etc/subuid
                log.warning("could not remove the overlay %s: %s", path, exc)

    async def _run_logged(self, argv: Sequence[str], label: str, timeout: float) -> tuple[int, bytes]:
        """Run a command whose descendants may outlive it (``instance start`` daemonizes): output to files, not
        pipes, so waiting for it never waits for the daemon."""
        out_path, err_path = self.log_dir / f"{label}.out", self.log_dir / f"{label}.err"
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            proc = await start_process(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out_fd,
                                       stderr=err_fd, env=cmd.host_environment(), cwd=HOST_CWD,
                                       start_new_session=True)
        finally:
            os.close(out_fd)
            os.close(err_fd)
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            code = -signal.SIGKILL
        err = err_path.read_bytes()
        if code == -signal.SIGKILL:
            err += f"\n[polar_gym] killed after {timeout:g} s".encode()
        return code, err


# ---------------------------------------------------------------------- module helpers


async def _run(argv: Sequence[str], timeout: float) -> tuple[int, bytes, bytes]:
    """A short control command with captured output; killed (whole group) at the timeout."""
    proc = await start_process(*argv, stdin=asyncio.subprocess.DEVNULL,
                               stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                               env=cmd.host_environment(), cwd=HOST_CWD, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return -signal.SIGKILL, b"", f"timed out after {timeout:g} s".encode()
    assert proc.returncode is not None
    return proc.returncode, out, err


async def _pump(stream: asyncio.StreamReader | None, sink: bytearray, callback: OutputCallback | None) -> None:
    if stream is None:  # pragma: no cover - we always ask for pipes
        return
    while chunk := await stream.read(65536):
        sink += chunk
        if callback is not None:
            callback(chunk)


async def _feed(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    if proc.stdin is None:  # pragma: no cover - we always ask for a pipe when there is data
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data or b"")
        await proc.stdin.drain()
    proc.stdin.close()


async def _exited(proc: asyncio.subprocess.Process) -> int:
    """The exit code, as soon as the process has exited. ``Process.wait()`` (3.11) also waits for every pipe to
    close, which a daemon left behind can hold forever; the return code is known earlier, so poll it as well."""
    waiter = asyncio.ensure_future(proc.wait())
    delay = 0.02
    try:
        while not waiter.done() and proc.returncode is None:
            await asyncio.wait({waiter}, timeout=delay)
            delay = min(delay * 2, 0.5)
    finally:
        if not waiter.done():
            waiter.cancel()
    assert proc.returncode is not None
    return proc.returncode


async def _drain(proc: asyncio.subprocess.Process, readers: list[asyncio.Task[None]],
                 feeder: asyncio.Task[None] | None) -> None:
    """After the process ended or was killed: collect what is left in the pipes (bounded), then close them."""
    tasks: list[asyncio.Task[Any]] = [*readers, *([feeder] if feeder else [])]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(asyncio.gather(_exited(proc), *tasks, return_exceptions=True)),
                               _DRAIN_SECONDS)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if proc.returncode is None:  # the host-side process ignored everything: make sure it is gone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await _exited(proc)
    # pipes still held open by an orphan: close our ends (no public API for this on Process)
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()


def _spython_list(name: str) -> list[dict[str, Any]]:
    """``Client.instances(name, return_json=True)``: a dict for one match, a list otherwise, [] on errors."""
    from spython.main import Client

    try:
        found = Client.instances(name=name, return_json=True, quiet=True)
    except (ValueError, IndexError):  # rc 0 with no JSON on stdout
        return []
    if isinstance(found, dict):
        return [found]
    return [f for f in found if isinstance(f, dict)]


def _spython_stop(name: str, timeout: float) -> int:
    from spython.main import Client

    instance = Client.instance(name, start=False, name=name, quiet=True)
    return int(instance.stop(timeout=int(timeout) or None, quiet=True))


def _parse_list(out: bytes) -> list[dict[str, Any]]:
    try:
        doc = json.loads(out or b"{}")
    except ValueError:
        return []
    entries = doc.get("instances") if isinstance(doc, dict) else None
    return [e for e in entries or [] if isinstance(e, dict)]


def _stage(data: bytes | Path, staged: Path) -> bool:
    """Copy what to upload into the staging path; whether it is a directory."""
    if isinstance(data, bytes):
        staged.write_bytes(data)
        return False
    if data.is_dir():
        shutil.copytree(data, staged, symlinks=True)
        return True
    shutil.copyfile(data, staged)
    return False


def _unstage(staged: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove(dst)
    shutil.move(staged, dst)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path, *, strict: bool = False) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=not strict)
    elif strict:
        path.unlink(missing_ok=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _tail(data: bytes, limit: int = 2000) -> str:
    return data.decode(errors="replace").strip()[-limit:]

