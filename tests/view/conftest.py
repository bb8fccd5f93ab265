"""The live-server tests of this folder use the rollout server kit's ``harness`` fixture."""

from tests.server._server_kit import harness  # noqa: F401
