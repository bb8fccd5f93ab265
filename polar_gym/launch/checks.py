"""The checks ``launch`` runs on every plug-in's config before any session, each answering ``(config path,
message)`` problems: a harness's ``AgentSpec.config`` against its ``config_model``, a builder's config against
``MergeConfig``, an evaluator's against its ``config_model``, ``runtime.options`` against the backend's request
options, and a ``_target_`` plug point's keys against its settings model or its signature.

Keys a task fills in later (the demo task's test command) may be missing here; every key that is given must be
known and of the right type.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from polar_gym.evaluate.base import Evaluator
from polar_gym.evaluate.errors import EvaluatorConfigError
from polar_gym.evaluate.registry import evaluator_class
from polar_gym.harness.base import Harness
from polar_gym.merge import MergeConfig
from polar_gym.registry import HARNESSES, RUNTIMES
from polar_gym.runtime.base import Runtime
from polar_gym.settings import Problem, error_problems

__all__ = ["builder_problems", "evaluator_problems", "harness_problems", "model_problems", "runtime_problems",
           "signature_model", "target_problems"]

_EXTRA = "extra inputs are not permitted"


def model_problems(model: type[BaseModel], data: Mapping[str, Any], where: str, *,
                   allow_missing: bool = True) -> list[Problem]:
    """The problems of ``data`` as ``model`` below ``where`` (with ``allow_missing``, required top-level keys may be
    missing: a task may fill them in)."""
    try:
        model.model_validate(dict(data))
    except ValidationError as exc:
        return error_problems([e for e in exc.errors()
                               if not (allow_missing and e["type"] == "missing" and len(e["loc"]) == 1)], where)
    return []


def harness_problems(name: str, config: Mapping[str, Any]) -> list[Problem]:
    """``harness.config`` against the harness's ``config_model``."""
    cls = HARNESSES.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Harness)):
        return [("harness.name", f"{name!r} is not a Harness subclass (polar_gym.harness.base.Harness)")]
    return model_problems(cls.config_model, config, "harness.config")


def builder_problems(config: Mapping[str, Any]) -> list[Problem]:
    """``builder.config`` against the builders' ``MergeConfig`` (every builder is called with one)."""
    model: Any = MergeConfig
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model_problems(model, config, "builder.config")
    known = {f.name for f in dataclasses.fields(model)} if dataclasses.is_dataclass(model) else set()
    problems: list[Problem] = [(f"builder.config.{k}", _EXTRA) for k in config if known and k not in known]
    if problems:
        return problems
    try:
        MergeConfig.from_dict(dict(config))
    except (TypeError, ValueError) as exc:
        return [("builder.config", str(exc))]
    return []


def evaluator_problems(strategy: str, config: Mapping[str, Any]) -> list[Problem]:
    """``evaluator.config`` against the evaluator's ``config_model``."""
    try:
        cls: type[Evaluator] = evaluator_class(strategy)
    except EvaluatorConfigError as exc:
        return [("evaluator.strategy", str(exc))]
    return model_problems(cls.config_model, config, "evaluator.config")


def runtime_problems(backend: str, options: Mapping[str, Any]) -> list[Problem]:
    """``runtime.options`` against the backend's ``request_options`` (the rest come only from the launcher)."""
    cls = RUNTIMES.get(backend)
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        return [("runtime.backend", f"{backend!r} is not a Runtime subclass (polar_gym.runtime.base.Runtime)")]
    allowed = ", ".join(sorted(cls.request_options)) or "none"
    return [(f"runtime.options.{key}", f"not an option a task may set for the {backend!r} backend (it may set: "
             f"{allowed}); options that reach the host come from launcher.runtime_options")
            for key in options if key not in cls.request_options]


def signature_model(fn: Callable[..., Any], *, skip: int = 0) -> type[BaseModel] | None:
    """A model of ``fn``'s keyword parameters (after the first ``skip``), unknown keys refused; None when ``fn``
    takes ``**kwargs`` (it accepts any key)."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: check the names only
        hints = {}
    fields: dict[str, Any] = {
        p.name: (hints.get(p.name, Any), ... if p.default is inspect.Parameter.empty else p.default)
        for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    name = getattr(fn, "__name__", "target")
    model: type[BaseModel] = create_model(f"{name}_params", __config__=ConfigDict(extra="forbid",
                                                                                 arbitrary_types_allowed=True),
                                          **fields)
    return model


def target_problems(target: Callable[..., Any], params: Mapping[str, Any], where: str, *,
                    skip: int = 0) -> list[Problem]:
    """A ``_target_`` plug point's keys: against its ``settings_model`` when it declares one, else its signature."""
    declared = getattr(target, "settings_model", None)
    if isinstance(declared, type) and issubclass(declared, BaseModel):
        return model_problems(declared, params, where, allow_missing=False)
    model = signature_model(target, skip=skip)
    return [] if model is None else model_problems(model, params, where, allow_missing=False)
