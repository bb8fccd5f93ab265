"""The runtime interface: one isolated sandbox per session, which the gateway starts, prepares, runs commands in
and tears down. The gateway depends on nothing else, so a task switches backend with one config value
(``RuntimeSpec.backend``: ``local``, ``docker``, ``apptainer``, or a dotted path).

Every backend mounts the session's host directory at :data:`SESSION_MOUNT` inside. Network modes:

- ``none``: loopback only;
- ``host``: the host's network (where a backend shares it, each sandbox gets its own loopback address,
  :attr:`Runtime.loopback_ip`, so harnesses that bind ports do not collide);
- ``gateway``: no network except the gateway's proxy, reachable inside at :attr:`Runtime.gateway_url` through a Unix
  socket in the session directory and a small relay on each side.

Options come from two places. The constructor's ``options`` are the operator's (the gateway's start-up
configuration, ``GatewayConfig.runtime_options``): they may name host command lines and host paths (docker ``cli``
and ``run_args``, the apptainer ``binary``, ``ro_binds``...). ``RuntimeSpec.options`` come with a session request, so
a backend accepts there only the keys in its :attr:`Runtime.request_options` (none of which reaches a host command
line); any other key is refused with :class:`~polar_gym.runtime.errors.RuntimeOptionError` before anything runs.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from polar_gym.runtime.errors import RuntimeOptionError
from polar_gym.schema import RuntimeSpec

__all__ = [
    "GATEWAY_INNER_PORT",
    "RELAY_PATH",
    "SESSION_MOUNT",
    "ExecResult",
    "ExecStatus",
    "GatewayEndpoint",
    "OutputCallback",
    "Runtime",
    "request_option_error",
]

#: where the per-session host directory appears inside every sandbox
SESSION_MOUNT = "/polar"
#: the port the gateway's proxy answers on inside a sandbox in ``gateway`` mode (127.0.0.1)
GATEWAY_INNER_PORT = 18080
#: where backends mount the sandbox helper (gateway relay + in-sandbox limits, polar_gym/runtime/relay.c) read-only
RELAY_PATH = f"{SESSION_MOUNT}/.bin/relay"

OutputCallback = Callable[[bytes], None]


@dataclass(frozen=True)
class GatewayEndpoint:
    """Where the gateway's proxy listens on the host."""

    host: str
    port: int


class ExecStatus(str, enum.Enum):
    OK = "ok"  # exit code 0
    FAILED = "failed"  # non-zero exit code
    TIMEOUT = "timeout"  # killed at the timeout; output so far kept
    CANCELLED = "cancelled"  # killed by cancel() or stop()
    CRASHED = "crashed"  # the sandbox itself died or could not run the command


class ExecResult(BaseModel):
    status: ExecStatus
    exit_code: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    seconds: float = 0.0
    reason: str | None = None
    #: processes of the sandbox the kernel's OOM killer ended while this exec ran (0 where the backend cannot tell)
    oom_kills: int = 0

    @property
    def ok(self) -> bool:
        return self.status is ExecStatus.OK

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")


class Runtime(abc.ABC):
    """One sandbox. Use as ``async with backend(spec, session_dir) as rt: await rt.exec([...])``.

    ``stop`` is idempotent and leaves no process, mount or container behind; ``cancel`` kills every running command
    (whole process trees) but keeps the sandbox; a crashed sandbox is reported (ExecStatus.CRASHED or an error),
    never hangs the caller. State that outlives a command lives in files (the workdir, HOME, the session dir).
    Whether a process a command leaves in the background outlives that command depends on the backend (``local``:
    no, each exec has its own pid namespace; ``docker`` / ``apptainer``: yes, until ``cancel`` or ``stop``), so
    callers must not rely on either.
    """

    name: ClassVar[str]
    #: the ``RuntimeSpec.options`` keys a session request may set (see the module docstring); the rest come only
    #: from the constructor's ``options``
    request_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, spec: RuntimeSpec, session_dir: str | Path, *, gateway: GatewayEndpoint | None = None,
                 options: dict[str, Any] | None = None) -> None:
        error = request_option_error(type(self), spec.options)
        if error is not None:
            raise RuntimeOptionError(error)
        self.spec = spec
        self.session_dir = Path(session_dir)
        self.gateway = gateway
        #: the request's options, overridden by the operator's
        self.options = {**spec.options, **(options or {})}
        self.loopback_ip: str | None = None

    @property
    def gateway_url(self) -> str:
        """The proxy's base URL as seen from inside the sandbox."""
        if self.spec.network == "gateway":
            return f"http://127.0.0.1:{GATEWAY_INNER_PORT}"
        if self.gateway is None:
            raise ValueError("this runtime was not given a gateway endpoint")
        return f"http://{self.gateway.host}:{self.gateway.port}"

    @abc.abstractmethod
    async def start(self) -> None:
        """Create the sandbox (and run nothing of the task yet)."""

    @abc.abstractmethod
    async def exec(self, command: list[str] | str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float | None = None, stdin: bytes | None = None,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> ExecResult:
        """Run ``command`` (argv, or a string for ``sh -c``) inside; stream output to the callbacks as it comes."""

    @abc.abstractmethod
    async def upload(self, data: bytes | Path, dst: str) -> None:
        """Write bytes, a host file or a host directory (recursively) to ``dst`` inside."""

    @abc.abstractmethod
    async def download(self, src: str, dst: Path) -> None:
        """Copy the file or directory ``src`` inside to the host path ``dst``."""

    @abc.abstractmethod
    async def cancel(self) -> None:
        """Kill every running command and its whole process tree; the sandbox stays usable."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Tear everything down. Idempotent; safe after a crash or a failed start."""

    async def __aenter__(self) -> Runtime:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def request_option_error(backend: type[Runtime], options: dict[str, Any]) -> str | None:
    """Why a session request may not carry these ``runtime.options`` for ``backend`` (None when it may)."""
    refused = sorted(set(options) - backend.request_options)
    if not refused:
        return None
    allowed = ", ".join(sorted(backend.request_options)) or "none"
    return (f"runtime.options {', '.join(map(repr, refused))} cannot come from a session request for the "
            f"{getattr(backend, 'name', backend.__name__)!r} backend: such options reach the host's command line or "
            f"file system, so only the gateway's own start-up configuration may set them "
            f"(GatewayConfig.runtime_options); a request may set: {allowed}")
