"""The generated reference pages (docs/reference/) follow the code: each is what its generator writes now, the
configuration page holds every registered plug-in's settings from its own model, and the HTTP page lists every route
of the three apps, with the model routes the schemas leave out described by hand."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel

from polar_gym.evaluate.registry import evaluator_class
from polar_gym.fleet.settings import InferenceSettings
from polar_gym.launch import http_reference, reference
from polar_gym.merge import MergeConfig
from polar_gym.proxy.routes.models import MODEL_ROUTES
from polar_gym.registry import BUILDERS, ENGINES, EVALUATORS, HARNESSES, PARSERS, PROVIDERS, RUNTIMES, Registry
from polar_gym.web import route_table
from tests.docs._blocks import ROOT

CONFIG = ROOT / "docs" / "reference" / "configuration.md"
HTTP = ROOT / "docs" / "reference" / "http.md"


def test_the_configuration_page_and_conf_readme_are_current() -> None:
    assert reference.PAGE == CONFIG
    assert reference.check(CONFIG), "run `python -m polar_gym.launch.reference --write`"
    assert reference.check(reference.README), "run `python -m polar_gym.launch.reference --write`"


def test_the_http_page_is_current() -> None:
    assert http_reference.PAGE == HTTP
    assert http_reference.check(HTTP), "run `python -m polar_gym.launch.http_reference --write`"


def _section(page: str, heading: str) -> str:
    """The text from ``heading`` to the next heading or per-plug-in title."""
    start = page.index(heading) + len(heading)
    end = re.compile(r"^(#{1,6} |`\w+\.config` of )", re.M).search(page, start)
    return page[start:end.start() if end else len(page)]


def _keys(model: type[BaseModel], prefix: str) -> list[str]:
    return [f"`{prefix}.{field.alias or name}`" for name, field in model.model_fields.items()]


@pytest.mark.parametrize("name", HARNESSES.names())
def test_every_harness_config_key_is_on_the_configuration_page(name: str) -> None:
    section = _section(CONFIG.read_text(), f"`harness.config` of `{name}`:")
    missing = [key for key in _keys(HARNESSES.get(name).config_model, "harness.config") if key not in section]
    assert not missing, f"{name}: {missing}"


@pytest.mark.parametrize("name", EVALUATORS.names())
def test_every_evaluator_config_key_is_on_the_configuration_page(name: str) -> None:
    section = _section(CONFIG.read_text(), f"`evaluator.config` of `{name}`:")
    model = evaluator_class(name).config_model
    # a key holding a model is listed by its own keys (`evaluator.config.outcome.strategy`)
    missing = [key for key in _keys(model, "evaluator.config") if key not in section and key[:-1] + "." not in section]
    assert not missing and (model.model_fields or "(no keys)" in section), f"{name}: {missing}"


def test_builder_engine_and_runtime_settings_are_on_the_configuration_page() -> None:
    page = CONFIG.read_text()
    builder = _section(page, "### builder")
    assert all(f"`builder.config.{name}`" in builder for name in MergeConfig.__dataclass_fields__)
    assert "`builder.config.include_side_requests`" in builder
    inference = _section(page, "### inference")
    assert all(key in inference for key in _keys(InferenceSettings, "inference"))
    runtime = _section(page, "### runtime")
    for name in RUNTIMES.names():
        options = RUNTIMES.get(name).request_options
        assert re.search(rf"{name}: {', '.join(sorted(options)) or 'none'}[;.]", runtime), name


@pytest.mark.parametrize(("kind", "registry"), [("harness", HARNESSES), ("runtime", RUNTIMES), ("builder", BUILDERS),
                                                ("evaluator", EVALUATORS), ("engine", ENGINES),
                                                ("output parser", PARSERS), ("provider", PROVIDERS)])
def test_every_registered_plugin_is_listed_under_its_kind(kind: str, registry: Registry[Any]) -> None:
    row = next(line for line in CONFIG.read_text().splitlines() if line.startswith(f"| {kind} |"))
    assert all(f"`{name}`" in row for name in registry.names()), row


def test_every_task_source_has_its_keys_on_the_configuration_page() -> None:
    page = CONFIG.read_text()
    for source in sorted((ROOT / "conf" / "tasks").glob("*.yaml")):
        assert f"### tasks={source.stem}" in page, source.stem


def test_every_route_of_the_three_apps_is_on_the_http_page() -> None:
    page = HTTP.read_text().partition(http_reference.MARKER)[2]
    missing = []
    for title, _, factory in http_reference.APPS:
        app = factory()
        schema_paths = set(app.openapi()["paths"])
        section = _section(page, f"\n## {title}\n")
        for route in route_table(app):
            if route.path not in schema_paths or route.path in {"/openapi.json", "/docs", "/redoc"}:
                continue
            for method in route.methods - {"HEAD"}:
                if f"| {method} | `{route.path}` | {'yes' if route.admin else 'no'} |" not in section:
                    missing.append(f"{title}: {method} {route.path}")
    assert not missing, missing


def test_the_model_routes_left_out_of_the_schemas_are_described_by_hand() -> None:
    head = HTTP.read_text().partition(http_reference.MARKER)[0]
    for path in [*MODEL_ROUTES, "/v1/messages/count_tokens", ":generateContent", ":streamGenerateContent",
                 ":countTokens"]:
        assert path in head, path
    for where in ("Authorization: Bearer", "x-api-key", "x-goog-api-key", "?key=", "x-admin-token"):
        assert where in head, where
