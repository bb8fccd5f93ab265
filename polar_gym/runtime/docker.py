"""The ``docker`` backend: one container per session, driven through a Docker-compatible CLI (docker, podman, …).

Only the CLI is used, never an SDK, so the backend works wherever the CLI does and every command is a readable
argv: :class:`DockerCommands` builds each one as a pure function (golden-tested), :class:`DockerRuntime` runs them.

How the pieces fit:

- PID 1 of the container is a small ``sh`` loop that exits on TERM (so ``rm -f`` is quick) and first writes a ready
  marker into the session directory; in ``gateway`` mode the entrypoint is the relay binary (bind-mounted read-only),
  which listens on 127.0.0.1:GATEWAY_INNER_PORT inside, forks its forwarder and then execs that loop.
- ``exec`` starts a new session in the container (runc calls setsid), so the wrapper's pid is also its process group
  and session id. The wrapper records that pid and the command's exit code under ``/polar/.polar-docker/exec``; a
  timeout kills that session's tree from inside (``exec … sh -c KILL tree PID``), ``cancel`` kills every process
  outside PID 1's session (``KILL all``), which spares PID 1 and the relay.
- A missing pid file means the command never started (CRASHED); a missing exit-code file means the sandbox died
  under the command or the wrapper was killed from outside (CRASHED either way: the container may still read as
  running for a moment after its init was killed).
- upload and download go through ``cp`` with tar streams, so parents are created and bytes round-trip exactly.
- The CLI (and conmon, which it starts) runs with a fixed environment of ours (:func:`cli_env`) in a private 0700
  directory of this sandbox (not the session directory, which the container writes); the container's and each
  exec's environment travel in a 0600 env file there (``--env-file``), removed once the CLI has read it. A task's
  ``LD_PRELOAD`` once ran in podman and conmon as root, and ``./evil.so`` loaded a file the container wrote
  (issue 35).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import posixpath
import secrets
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TextIO

from polar_gym.private_files import new_private_file
from polar_gym.runtime.base import (
    RELAY_PATH,
    SESSION_MOUNT,
    ExecResult,
    ExecStatus,
    GatewayEndpoint,
    OutputCallback,
    Runtime,
)
from polar_gym.runtime.docker_commands import (
    EXEC_WRAPPER,
    INSTALL_HINT,
    KEEPALIVE,
    KILL_SCRIPT,
    LABEL,
    PRIVATE_DIR,
    DockerCommands,
    cli_env,
    container_name,
    env_file_text,
    session_id_for,
)
from polar_gym.runtime.docker_files import pack_upload, unpack_download
from polar_gym.runtime.errors import SandboxError, SandboxStartError, SandboxStateError, SandboxUnavailable
from polar_gym.runtime.hostenv import check_sandbox_env
from polar_gym.runtime.lease import LEASE_LOOKS, Lease
from polar_gym.runtime.local import DEFAULTS
from polar_gym.runtime.loopback import LoopbackAllocator
from polar_gym.runtime.podman_host import default_cli, host_defaults
from polar_gym.runtime.processes import start_process
from polar_gym.runtime.relay import GatewayRelay, relay_program
from polar_gym.schema import RuntimeSpec

__all__ = [
    "EXEC_WRAPPER",
    "INSTALL_HINT",
    "KEEPALIVE",
    "KILL_SCRIPT",
    "LABEL",
    "PRIVATE_DIR",
    "DockerCommands",
    "DockerRuntime",
    "container_name",
    "session_id_for",
]

# CLI error texts, lower-cased, that decide which error a failure maps to
_DAEMON_DOWN = ("cannot connect to the docker daemon", "is the docker daemon running", "error during connect",
                "cannot connect to podman")
_NO_SUCH = ("no such container", "no container with name or id")
_NOT_FOUND = ("no such file or directory", "could not find the file")


@dataclass
class _Exec:
    """A running ``exec``: its client process and, once decided, why it ended early."""

    marker: Path  # host path prefix of the pid / exit-code files
    proc: asyncio.subprocess.Process
    outcome: ExecStatus | None = None
    reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _as_command(command: list[str] | str) -> list[str]:
    return ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)


def _reason(stderr: bytes) -> str:
    text = stderr.decode(errors="replace").strip()
    return text.splitlines()[-1] if text else ""


def _prepare_private(private: Path) -> None:
    """Our bookkeeping directory, writable by any user inside (commands may not run as root)."""
    (private / "exec").mkdir(parents=True, exist_ok=True)
    for path in (private, private / "exec"):
        path.chmod(0o1777)
    (private / "ready").unlink(missing_ok=True)


#: the images ``python -m polar_gym.apptainer build --offline`` makes (and the test image): local only
LOCAL_IMAGES = ("localhost/polar-gym/", "localhost/polar-test-")


def _image_hint(image: str) -> str:
    """How to make one of our own images (they are built locally, never pulled), for a failed ``run``."""
    if not image.startswith(LOCAL_IMAGES[0]):
        return ""
    return ("; this image is built locally, not pulled: python -m polar_gym.apptainer build --offline --format oci "
            "(bash scripts/setup.sh does it as root)")


def _clean_private(session_dir: Path) -> None:
    """Remove our bookkeeping and the relay's mount point (the session's own files stay)."""
    shutil.rmtree(session_dir / PRIVATE_DIR, ignore_errors=True)
    placeholder = session_dir / RELAY_PATH.removeprefix(f"{SESSION_MOUNT}/")
    with contextlib.suppress(OSError):
        placeholder.unlink()
        placeholder.parent.rmdir()


def _read_markers(marker: Path, consume: bool) -> tuple[bool, int | None, int | None]:
    """(the wrapper started, its pid, the command's exit code) from the marker files; ``consume`` removes them."""
    values: list[int | None] = []
    started = marker.with_suffix(".pid").exists()
    for suffix in (".pid", ".rc"):
        path = marker.with_suffix(suffix)
        try:
            values.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            values.append(None)
        if consume:
            path.unlink(missing_ok=True)
    return started, values[0], values[1]


class DockerRuntime(Runtime):
    """A session in a container, through the Docker CLI.

    ``options``: ``cli`` (argv or a string; else $POLAR_DOCKER_CLI, else podman (with runc) if installed, else
    docker), ``run_args`` (extra ``run`` arguments; else $POLAR_DOCKER_RUN_ARGS; without a ``--ulimit`` among them,
    the limits this host needs come first, probed once by :func:`~polar_gym.runtime.podman_host.host_defaults`),
    ``session_id`` (names the container; else the session directory's
    name and a hash of its path), the default limits ``memory_mb``, ``max_processes``, ``max_connections`` (as the
    local backend's, :data:`~polar_gym.runtime.local.DEFAULTS`; 0 turns one off): only from the constructor (the
    gateway's configuration), and ``lease_seconds`` (30; 0 turns it off): the container stops itself about that long
    after this process stops renewing its lease (a gateway killed without clean-up leaves no container running).
    ``shell`` (``/bin/sh``) and ``start_timeout`` (seconds, 120) also from a request.
    Every container runs with ``--cap-drop ALL --security-opt no-new-privileges`` and mounts nothing of the host
    but the session directory (and the relay helper, read-only).
    """

    name: ClassVar[str] = "docker"
    request_options: ClassVar[frozenset[str]] = frozenset({"shell", "start_timeout"})
    #: seconds a killed exec may take to end before its CLI client is killed too
    KILL_GRACE: ClassVar[float] = 5.0

    def __init__(self, spec: RuntimeSpec, session_dir: str | Path, *, gateway: GatewayEndpoint | None = None,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, session_dir, gateway=gateway, options=options)
        opts = self.options
        cli = opts.get("cli") or os.environ.get("POLAR_DOCKER_CLI") or default_cli()
        run_args = opts.get("run_args") or os.environ.get("POLAR_DOCKER_RUN_ARGS") or ()
        #: no --ulimit configured: start() adds the ones this host needs (podman's, probed once per process)
        given = shlex.split(run_args) if isinstance(run_args, str) else list(run_args)
        self._host_run_args = not any(str(arg).startswith("--ulimit") for arg in given)
        self.commands = DockerCommands(cli=tuple(shlex.split(cli) if isinstance(cli, str) else cli),
                                       run_args=tuple(shlex.split(run_args) if isinstance(run_args, str) else run_args),
                                       shell=str(opts.get("shell") or "/bin/sh"))
        self.start_timeout = float(opts.get("start_timeout") or 120.0)
        self.session_id = session_id_for(self.session_dir, opts)
        self.container = container_name(self.session_id)
        self._private = self.session_dir / PRIVATE_DIR
        self._execs: dict[str, _Exec] = {}
        self._running = False
        self._created = False
        self._relay: GatewayRelay | None = None  # the host half of the gateway relay, while it serves
        self._loopback: TextIO | None = None  # holds this sandbox's loopback address (network "host")
        self.lease_seconds = float(opts.get("lease_seconds", 30.0) or 0.0)
        self._lease: Lease | None = None
        #: the CLI's working directory and the env files' home: private (0700), outside the session directory
        self._host_dir: Path | None = None

    # -- CLI plumbing -------------------------------------------------------------------------------------------

    async def _cli(self, argv: list[str], *, timeout: float = 60.0, stdin: Any = None,
                   stdout: Any = asyncio.subprocess.PIPE) -> tuple[int, bytes, bytes]:
        """Run one CLI command to completion; a missing CLI or a dead daemon raise SandboxUnavailable."""
        try:
            proc = await start_process(*argv, stdin=stdin if stdin is not None else
                                       asyncio.subprocess.DEVNULL, stdout=stdout,
                                       stderr=asyncio.subprocess.PIPE, cwd=self._cli_cwd(),
                                       env=cli_env())
        except FileNotFoundError as exc:
            raise SandboxUnavailable(f"container CLI {argv[0]!r} not found: {INSTALL_HINT}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode and any(s in err.decode(errors="replace").lower() for s in _DAEMON_DOWN):
            raise SandboxUnavailable(f"the container engine behind {argv[0]!r} is not reachable "
                                     f"({_reason(err)}): {INSTALL_HINT}")
        return proc.returncode or 0, out or b"", err

    def _require_running(self) -> None:
        if not self._running:
            raise SandboxStateError(f"docker sandbox {self.container} is not running (start it first)")

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def _cli_cwd(self) -> str:
        """The CLI's working directory, :meth:`_private_dir`: podman's conmon leaves files (an ``oom`` marker under a
        memory limit) in its working directory, which must be neither the caller's nor one the container writes
        (a relative ``LD_PRELOAD`` or a planted file resolves against it)."""
        return str(self._private_dir())

    def _private_dir(self) -> Path:
        """This sandbox's private host directory (made on first use, 0700, removed by stop()): nothing of it is
        mounted into the container."""
        if self._host_dir is None or not self._host_dir.is_dir():
            self._host_dir = Path(tempfile.mkdtemp(prefix="polar-docker-"))
        return self._host_dir

    def _write_env_file(self, env: dict[str, str]) -> Path:
        """A 0600 env file in the private directory (:func:`env_file_text`); the caller removes it."""
        return new_private_file(self._private_dir(), env_file_text(env).encode("utf-8", "surrogateescape"), "env-")

    async def start(self) -> None:
        if self._running or self._created:
            raise SandboxStateError(f"docker sandbox {self.container} was already started")
        if shutil.which(self.commands.cli[0]) is None:
            raise SandboxUnavailable(f"container CLI {self.commands.cli[0]!r} not found on PATH: {INSTALL_HINT}")
        if not self.spec.image:
            raise SandboxStartError("the docker backend needs runtime.image (an image name the CLI can run)")
        if self.spec.image.startswith("-"):
            raise SandboxStartError(f"runtime.image {self.spec.image!r} is not an image name (it would be read as an "
                                    f"option of {self.commands.cli[0]})")
        check_sandbox_env(self.spec.env, "runtime env")
        session_dir = self.session_dir.resolve()
        if ":" in str(session_dir):
            raise SandboxStartError(f"session directory {session_dir} contains ':' and cannot be bind-mounted")
        if self._host_run_args:
            found = await asyncio.to_thread(host_defaults, self.commands.cli)
            self.commands = dataclasses.replace(self.commands, run_args=(*found.run_args, *self.commands.run_args))
            self._host_run_args = False
        if self.spec.image.startswith(LOCAL_IMAGES) and not any(a.startswith("--pull") for a in self.commands.run_args):
            # built here, never in a registry: fail at once instead of after podman's pull retries
            self.commands = dataclasses.replace(self.commands, run_args=(*self.commands.run_args, "--pull", "never"))
        self._created = True  # from here on, stop() has something to clean up
        try:
            await asyncio.to_thread(_prepare_private, self._private)
            if self.spec.network == "host":  # one 127.x.y.z per sandbox, from the pool the local backend uses too
                self.loopback_ip, self._loopback = await asyncio.to_thread(LoopbackAllocator().acquire)
            env_file = await asyncio.to_thread(self._write_env_file, self._env())
            argv = self.commands.run(name=self.container, session_id=self.session_id, image=self.spec.image,
                                     session_dir=session_dir, workdir=self.spec.workdir, env_file=str(env_file),
                                     network=self.spec.network, cpus=self.spec.cpus,
                                     memory_mb=self._limit("memory_mb"), max_processes=self._limit("max_processes"),
                                     relay=await self._start_relay() if self.spec.network == "gateway" else None,
                                     max_connections=self._limit("max_connections"), lease=await self._start_lease())
            try:
                code, _, err = await self._cli(argv, timeout=self.start_timeout)
            finally:
                env_file.unlink(missing_ok=True)
            if code != 0:
                raise SandboxStartError(f"{self.commands.cli[0]} run failed (exit {code}): "
                                        f"{err.decode(errors='replace').strip()}{_image_hint(self.spec.image)}")
            await self._wait_ready()
        except BaseException:
            with contextlib.suppress(SandboxError):
                await self.stop()
            raise
        self._running = True

    def _limit(self, name: str) -> int | None:
        """The spec's limit, else the option of that name, else the shared default; 0 is none."""
        value = getattr(self.spec, name, None) if name in ("max_processes", "memory_mb") else None
        if value is None:
            value = self.options.get(name, DEFAULTS.get(name))
        return int(value) if value else None

    def _env(self) -> dict[str, str]:
        """The container's environment: where things are (as the local backend sets it), then the spec's own."""
        env = {"POLAR_SESSION_DIR": SESSION_MOUNT}
        if self.loopback_ip is not None:
            env["POLAR_LOOPBACK_IP"] = self.loopback_ip
        if self.spec.network == "gateway" or (self.spec.network == "host" and self.gateway is not None):
            env["POLAR_GATEWAY_URL"] = self.gateway_url
        return {**env, **self.spec.env}

    async def _wait_ready(self) -> None:
        """PID 1 touches the ready marker once it runs (after the relay listens); a container that exits first is
        a start error with its logs."""
        ready = self._private / "ready"
        deadline = time.monotonic() + self.start_timeout
        while not await asyncio.to_thread(ready.exists):
            if time.monotonic() > deadline:
                raise SandboxStartError(f"{self.container} did not become ready in {self.start_timeout:g}s")
            code, out, _ = await self._cli(self.commands.is_running(self.container))
            if code != 0 or out.strip() != b"true":
                _, logs, errs = await self._cli(self.commands.logs(self.container))
                raise SandboxStartError(f"{self.container} exited during start: "
                                        f"{(logs + errs).decode(errors='replace').strip()}")
            await asyncio.sleep(0.02)

    async def _start_lease(self) -> tuple[Path, float, int] | None:
        """The lease PID 1 watches (:mod:`polar_gym.runtime.lease`), renewed from now until stop()."""
        if self.lease_seconds <= 0:
            return None
        self._lease = Lease(self.lease_seconds, self.container)
        await self._lease.start()
        return self._lease.directory, self._lease.every, LEASE_LOOKS

    async def _start_relay(self) -> Path:
        """Serve the gateway on ``<session>/gateway.sock`` (the shared host half); returns the helper to mount."""
        if self.gateway is None:
            raise SandboxStartError('network="gateway" needs the gateway endpoint (Runtime(..., gateway=...))')
        program = await asyncio.to_thread(relay_program)  # may compile relay.c once
        self._relay = GatewayRelay(self.session_dir.resolve(), self.gateway,
                                   max_connections=self._limit("max_connections"))
        await self._relay.start()
        return program

    async def stop(self) -> None:
        runs = list(self._execs.values())
        for run in runs:
            run.outcome = run.outcome or ExecStatus.CANCELLED
            run.reason = run.reason or "sandbox stopped"
        self._running = False
        try:
            if self._created:
                await self._remove()
            for run in runs:  # their commands died with the container: let each exec() return before we do
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(run.done.wait(), self.KILL_GRACE)
        finally:
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            if self._relay is not None:
                relay, self._relay = self._relay, None
                await relay.stop()
            await asyncio.to_thread(_clean_private, self.session_dir)
            if self._host_dir is not None:
                await asyncio.to_thread(shutil.rmtree, self._host_dir, True)
                self._host_dir = None
            if self._loopback is not None:
                LoopbackAllocator.release(self._loopback)
                self._loopback = None

    async def _remove(self) -> None:
        """``rm -f`` our container and anything else labelled with this session (a leftover of an earlier run)."""
        code, out, _ = await self._cli(self.commands.list_session(self.session_id))
        ids = out.decode().split() if code == 0 else []
        code, _, err = await self._cli(self.commands.remove([self.container, *ids]))
        if code != 0 and not any(s in err.decode(errors="replace").lower() for s in _NO_SUCH):
            raise SandboxError(f"could not remove {self.container}: {_reason(err)}")
        self._created = False

    async def cancel(self) -> None:
        if not self._running:
            return
        runs = list(self._execs.values())
        for run in runs:
            run.outcome = run.outcome or ExecStatus.CANCELLED
            run.reason = run.reason or "cancelled"
        try:
            code, _, _ = await self._cli(self.commands.kill_all(self.container), timeout=self.KILL_GRACE * 2)
        except TimeoutError:
            code = -1
        if code != 0:  # the kill script could not run inside: restart the container (files stay, processes go)
            await self._restart()
        for run in runs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.done.wait(), self.KILL_GRACE * 2)

    async def _restart(self) -> None:
        await asyncio.to_thread((self._private / "ready").unlink, True)
        code, _, err = await self._cli(self.commands.restart(self.container), timeout=self.start_timeout)
        if code != 0:
            self._running = False
            raise SandboxError(f"could not restart {self.container} to cancel its commands: {_reason(err)}")
        await self._wait_ready()

    # -- exec ---------------------------------------------------------------------------------------------------

    async def exec(self, command: list[str] | str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float | None = None, stdin: bytes | None = None,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> ExecResult:
        self._require_running()
        check_sandbox_env(env, "the exec's env")
        token = secrets.token_hex(8)
        marker = f"{SESSION_MOUNT}/{PRIVATE_DIR}/exec/{token}"
        env_file = await asyncio.to_thread(self._write_env_file, env) if env else None
        try:
            return await self._exec(command, token, marker, env_file, cwd=cwd, timeout=timeout, stdin=stdin,
                                    on_stdout=on_stdout, on_stderr=on_stderr)
        finally:
            if env_file is not None:
                env_file.unlink(missing_ok=True)

    async def _exec(self, command: list[str] | str, token: str, marker: str, env_file: Path | None, *,
                    cwd: str | None, timeout: float | None, stdin: bytes | None,
                    on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> ExecResult:
        argv = self.commands.exec(self.container, _as_command(command), marker=marker,
                                  env_file=str(env_file) if env_file is not None else None,
                                  cwd=posixpath.join(self.spec.workdir, cwd or "."))
        began = time.monotonic()
        try:
            proc = await start_process(*argv, stdin=asyncio.subprocess.PIPE,
                                       stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                       cwd=self._cli_cwd(), env=cli_env())
        except OSError as exc:
            return ExecResult(status=ExecStatus.CRASHED, reason=f"cannot run {argv[0]!r}: {exc}",
                              seconds=time.monotonic() - began)
        run = _Exec(self._private / "exec" / token, proc)
        self._execs[token] = run
        out, err = bytearray(), bytearray()
        work = asyncio.ensure_future(asyncio.gather(_pump(proc.stdout, out, on_stdout),
                                                    _pump(proc.stderr, err, on_stderr), _feed(proc, stdin)))
        try:
            try:
                await asyncio.wait_for(asyncio.shield(work), timeout)
            except TimeoutError:
                run.outcome = run.outcome or ExecStatus.TIMEOUT
                run.reason = run.reason or f"timed out after {timeout:g}s"
                await self._kill(run, work)
            await proc.wait()
        except BaseException:  # the caller was cancelled, or an output callback raised
            run.outcome = ExecStatus.CANCELLED
            await asyncio.shield(self._kill(run, work))
            raise
        finally:
            self._execs.pop(token, None)
            run.done.set()
        result = await self._result(run, bytes(out), bytes(err))
        return result.model_copy(update={"seconds": time.monotonic() - began})

    async def _kill(self, run: _Exec, work: asyncio.Future[Any]) -> None:
        """Kill the exec's process tree inside; if its client still has not ended after a grace, kill the client."""
        pid = None
        for _ in range(100):  # the wrapper writes its pid first thing; wait briefly if it has not yet
            started, pid, _ = await asyncio.to_thread(_read_markers, run.marker, False)
            if started or run.proc.returncode is not None:
                break
            await asyncio.sleep(0.02)
        if pid is not None:
            with contextlib.suppress(SandboxError, TimeoutError):
                await self._cli(self.commands.kill_tree(self.container, pid), timeout=self.KILL_GRACE)
        try:
            await asyncio.wait_for(asyncio.shield(work), self.KILL_GRACE)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                run.proc.kill()
            await work

    async def _result(self, run: _Exec, out: bytes, err: bytes) -> ExecResult:
        code = run.proc.returncode
        started, _, exit_code = await asyncio.to_thread(_read_markers, run.marker, True)
        if run.outcome is not None:
            return ExecResult(status=run.outcome, exit_code=None, stdout=out, stderr=err, reason=run.reason)
        if not started:
            return ExecResult(status=ExecStatus.CRASHED, exit_code=code, stdout=out, stderr=err,
                              reason=_reason(err) or f"the command did not start (exit {code})")
        if exit_code is not None:
            code = exit_code
        else:  # the wrapper never wrote how the command ended: the sandbox died under it, or its wrapper was killed
            found, state, _ = await self._cli(self.commands.is_running(self.container))
            if found != 0 or state.strip() != b"true":
                self._running = False
                return ExecResult(status=ExecStatus.CRASHED, exit_code=code, stdout=out, stderr=err,
                                  reason=f"the container {self.container} died while the command ran")
            # The container may still read as running for a moment after its init was killed (the runtime notices
            # its exit a little later); either way the exec's own machinery died, not the command's choice.
            return ExecResult(status=ExecStatus.CRASHED, exit_code=code, stdout=out, stderr=err,
                              reason=f"the command's wrapper in {self.container} was killed before it recorded an "
                                     f"exit code (exit {code})")
        status = ExecStatus.OK if code == 0 else ExecStatus.FAILED
        return ExecResult(status=status, exit_code=code, stdout=out, stderr=err)

    # -- files --------------------------------------------------------------------------------------------------

    async def upload(self, data: bytes | Path, dst: str) -> None:
        self._require_running()
        target = posixpath.normpath(posixpath.join(self.spec.workdir, dst))
        if target == "/":
            raise ValueError("cannot upload onto /")
        fd, archive = await asyncio.to_thread(pack_upload, data, target)
        try:
            code, _, err = await self._cli(self.commands.copy_in(self.container), stdin=fd, timeout=3600)
        finally:
            os.close(fd)
            await asyncio.to_thread(os.unlink, archive)
        if code != 0:
            raise SandboxError(f"upload to {target} failed: {_reason(err)}")

    async def download(self, src: str, dst: Path) -> None:
        self._require_running()
        source = posixpath.normpath(posixpath.join(self.spec.workdir, src))
        fd, name = await asyncio.to_thread(tempfile.mkstemp, prefix="polar-download-", suffix=".tar")
        archive = Path(name)
        try:
            try:
                code, _, err = await self._cli(self.commands.copy_out(self.container, source), stdout=fd,
                                               timeout=3600)
            finally:
                os.close(fd)
            if code != 0:
                text = err.decode(errors="replace")
                if any(s in text.lower() for s in _NOT_FOUND):
                    raise FileNotFoundError(f"{source} does not exist in {self.container}: {_reason(err)}")
                raise SandboxError(f"download of {source} failed: {_reason(err)}")
            await asyncio.to_thread(unpack_download, archive, Path(dst))
        finally:
            await asyncio.to_thread(os.unlink, archive)


async def _pump(stream: asyncio.StreamReader | None, buf: bytearray, callback: OutputCallback | None) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        buf += chunk
        if callback is not None:
            callback(chunk)


async def _feed(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    if proc.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
    proc.stdin.close()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        await proc.stdin.wait_closed()
