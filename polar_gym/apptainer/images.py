"""The image builder: one recipe (base image + Node.js + a pinned harness CLI + task dependencies) rendered from
Jinja2 templates as an Apptainer definition file (a SIF for the apptainer backend) or as a Dockerfile (an OCI image
for the docker backend).

Both outputs share one setup script (``templates/setup.sh.j2``): the definition file inlines it in ``%post``, the
Dockerfile copies it into the build and runs it. Rendering, cache keys and build command lines are pure; only
:func:`build` touches the disk and runs a builder.

Caching (``CacheMode``):

- ``scratch``: always build;
- ``versioned``: the image name carries a content key (base image, harness package@version, Node.js version,
  dependency lists, env, extra commands, and the templates' own text); an image whose sidecar JSON has the same key
  is reused. Reordering the apt/pip lists or changing labels-only metadata does not invalidate it;
- ``lock``: the key is the SHA-256 of a lock file's bytes alone (e.g. a requirements or package lock that pins the
  whole environment): identical bytes reuse the image, whatever else changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import jinja2

from polar_gym.harness.install import PINS, Pin

__all__ = [
    "DEFAULT_BASE",
    "DEFAULT_NODE_VERSION",
    "BuildPlan",
    "CacheMode",
    "ImageRecipe",
    "apptainer_build_argv",
    "build",
    "cache_key",
    "oci_build_argv",
    "plan",
    "render_definition",
    "render_dockerfile",
    "render_setup",
    "reusable",
    "split_base",
]

CacheMode = Literal["scratch", "versioned", "lock"]
ImageFormat = Literal["sif", "oci"]

DEFAULT_BASE = "docker://node:22-bookworm"
#: Node.js installed when the base image has none (claude-code at its pin needs Node >= 22 for newer releases)
DEFAULT_NODE_VERSION = "22.12.0"
NODE_PREFIX = "/opt/node"
SETUP_NAME = "polar-setup.sh"
#: apt packages for the Node.js download, and for harnesses (they shell out to git); no apt step without a need
NODE_APT = ("ca-certificates", "curl", "xz-utils")
HARNESS_APT = ("git",)


@dataclass(frozen=True)
class ImageRecipe:
    """What goes into an image. ``install_node=None`` means: only when the base's name does not say node."""

    base: str = DEFAULT_BASE
    harness: str | None = None
    node_version: str = DEFAULT_NODE_VERSION
    install_node: bool | None = None
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    post: tuple[str, ...] = ()
    workdir: str = "/workspace"
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.harness is not None and self.harness not in PINS:
            raise ValueError(f"unknown harness {self.harness!r}; pinned: {', '.join(PINS)}")
        if self.install_node is None:
            object.__setattr__(self, "install_node", "node" not in split_base(self.base)[1].split("/")[-1])

    @property
    def pin(self) -> Pin | None:
        return PINS[self.harness] if self.harness else None

    @property
    def title(self) -> str:
        pin = self.pin
        return f"{self.harness} {pin.package}@{pin.version} on {self.base}" if pin else f"no harness, on {self.base}"

    def identity(self) -> dict[str, Any]:
        """What the ``versioned`` cache key covers (order-insensitive dependency lists; labels excluded)."""
        pin = self.pin
        return {"base": self.base, "harness": f"{pin.package}@{pin.version}" if pin else None,
                "node": self.node_version if self.install_node else None, "apt": sorted(set(self.apt)),
                "pip": sorted(set(self.pip)), "env": sorted(self.env), "post": list(self.post),
                "workdir": self.workdir}


def split_base(base: str) -> tuple[str, str]:
    """``docker://node:22`` → (``docker``, ``node:22``); a ``.sif`` path → (``localimage``, path); a bare name is a
    Docker reference."""
    if "://" in base:
        scheme, _, rest = base.partition("://")
        return scheme, rest
    if base.endswith(".sif") or base.startswith(("/", "./")):
        return "localimage", base
    return "docker", base


