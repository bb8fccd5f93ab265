"""The gateway node: staged session lifecycle (INIT → READY → RUNNING → POSTRUN) with a pool per stage, one
shared deadline per session, cancellation, drain and stop, hosting the proxy on the same server."""

from __future__ import annotations

from polar_gym.gateway.api import build_gateway, create_gateway_app
from polar_gym.gateway.config import GatewayConfig, ResultHook
from polar_gym.gateway.errors import (
    DeadlineExceeded,
    DuplicateSession,
    GatewayClosed,
    GatewayError,
    PrepareFailed,
    StageError,
    UnknownSession,
)
from polar_gym.gateway.node import GatewayNode, StatusListener
from polar_gym.gateway.pools import LatencyStats, Pool, UtilizationTracker
from polar_gym.gateway.sandbox import SandboxStages
from polar_gym.gateway.session import Session
from polar_gym.gateway.stages import Stages

__all__ = [
    "DeadlineExceeded",
    "DuplicateSession",
    "GatewayClosed",
    "GatewayConfig",
    "GatewayError",
    "GatewayNode",
    "LatencyStats",
    "Pool",
    "PrepareFailed",
    "ResultHook",
    "SandboxStages",
    "Session",
    "StageError",
    "Stages",
    "StatusListener",
    "UnknownSession",
    "UtilizationTracker",
    "build_gateway",
    "create_gateway_app",
]
