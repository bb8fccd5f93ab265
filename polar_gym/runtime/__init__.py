"""Sandboxed runtimes behind one interface (local bubblewrap, docker; apptainer lives in polar_gym.apptainer)."""

from polar_gym.runtime.base import (
    GATEWAY_INNER_PORT,
    RELAY_PATH,
    SESSION_MOUNT,
    ExecResult,
    ExecStatus,
    GatewayEndpoint,
    Runtime,
)

__all__ = [
    "GATEWAY_INNER_PORT",
    "RELAY_PATH",
    "SESSION_MOUNT",
    "ExecResult",
    "ExecStatus",
    "GatewayEndpoint",
    "Runtime",
]
