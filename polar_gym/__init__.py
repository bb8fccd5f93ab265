"""polar_gym: agentic RL on unmodified agent harnesses."""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__`` from the package metadata (pyproject.toml is the one place it is written; scripts/setup.sh
    installs the clone editable). Looked up on first use, so importing polar_gym (as every sandbox helper and CLI
    does) does not scan site-packages. A bare source tree nobody installed says so instead of guessing a number."""
    if name != "__version__":
        raise AttributeError(f"module 'polar_gym' has no attribute {name!r}")
    from importlib import metadata

    try:
        version = metadata.version("polar_gym")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    globals()["__version__"] = version
    return version
