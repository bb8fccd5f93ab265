"""Finding and building evaluators by name: a registered strategy or a user's dotted path (``pkg.module:Class``).

Why a helper over ``EVALUATORS.get``: the gateway needs a ready instance (config validated once, up front) and a
clear error when a dotted path names something that is not an :class:`Evaluator`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from polar_gym.evaluate.base import Evaluator
from polar_gym.evaluate.errors import EvaluatorConfigError
from polar_gym.registry import EVALUATORS, RegistryError
from polar_gym.schema import EvaluatorSpec

__all__ = ["evaluator_class", "load_evaluator", "register_evaluator"]


def evaluator_class(strategy: str) -> type[Evaluator]:
    """The class behind a strategy name or dotted path."""
    try:
        target = EVALUATORS.get(strategy)
    except RegistryError as exc:
        raise EvaluatorConfigError(str(exc)) from exc
    if not (isinstance(target, type) and issubclass(target, Evaluator)):
        raise EvaluatorConfigError(f"evaluator {strategy!r} resolves to {target!r}, which is not an Evaluator "
                                   "subclass (polar_gym.evaluate.base.Evaluator)")
    return target


def load_evaluator(spec: EvaluatorSpec | str, config: dict[str, Any] | None = None) -> Evaluator:
    """An evaluator instance for ``spec`` (its strategy and config), or for a bare name plus ``config``."""
    if isinstance(spec, str):
        spec = EvaluatorSpec(strategy=spec, config=config or {})
    cls = evaluator_class(spec.strategy)
    raw = spec.config  # a model after validation; a plain dict after an unvalidated model_copy(update=...)
    return cls(raw.model_dump() if isinstance(raw, BaseModel) else dict(raw))


def register_evaluator(name: str, target: str | type[Evaluator]) -> None:
    """Make ``name`` usable as a strategy (target: a class or a ``pkg.module:Class`` string, imported lazily)."""
    EVALUATORS.register(name, target)
