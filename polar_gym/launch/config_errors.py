"""Every configuration mistake as one ``KEY: what is wrong`` line (exit 2), whoever finds it: Hydra while composing
(an unknown key, a missing group option, an override that does not parse), OmegaConf while resolving (a bad
``${...}``), pydantic while validating a settings model, or our own checks (ConfigError). Why here: Hydra reports
its own errors and exits 1, where the docs promise exit 2 and a message naming the key."""

from __future__ import annotations

import os
import re

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from pydantic import ValidationError

from polar_gym.settings import ConfigError, validation_problems
from polar_gym.trainer.settings import RETIRED_KEYS

__all__ = ["CONFIG_ERRORS", "Composition", "config_error"]

#: what :func:`config_error` turns into a ConfigError
CONFIG_ERRORS = (ConfigError, HydraException, OmegaConfBaseException, ValidationError)
_QUOTED = re.compile(r"'([^']+)'")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text.strip())


def _omegaconf(exc: OmegaConfBaseException) -> ConfigError:
    key = exc.full_key or (str(exc.key) if exc.key is not None else "")
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and "not in struct" in str(exc):
        group, _, name = key.rpartition(".")
        if group == "trainer" and name in RETIRED_KEYS:  # a key a release replaced: say by what
            return ConfigError(RETIRED_KEYS[name], key=key)
        return ConfigError(f"not a config key of polar_gym.launch (a typo? a new key takes a +: +{key}=...)", key=key)
    return ConfigError(_first_line(exc.msg or str(exc)), key=key)


def _hydra(exc: HydraException) -> ConfigError:
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf(cause)
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        known = f"; known: {', '.join(exc.options)}" if exc.options else ""
        return ConfigError(f"no option {name!r} in conf/{group or '.'}{known}", key=group or name)
    if isinstance(exc, OverrideParseException):
        key = exc.override.split("=", 1)[0].lstrip("+~")
        return ConfigError(f"the override {exc.override!r} does not parse: {_first_line(exc.message)}", key=key)
    line = _first_line(str(exc))
    quoted = _QUOTED.search(line)
    return ConfigError(line, key=quoted[1].split("=", 1)[0].lstrip("+~") if quoted else "")


def config_error(exc: BaseException) -> ConfigError:
    """``exc`` (one of :data:`CONFIG_ERRORS`) as a ConfigError naming its key."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, ValidationError):
        return ConfigError("", problems=validation_problems(exc))
    if isinstance(exc, HydraException):
        return _hydra(exc)
    if isinstance(exc, OmegaConfBaseException):
        return _omegaconf(exc)
    raise TypeError(f"not a configuration error: {type(exc).__name__}")


class Composition:
    """While Hydra composes the config (``with`` block until :meth:`composed`), its errors are raised to the caller
    instead of printed with exit 1 (``HYDRA_FULL_ERROR``); once composed, the user's choice is back, so errors of
    the run itself are reported as before, and ``done`` tells a caller the error is not the config's."""

    def __init__(self) -> None:
        self.done = False
        self._users_choice: str | None = None

    def __enter__(self) -> Composition:
        self.done = False
        self._users_choice = os.environ.get(_FULL_ERROR)
        os.environ[_FULL_ERROR] = "1"
        return self

    def composed(self) -> None:
        """The config is composed: later errors are the run's."""
        self.done = True
        self._restore()

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._users_choice is None:
            os.environ.pop(_FULL_ERROR, None)
        else:
            os.environ[_FULL_ERROR] = self._users_choice


_FULL_ERROR = "HYDRA_FULL_ERROR"
