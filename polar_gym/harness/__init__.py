"""Harness adapters: pinned installs of agent CLIs, their config files, environment and run command.

Exports resolve lazily, so ``python -m polar_gym.harness.install`` runs the module only once. The adapters
themselves are found by name through ``polar_gym.registry.HARNESSES``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PINS", "Harness", "HarnessContext", "HarnessInstallError", "Pin", "cli_paths", "ensure_installed",
           "install_dir"]

_HOMES = {"Harness": "base", "HarnessContext": "base"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"polar_gym.harness.{_HOMES.get(name, 'install')}"), name)
    raise AttributeError(f"module 'polar_gym.harness' has no attribute {name!r}")
