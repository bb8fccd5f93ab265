"""Shared wiring for whatever starts a fleet (``polar_gym.launch``, ``polar_gym.env serve``, trainer tests): the
``inference`` settings, a rollout server plus a gateway node in one event loop, and the upstream check before the
first session. Below the entry points, above the services they wire together."""

from __future__ import annotations

from polar_gym.fleet.local import local_fleet, rollout_server, write_server_info
from polar_gym.fleet.server_workers import rollout_servers, server_order
from polar_gym.fleet.settings import InferenceSettings, describe_inference
from polar_gym.fleet.upstreams import UpstreamCheck, UpstreamCheckFailed, ensure_upstreams, rollout_backends

__all__ = ["InferenceSettings", "UpstreamCheck", "UpstreamCheckFailed", "describe_inference", "ensure_upstreams",
           "local_fleet", "rollout_backends", "rollout_server", "rollout_servers", "server_order", "write_server_info"]
