"""The offline-built image the docker-runtime tests build their session images FROM: no registry is reachable here,
so a task's Dockerfile is rewritten FROM an image polar_gym built from Debian's archive and npm."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from polar_gym.apptainer.offline import OfflineRecipe

__all__ = ["image_with_pi"]


def image_with_pi() -> str:
    """A local image that carries pi: the pi-only one (tests/runtime/test_harness_images.py builds it) or else the
    default harness image (``bash scripts/setup.sh`` builds it), so a test that needs one runs on a fresh machine
    whatever order the tests run in. Skips where podman, runc or both images are missing."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("podman and runc are needed for runtime=docker (bash scripts/setup.sh installs them)")
    for recipe in (OfflineRecipe(harnesses=("pi",)), OfflineRecipe()):
        found = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", recipe.tag],
                               capture_output=True, text=True, timeout=60)
        if found.returncode == 0:
            return recipe.tag
    pytest.skip("no offline image with pi: `bash scripts/setup.sh` builds the harness image, or build one with "
                "`python -m polar_gym.apptainer build --offline --format oci --harness pi`")
