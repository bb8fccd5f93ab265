"""Rootless Apptainer: the ``apptainer`` runtime backend (one instance per session) and the image builder
(definition files and Dockerfiles from one recipe, with scratch / versioned / lock caching). See docs/apptainer.md.
"""

from polar_gym.apptainer.commands import ApptainerOptions
from polar_gym.apptainer.images import BuildPlan, ImageRecipe, build, plan, render_definition, render_dockerfile
from polar_gym.apptainer.runtime import ApptainerRuntime

__all__ = [
    "ApptainerOptions",
    "ApptainerRuntime",
    "BuildPlan",
    "ImageRecipe",
    "build",
    "plan",
    "render_definition",
    "render_dockerfile",
]
