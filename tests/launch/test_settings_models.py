"""The settings models and their build functions: a setting that cannot work is a ConfigError naming the field
(never a SystemExit with a CLI flag a Hydra user never sees); each harness and evaluator declares its config keys."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from polar_gym.evaluate.examples import FinalAnswerContains
from polar_gym.evaluate.registry import evaluator_class
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayConfig, GatewayPools
from polar_gym.harness.base import Harness
from polar_gym.launch.checks import builder_problems, evaluator_problems, harness_problems, runtime_problems
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.settings import EngineSettings, ProxySettings, build_engine, build_service
from polar_gym.registry import EVALUATORS, HARNESSES
from polar_gym.settings import ConfigError, validate


def test_a_model_engine_without_upstreams_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        build_engine(InferenceSettings(engine="vllm"))
    assert info.value.keys == ["upstreams"]
    assert "engine 'vllm' needs at least one upstream URL" in str(info.value)
    with pytest.raises(ConfigError, match=r"^engine: unknown engine 'tgi'"):
        build_engine(EngineSettings(engine="tgi"))


async def test_engines_build_from_their_settings(tmp_path: Path) -> None:
    waiting = build_engine(EngineSettings(engine="vllm", await_upstreams=True))
    listed = build_engine(EngineSettings(engine="sglang", upstreams=["http://127.0.0.1:9"], upstream_timeout=5))
    try:
        assert waiting.pool.servers() == [] and [s.url for s in listed.pool.servers()] == ["http://127.0.0.1:9"]
    finally:
        await waiting.aclose()
        await listed.aclose()
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"commands": ["true"], "final_answer": "done"}))
    oracle = build_engine(EngineSettings(oracle_script=str(script), drift_every=3))
    try:
        assert isinstance(oracle, OracleEngine)
    finally:
        await oracle.aclose()
    with pytest.raises(ConfigError, match=r"^oracle_script: cannot read"):
        build_engine(EngineSettings(oracle_script=str(tmp_path / "missing.json")))
    with pytest.raises(ConfigError, match=r"^tokenizer: "):
        build_engine(EngineSettings(engine="sglang_generate", upstreams=["http://h:1"],
                                    tokenizer=str(tmp_path / "nope")))


async def test_a_service_is_built_from_proxy_settings(tmp_path: Path) -> None:
    service = build_service(ProxySettings(capture_dir=tmp_path / "cap", max_tokens_cap=64, model_names=["m"]),
                            allow_adhoc=True)
    try:
        assert service.max_tokens_cap == 64 and service.sessions.allow_adhoc
    finally:
        service.journal.close()
        await service.engine.aclose()


async def test_a_fleet_names_the_inference_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        async with local_fleet(tmp_path, InferenceSettings(engine="vllm")):
            pass
    assert info.value.keys == ["inference.upstreams"]


async def test_a_fleet_stops_without_saying_it_lost_its_server(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The gateway stops heartbeating before the rollout server stops: no "could not be reached" at every exit."""
    caplog.set_level(logging.WARNING, logger="polar_gym")
    async with local_fleet(tmp_path, InferenceSettings(), heartbeat=0.05) as (url, _token):
        assert url.startswith("http://127.0.0.1:")
        await asyncio.sleep(0.2)  # heartbeats in flight when the fleet stops (20 of them at 0.05 s)
    assert not [r.getMessage() for r in caplog.records if "could not be reached" in r.getMessage()]


def test_gateway_settings_refuse_bad_pools_and_unknown_keys() -> None:
    with pytest.raises(ValueError, match="run_slots"):
        GatewayConfig(run_slots=0)
    with pytest.raises(ConfigError) as info:
        validate(GatewayPools, {"ready_buffer": -1, "colour": "red"}, "launcher")
    assert info.value.keys == ["launcher.ready_buffer", "launcher.colour"]
    config = GatewayConfig(workdir="w", run_slots=3)
    assert config.workdir == Path("w") and config.pools() == GatewayPools(run_slots=3)


def test_every_harness_and_evaluator_declares_its_config_keys() -> None:
    for name in HARNESSES.names():
        cls = HARNESSES.get(name)
        assert issubclass(cls, Harness) and cls.config_model.model_config.get("extra") == "forbid", name
        assert harness_problems(name, {"cli_path": "/bin/x"}) == [], name
        assert harness_problems(name, {"bogus": 1}) == [("harness.config.bogus", "extra inputs are not permitted")]
    for name in EVALUATORS.names():
        assert evaluator_class(name).config_model.model_config.get("extra") == "forbid", name
        assert evaluator_problems(name, {"bogus": 1}) == [("evaluator.config.bogus",
                                                          "extra inputs are not permitted")]
    assert harness_problems("pi", {"api": "openai-responses"}) == []
    assert [k for k, _ in harness_problems("pi", {"api": "smoke-signals"})] == ["harness.config.api"]
    assert harness_problems("codex", {"mcp_servers": {"fs": {"command": "x", "args": ["-v", 1]}}}) == []
    assert [k for k, _ in harness_problems("codex", {"mcp_servers": {"fs": {"cmd": "x"}}})] == \
        ["harness.config.mcp_servers.fs.command", "harness.config.mcp_servers.fs.cmd"]
    assert evaluator_problems("polar_gym.evaluate.examples:FinalAnswerContains", {"text": "42"}) == []
    assert FinalAnswerContains.config_model.model_fields.keys() == {"text", "ignore_case"}


def test_builder_and_runtime_keys() -> None:
    assert builder_problems({"on_rerender": "merge", "keep_superseded": True}) == []
    assert builder_problems({"bogus": 1}) == [("builder.config.bogus", "extra inputs are not permitted")]
    assert runtime_problems("docker", {"shell": "bash"}) == []
    assert [k for k, _ in runtime_problems("docker", {"cli": "podman"})] == ["runtime.options.cli"]
