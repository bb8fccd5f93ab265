"""``network="gateway"`` for Apptainer: the instance has its own network namespace with loopback only
(``--net --network none``), and the shared relay (:mod:`polar_gym.runtime.relay`) joins it to the gateway.

Host side, :class:`~polar_gym.runtime.relay.GatewayRelay` serves ``<session>/gateway.sock`` (``/polar/gateway.sock``
inside) and forwards to the gateway's TCP endpoint. Inside, the relay helper is bound read-only at
:data:`~polar_gym.apptainer.commands.RELAY_INNER` and started by one exec after ``instance start``: it listens on
``127.0.0.1:GATEWAY_INNER_PORT``, forks its forwarder (which lives in the instance's PID namespace until the instance
stops) and execs ``true``, so the exec returns once the port is open.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_gym.apptainer.commands import RELAY_INNER
from polar_gym.runtime.base import SESSION_MOUNT, Runtime
from polar_gym.runtime.errors import SandboxStartError
from polar_gym.runtime.relay import GatewayRelay, helper_argv, relay_program

__all__ = ["ApptainerRelay", "relay_start_argv"]


def relay_start_argv() -> list[str]:
    """The command, run inside, that opens the gateway port and leaves the forwarder running."""
    return helper_argv(RELAY_INNER, ["true"], gateway=True)


class ApptainerRelay:
    """Both halves of the relay for one instance (``runtime`` runs the inner half; typed as the base class, so this
    module does not import the Apptainer runtime that uses it)."""

    def __init__(self, runtime: Runtime, instance: str, program: Path, host: GatewayRelay) -> None:
        self.runtime = runtime
        self.instance = instance
        self.program = program
        self.host = host

    @classmethod
    async def open(cls, runtime: Runtime, instance: str) -> ApptainerRelay:
        """Start the host half and prepare the bind (call before ``instance start``)."""
        if runtime.gateway is None:
            raise SandboxStartError('network="gateway" needs the gateway endpoint (Runtime(..., gateway=...))')
        program = await asyncio.to_thread(relay_program)  # may compile relay.c once: blocking
        placeholder = runtime.session_dir / RELAY_INNER.removeprefix(f"{SESSION_MOUNT}/")
        placeholder.parent.mkdir(parents=True, exist_ok=True)
        placeholder.touch()
        host = GatewayRelay(runtime.session_dir, runtime.gateway)
        await host.start()
        return cls(runtime, instance, program, host)

    async def start_inner(self) -> None:
        result = await self.runtime.exec(relay_start_argv(), cwd="/", timeout=60.0)
        if not result.ok:
            raise SandboxStartError(f"the gateway relay did not start in {self.instance} "
                                    f"({result.status.value}, exit {result.exit_code}): {result.stderr[-2000:]!r}")

    async def close(self) -> None:
        await self.host.stop()
