"""The public surface of polar_gym.telemetry: every module's ``__all__`` names what it defines, and importing it
loads none of the metrics packages (they are imported only when configured)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MODULES = ["polar_gym.telemetry", "polar_gym.telemetry.settings", "polar_gym.telemetry.sinks",
           "polar_gym.telemetry.spans", "polar_gym.telemetry.file_export", "polar_gym.gateway.telemetry",
           "polar_gym.launch.run_metrics"]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)


def test_importing_the_package_loads_no_metrics_package() -> None:
    """(opentelemetry's API alone comes with other dependencies of the gateway; its SDK and exporter do not.)"""
    code = ("import sys, polar_gym.telemetry, polar_gym.gateway, polar_gym.launch.run_metrics; "
            "print([m for m in sys.modules if m.startswith(('wandb', 'tensorboardX', 'opentelemetry.sdk', "
            "'opentelemetry.exporter'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
