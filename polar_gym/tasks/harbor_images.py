"""The session image of a Harbor task on an image backend: ``podman build`` (or docker) of its environment
directory, tagged by the directory's content, built once and reused (the tag changes when any file does).

The command lines are pure functions; one runner executes them (tests pass a recording one).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from polar_gym.settings import ConfigError

__all__ = ["Runner", "ensure_image", "image_build_argv", "image_exists_argv", "run_command"]

#: (argv, timeout seconds) -> (exit code, output tail)
Runner = Callable[[list[str], float], tuple[int, str]]


def image_build_argv(cli: Sequence[str], tag: str, context: Path, dockerfile: Path) -> list[str]:
    """``podman build -t TAG -f DOCKERFILE CONTEXT`` (the same argv for docker)."""
    return [*cli, "build", "-t", tag, "-f", str(dockerfile), str(context)]


def image_exists_argv(cli: Sequence[str], tag: str) -> list[str]:
    """``image inspect`` answers 0 when the image is there (both CLIs have it)."""
    return [*cli, "image", "inspect", "--format", "{{.Id}}", tag]


def run_command(argv: list[str], timeout: float) -> tuple[int, str]:  # pragma: no cover - process glue
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]} is not installed"
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g}s"
    return done.returncode, (done.stdout + done.stderr)[-4000:]


def ensure_image(cli: Sequence[str], tag: str, context: Path, dockerfile: str, *, timeout: float,
                 runner: Runner = run_command) -> str:
    """``tag`` built from ``dockerfile`` (text) over ``context`` unless it exists already; ConfigError with the
    build's output otherwise. The Dockerfile is written outside the context, which stays as the task has it."""
    code, _ = runner(image_exists_argv(cli, tag), 60.0)
    if code == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="polar-harbor-build-") as tmp:
        path = Path(tmp) / "Dockerfile"
        path.write_text(dockerfile)
        argv = image_build_argv(cli, tag, context, path)
        code, output = runner(argv, timeout)
    if code != 0:
        raise ConfigError(f"building the task's image failed ({' '.join(argv)}, exit {code}):\n{output}")
    return tag