def _dq(value: object) -> str:
    """Double-quoted for sh and Dockerfiles: ``$VAR`` still expands; quotes, backslashes and backticks do not."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return f'"{text}"'


def _env() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(lambda name: (resources.files(__package__) / "templates" / name).read_text())
    env = jinja2.Environment(loader=loader, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    env.filters["dq"] = _dq
    return env


def _templates_digest() -> str:
    folder = resources.files(__package__) / "templates"
    names = ("setup.sh.j2", "apptainer.def.j2", "Dockerfile.j2")
    return hashlib.sha256(b"".join((folder / n).read_bytes() for n in names)).hexdigest()


def cache_key(recipe: ImageRecipe, *, mode: CacheMode = "versioned", lock_bytes: bytes | None = None) -> str:
    """The content key (hex SHA-256) deciding reuse; ``scratch`` gets the versioned key (for naming only)."""
    if mode == "lock":
        if lock_bytes is None:
            raise ValueError("cache mode 'lock' needs the lock file's bytes")
        return hashlib.sha256(lock_bytes).hexdigest()
    doc = {"recipe": recipe.identity(), "templates": _templates_digest()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _labels(recipe: ImageRecipe, key: str) -> dict[str, str]:
    pin = recipe.pin
    labels = {"org.polar_gym.base": recipe.base, "org.polar_gym.key": key[:16]}
    if pin is not None:
        labels |= {"org.polar_gym.harness": recipe.harness or "", "org.polar_gym.harness.package": pin.package,
                   "org.polar_gym.harness.version": pin.version}
    if recipe.install_node:
        labels["org.polar_gym.node"] = recipe.node_version
    return labels | dict(recipe.labels)


def _environment(recipe: ImageRecipe) -> dict[str, str]:
    env = {"PATH": f"{NODE_PREFIX}/bin:$PATH"} if recipe.install_node else {}
    return env | dict(recipe.env)


def render_setup(recipe: ImageRecipe) -> str:
    """The root setup script both outputs run at build time."""
    needs = [*(NODE_APT if recipe.install_node else ()), *(HARNESS_APT if recipe.harness else ()),
             *(("python3-pip",) if recipe.pip else ())]
    apt = list(dict.fromkeys([*needs, *recipe.apt]))
    return _env().get_template("setup.sh.j2").render(recipe=recipe, pin=recipe.pin, apt_packages=apt,
                                                     node_prefix=NODE_PREFIX)


def render_definition(recipe: ImageRecipe, *, key: str | None = None) -> str:
    """The Apptainer definition file."""
    key = key or cache_key(recipe)
    bootstrap, source = split_base(recipe.base)
    return _env().get_template("apptainer.def.j2").render(
        recipe=recipe, bootstrap=bootstrap, source=source, labels=_labels(recipe, key), env=_environment(recipe),
        setup=render_setup(recipe).rstrip("\n"))


def render_dockerfile(recipe: ImageRecipe, *, key: str | None = None) -> str:
    """The Dockerfile (its build context also needs :func:`render_setup` saved as ``polar-setup.sh``)."""
    key = key or cache_key(recipe)
    bootstrap, source = split_base(recipe.base)
    if bootstrap not in ("docker", "docker-daemon"):
        raise ValueError(f"an OCI build needs a registry or daemon base image, not {recipe.base!r}")
    return _env().get_template("Dockerfile.j2").render(recipe=recipe, source=source, labels=_labels(recipe, key),
                                                       env=_environment(recipe), setup_name=SETUP_NAME)


def apptainer_build_argv(definition: Path, out: Path, *, binary: str = "apptainer", fakeroot: bool = True,
                         force: bool = True, extra: Sequence[str] = ()) -> list[str]:
    """``apptainer build --fakeroot [--force] OUT.sif DEF``."""
    return [binary, "build", *(["--fakeroot"] if fakeroot else []), *(["--force"] if force else []), *extra,
            str(out), str(definition)]


def oci_build_argv(context: Path, tag: str, *, engine: str = "podman", extra: Sequence[str] = ()) -> list[str]:
    """``docker build`` / ``podman build -t TAG -f CONTEXT/Dockerfile CONTEXT`` (same argv for both CLIs)."""
    return [engine, "build", *extra, "-t", tag, "-f", str(context / "Dockerfile"), str(context)]


@dataclass(frozen=True)
class BuildPlan:
    """Everything one build needs, decided purely: where things go, what to run, and whether to skip it."""

    recipe: ImageRecipe
    fmt: ImageFormat
    mode: CacheMode
    key: str
    out_dir: Path
    name: str
    argv: list[str]
    files: dict[str, str] = field(default_factory=dict)  # relative path → text, written before the build

    @property
    def image(self) -> Path | str:
        """The SIF path, or the OCI tag."""
        return self.out_dir / f"{self.name}.sif" if self.fmt == "sif" else self.tag

    @property
    def tag(self) -> str:
        stem = self.recipe.harness or "base"
        return f"localhost/polar-gym/{stem}:{self.name.removeprefix(stem + '-')}"

    @property
    def sidecar(self) -> Path:
        return self.out_dir / f"{self.name}.json"

    @property
    def work_dir(self) -> Path:
        return self.out_dir / f"{self.name}.build"

    def sidecar_doc(self) -> dict[str, Any]:
        return {"key": self.key, "mode": self.mode, "format": self.fmt, "image": str(self.image),
                "recipe": asdict(self.recipe), "argv": self.argv}


def plan(recipe: ImageRecipe, out_dir: Path, *, fmt: ImageFormat = "sif", mode: CacheMode = "versioned",
         lock_bytes: bytes | None = None, binary: str = "apptainer", engine: str = "podman",
         extra: Sequence[str] = ()) -> BuildPlan:
    """Decide names, files and the build command (pure)."""
    key = cache_key(recipe, mode=mode, lock_bytes=lock_bytes)
    stem = recipe.harness or "base"
    name = {"scratch": f"{stem}-scratch", "versioned": f"{stem}-{key[:12]}", "lock": f"{stem}-lock-{key[:12]}"}[mode]
    work = out_dir / f"{name}.build"
    if fmt == "sif":
        files = {"apptainer.def": render_definition(recipe, key=key)}
        argv = apptainer_build_argv(work / "apptainer.def", out_dir / f"{name}.sif.partial", binary=binary,
                                    extra=extra)
    else:
        files = {"Dockerfile": render_dockerfile(recipe, key=key), SETUP_NAME: render_setup(recipe)}
        built = BuildPlan(recipe, fmt, mode, key, out_dir, name, [])
        argv = oci_build_argv(work, built.tag, engine=engine, extra=extra)
    return BuildPlan(recipe, fmt, mode, key, out_dir, name, argv, files)


def reusable(p: BuildPlan) -> bool:
    """A previous build with the same key is there (never for ``scratch``)."""
    if p.mode == "scratch" or not p.sidecar.exists():
        return False
    try:
        doc = json.loads(p.sidecar.read_text())
    except ValueError:
        return False
    if doc.get("key") != p.key:
        return False
    return Path(p.image).exists() if p.fmt == "sif" else True


Runner = Callable[[Sequence[str]], int]


def _run_streaming(argv: Sequence[str]) -> int:  # pragma: no cover - the real builders; tests inject a runner
    return subprocess.run(list(argv), check=False).returncode


def build(p: BuildPlan, *, runner: Runner = _run_streaming) -> Path | str:
    """Build (or reuse) the image of a plan; returns the SIF path or the OCI tag. Raises ``RuntimeError`` on failure.

    The SIF is built under a ``.partial`` name and renamed when done, and the sidecar JSON is written last, so an
    interrupted build is never reused.
    """
    if reusable(p):
        return p.image
    p.work_dir.mkdir(parents=True, exist_ok=True)
    for rel, text in p.files.items():
        (p.work_dir / rel).write_text(text)
    p.sidecar.unlink(missing_ok=True)
    began = time.monotonic()
    code = runner(p.argv)
    if code != 0:
        raise RuntimeError(f"image build failed with exit code {code}: {shlex.join(p.argv)}")
    if p.fmt == "sif":
        os.replace(p.out_dir / f"{p.name}.sif.partial", p.out_dir / f"{p.name}.sif")
    doc = p.sidecar_doc() | {"seconds": round(time.monotonic() - began, 1)}
    p.sidecar.write_text(json.dumps(doc, indent=2) + "\n")
    return p.image
