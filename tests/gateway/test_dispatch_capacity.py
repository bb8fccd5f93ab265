"""What a gateway registers as its capacity with a rollout server: the room of its whole pipeline, so the server
hands it the next session while a harness still runs (benchmarks/bench_scale.py found slots idle otherwise)."""

from __future__ import annotations

from polar_gym.gateway.cli import config_from_args, parse_args
from polar_gym.gateway.config import GatewayPools


def test_the_dispatch_capacity_is_every_stage_s_room() -> None:
    args = parse_args(["--run-slots", "8", "--init-workers", "3", "--ready-buffer", "2", "--postrun-workers", "5"])
    config = config_from_args(args)
    assert config.dispatch_capacity() == 8 + 3 + 2 + 5
    assert config.pools().dispatch_capacity() == config.dispatch_capacity()
    defaults = GatewayPools()
    assert defaults.dispatch_capacity() > defaults.run_slots
