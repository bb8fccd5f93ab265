"""The ``inference`` settings of a fleet: the proxy's engine plus what the fleet does with it (a token cap, the
upstream check before the first session)."""

from __future__ import annotations

from pydantic import Field

from polar_gym.proxy.settings import EngineSettings, describe_mode
from polar_gym.settings import ConfigError

__all__ = ["InferenceSettings", "describe_inference"]


class InferenceSettings(EngineSettings):
    """The ``inference`` group (and ``python -m polar_gym.env serve``'s flags): which engine the gateway's proxy
    uses, where it finds the model, and how the upstreams are checked before the first session."""

    max_tokens_cap: int | None = Field(default=None, ge=1, description="clamp every call's max_tokens to this "
                                       "(null: no clamp)")
    preflight: bool = Field(default=True, description="probe every upstream (GET /v1/models) before the first "
                            "session; a bad one stops the launch (exit code 3)")
    preflight_timeout: float = Field(default=10.0, gt=0, description="seconds one probe may take")
    preflight_token_timeout: float = Field(default=60.0, gt=0, description="token_in: seconds the token-prompt "
                                           "probe may take (one sampled token, often a new engine's first "
                                           "forward pass, slow on a busy CPU node)")
    upstream_wait_seconds: float = Field(default=600.0, ge=0, description="with await_upstreams: how long the "
                                         "launch waits for its upstreams (or a /backends entry) before the first "
                                         "session")


def describe_inference(inference: InferenceSettings, role: str = "launch") -> str:
    """The one line a launch prints about its inference: engine, prompt mode and why, upstreams (the line the
    proxy and the gateway node start with); ConfigError naming ``inference.*`` when the mode cannot work."""
    try:
        return describe_mode(inference, role)
    except ConfigError as exc:
        raise exc.under("inference") from None
