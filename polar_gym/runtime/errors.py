"""Runtime errors.

    SandboxError
    ├── SandboxUnavailable   the backend's tool is missing (bwrap, docker, apptainer): says how to get it
    ├── SandboxStartError    the sandbox could not be created
    │   └── RuntimeOptionError   a session request set a runtime option only the gateway's own configuration may set
    └── SandboxStateError    an operation on a sandbox that is not running
"""

from __future__ import annotations

__all__ = ["RuntimeOptionError", "SandboxError", "SandboxStartError", "SandboxStateError", "SandboxUnavailable"]


class SandboxError(Exception):
    pass


class SandboxUnavailable(SandboxError):
    pass


class SandboxStartError(SandboxError):
    pass


class SandboxStateError(SandboxError):
    pass


class RuntimeOptionError(SandboxStartError, ValueError):
    pass
