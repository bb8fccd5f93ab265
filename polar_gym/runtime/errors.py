"""Runtime errors.

    SandboxError
    ├── SandboxUnavailable   the backend's tool is missing (bwrap, docker, apptainer): says how to get it
    ├── SandboxStartError    the sandbox could not be created
    │   └── RuntimeOptionError   a session request set a runtime option only the gateway's own configuration may set
    ├── SandboxEnvError      an environment the sandbox cannot be given: a name a loader or engine reads (LD_*, ...),
    │                        or a value the backend's format cannot carry (a newline in a docker env file)
    └── SandboxStateError    an operation on a sandbox that is not running
"""

from __future__ import annotations

__all__ = ["RuntimeOptionError", "SandboxEnvError", "SandboxError", "SandboxStartError", "SandboxStateError",
           "SandboxUnavailable"]


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


class SandboxEnvError(SandboxError, ValueError):
    pass
