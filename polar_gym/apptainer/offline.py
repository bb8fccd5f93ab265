"""Harness images built offline from what set-up cached: a Debian base from Debian's own packages plus the pinned CLIs.

No image registry is needed. The base is a ``--variant=minbase`` root filesystem of :data:`BASE_PACKAGES` (git,
python3, bash, coreutils and what Node.js links against) from the host's apt mirror, imported with ``<engine>
import`` under a tag keyed by its package list: made by debootstrap as root, by ``mmdebstrap --mode=unshare`` as a
user (:mod:`polar_gym.apptainer.rootless`: no root step at all). A harness image is that base plus the host's ``node``
binary (else the Node.js wheel's) and the npm dependency closure of the chosen CLIs, copied from the cached install
(:func:`polar_gym.harness.install.install_dir`), with their binaries on PATH. The same :class:`OfflineRecipe`
renders the Dockerfile (``podman build``) and the Apptainer definition (``Bootstrap: debootstrap``, ``%files``).

Pure: :func:`apt_source`, :func:`npm_closure`, the keys, tags and renderers. I/O: :func:`stage_context`,
:func:`ensure_base`, :func:`build_oci`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_gym.apptainer.rootless import fetch_mmdebstrap, find_mmdebstrap, mmdebstrap_argv
from polar_gym.assets import cache_root, node_bin_dir
from polar_gym.harness.install import PINS, install_dir, pins_hash
from polar_gym.harness.pyinstall import PY_PINS, base_prefix, find_python, py_install_dir
from polar_gym.runtime.testimage import import_argv

__all__ = [
    "ALL_HARNESSES",
    "BASE_PACKAGES",
    "HARNESS_PREFIX",
    "IMAGE_PY_HARNESSES",
    "OfflineRecipe",
    "apt_source",
    "build_oci",
    "build_sif",
    "debootstrap_argv",
    "default_image",
    "ensure_base",
    "host_apt_source",
    "image_pins_hash",
    "npm_closure",
    "render_offline_definition",
    "render_offline_dockerfile",
    "sif_path",
    "stage_context",
]

#: what the demo and SWE-style tasks and the harnesses need besides Node.js (libstdc++6: the node binary links it)
BASE_PACKAGES = ("bash", "ca-certificates", "coreutils", "git", "libstdc++6", "procps", "python3")
#: bump when the way the base is made changes (its key, hence its tag, changes with it)
BASE_RECIPE_VERSION = "1"
#: bump when what stage_context puts in an image changes (its key changes: a built image is not reused)
LAYOUT_VERSION = "2"
HARNESS_PREFIX = "/opt/polar-harness"
IMAGE_PY_HARNESSES = tuple(sorted(PY_PINS))
ALL_HARNESSES = tuple(sorted([*PINS, *IMAGE_PY_HARNESSES]))
#: ``bin``: the Python harnesses' binaries and the wrappers of CLIs run with a Node.js of their own
IMAGE_PATH = (f"{HARNESS_PREFIX}/bin:{HARNESS_PREFIX}/node_modules/.bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
              "/usr/bin:/sbin:/bin")

Runner = Callable[[Sequence[str]], int]


def apt_source(texts: Iterable[str]) -> tuple[str, str]:
    """(mirror URL, suite) of the first Debian main archive in apt source files (one-line or deb822 format)."""
    for text in texts:
        uris = re.findall(r"^URIs:\s*(\S+)", text, re.M)
        suites = re.findall(r"^Suites:\s*(\S+)", text, re.M)
        for uri, suite in zip(uris, suites, strict=False):
            if "security" not in uri and "security" not in suite:
                return uri, suite
        for line in text.splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line).split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1], parts[2]
    raise ValueError("no Debian archive found in the apt sources (need a 'deb URL SUITE main' entry)")


def host_apt_source() -> tuple[str, str]:
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    return apt_source(f.read_text() for f in files if f.is_file())


@dataclass(frozen=True)
class OfflineRecipe:
    """An offline harness image: which CLIs, on which Debian base."""

    harnesses: tuple[str, ...] = ALL_HARNESSES
    mirror: str = "http://deb.debian.org/debian"
    suite: str = "bookworm"
    packages: tuple[str, ...] = BASE_PACKAGES

    def __post_init__(self) -> None:
        unknown = [h for h in self.harnesses if h not in ALL_HARNESSES]
        if unknown or not self.harnesses:
            raise ValueError(f"unknown harness {', '.join(unknown) or '(none)'}; an offline image can carry: "
                             f"{', '.join(ALL_HARNESSES)}")
        object.__setattr__(self, "harnesses", tuple(sorted(set(self.harnesses))))

    @property
    def base_key(self) -> str:
        doc = {"suite": self.suite, "mirror": self.mirror, "packages": sorted(set(self.packages)),
               "version": BASE_RECIPE_VERSION}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def base_tag(self) -> str:
        return f"localhost/polar-gym/base:{self.suite}-{self.base_key[:12]}"

    @property
    def name(self) -> str:
        return "harnesses" if self.harnesses == ALL_HARNESSES else "-".join(self.harnesses).replace("_", "-")

    @property
    def key(self) -> str:
        """Covers the base, the CLI pins and the templates: a harness image with the same key is reused."""
        doc: dict[str, Any] = {"base": self.base_key, "pins": {h: _spec(h) for h in self.harnesses},
                               "path": IMAGE_PATH, "template": _DOCKERFILE, "layout": LAYOUT_VERSION,
                               "on_path": {h: PY_PINS[h].on_path for h in self.harnesses if h in PY_PINS},
                               "node": {h: PINS[h].node_major for h in self.harnesses if h in PINS}}
        if self.left_out():
            doc["left_out"] = self.left_out()
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def tag(self) -> str:
        """Named by the pins (the all-CLI image's tag is what ``conf/runtime/docker.yaml`` names)."""
        return f"localhost/polar-gym/{self.name}:{image_pins_hash()}"

    def left_out(self) -> dict[str, str]:
        """The Python harnesses of the recipe this machine cannot carry, with why: no interpreter of the version
        they need (a user's machine without pyenv's 3.12: the OpenHands SDK). The image keeps its tag and goes
        without them; a session of one fails with harness_not_run, its reason in the image's labels."""
        return {h: f"needs Python {PY_PINS[h].python}, which this machine does not have" for h in self.harnesses
                if h in PY_PINS and find_python(PY_PINS[h].python) is None}

    def labels(self) -> dict[str, str]:
        labels = {"org.polar_gym.key": self.key[:16], "org.polar_gym.base": self.base_tag,
                  "org.polar_gym.harnesses": ",".join(f"{h}={_spec(h)}" for h in self.harnesses
                                                      if h not in self.left_out())}
        if self.left_out():
            labels["org.polar_gym.left_out"] = "; ".join(f"{h}: {why}" for h, why in self.left_out().items())
        return labels


def _spec(harness: str) -> str:
    """``package@version`` of an npm CLI, ``package==version`` (and its other pins) of a Python harness."""
    if harness in PINS:
        return f"{PINS[harness].package}@{PINS[harness].version}"
    return "+".join(PY_PINS[harness].requirements())


def image_pins_hash() -> str:
    """The images' tag: a digest of every pin an image may carry (the npm CLIs' and the Python harnesses')."""
    doc = {"npm": pins_hash(), "python": {h: _spec(h) for h in IMAGE_PY_HARNESSES}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def default_image() -> str:
    """The all-CLI image's tag: ``runtime=docker``'s default image."""
    return OfflineRecipe().tag


def debootstrap_argv(recipe: OfflineRecipe, target: Path) -> list[str]:
    return ["debootstrap", "--variant=minbase", f"--include={','.join(sorted(set(recipe.packages)))}",
            recipe.suite, str(target), recipe.mirror]


def npm_closure(packages: Mapping[str, Any], roots: Iterable[str]) -> list[str]:
    """The ``node_modules/...`` paths (package-lock v2/v3 ``packages`` keys) the root packages need at run time,
    resolved as Node does (nearest ``node_modules`` up the tree). Optional dependencies absent from the lock (other
    platforms') are skipped."""

    def resolve(origin: str, dep: str) -> str | None:
        base = origin
        while True:
            candidate = f"{base}/node_modules/{dep}"
            if candidate in packages:
                return candidate
            cut = base.rfind("/node_modules/")
            if cut < 0:
                top = f"node_modules/{dep}"
                return top if top in packages else None
            base = base[:cut]

    seen: set[str] = set()
    stack = [f"node_modules/{r}" for r in roots]
    while stack:
        path = stack.pop()
        if path in seen or path not in packages:
            continue
        seen.add(path)
        entry = packages[path]
        deps = {**entry.get("dependencies", {}), **entry.get("optionalDependencies", {}),
                **entry.get("peerDependencies", {})}
        stack += [found for dep in deps if (found := resolve(path, dep)) is not None]
    return sorted(seen)


_DOCKERFILE = """\
# rendered by polar_gym.apptainer.offline ({title}); build context: this file's directory (staged offline)
FROM {base}
{labels}
COPY node /usr/local/bin/node
COPY node_modules {prefix}/node_modules
COPY bin {prefix}/bin
COPY nodes {prefix}/nodes
COPY py {prefix}/py
COPY pythons {prefix}/pythons
COPY ld.so.conf /etc/ld.so.conf.d/polar-harness.conf
RUN ldconfig
ENV PATH={path}
WORKDIR /workspace
"""

_DEFINITION = """\
Bootstrap: debootstrap
OSVersion: {suite}
MirrorURL: {mirror}
Include: {packages}

%labels
{labels}

%files
    {context}/node /usr/local/bin/node
    {context}/node_modules {prefix}/node_modules
    {context}/bin {prefix}/bin
    {context}/nodes {prefix}/nodes
    {context}/py {prefix}/py
    {context}/pythons {prefix}/pythons
    {context}/ld.so.conf /etc/ld.so.conf.d/polar-harness.conf

%environment
    export PATH={path}

%post
    ldconfig
    mkdir -p /polar /workspace
    rm -rf /var/cache/apt/archives/*.deb /var/lib/apt/lists/*
"""


def _title(recipe: OfflineRecipe) -> str:
    return ", ".join(f"{h} {_spec(h)}" for h in recipe.harnesses)


def render_offline_dockerfile(recipe: OfflineRecipe) -> str:
    labels = "\n".join(f'LABEL {k}="{v}"' for k, v in recipe.labels().items())
    return _DOCKERFILE.format(title=_title(recipe), base=recipe.base_tag, labels=labels, prefix=HARNESS_PREFIX,
                              path=IMAGE_PATH)


def render_offline_definition(recipe: OfflineRecipe, context: Path) -> str:
    """The Apptainer definition of the same image (its ``%files`` come from a context staged by
    :func:`stage_context`)."""
    labels = "\n".join(f"    {k} {v}" for k, v in recipe.labels().items())
    return _DEFINITION.format(suite=recipe.suite, mirror=recipe.mirror, packages=",".join(sorted(set(
        recipe.packages))), labels=labels, context=context, prefix=HARNESS_PREFIX, path=IMAGE_PATH)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage_context(recipe: OfflineRecipe, context: Path, *, npm_dir: Path | None = None,
                  node: str | None = None) -> Path:
    """Fill ``context`` with the node binary and the CLIs' closure from the cached install (hard links where the
    file system allows). Raises ``RuntimeError`` when set-up has not cached them."""
    npm_dir = npm_dir or install_dir(cache_root=os.environ.get("POLAR_CACHE"))
    lock = npm_dir / "package-lock.json"
    if not lock.is_file():
        raise RuntimeError(f"no cached harness CLIs at {npm_dir}: run `python -m polar_gym.harness.install` "
                           "(bash scripts/setup.sh does)")
    wheel_node = node_bin_dir() / "node"
    node = node or shutil.which("node") or (str(wheel_node) if wheel_node.is_file() else None)
    if node is None:
        raise RuntimeError("no node binary to copy into the image: neither on PATH nor the Node.js wheel's "
                           "(python -m polar_gym.assets node)")
    shutil.rmtree(context, ignore_errors=True)
    for folder in ("node_modules/.bin", "bin", "nodes", "py", "pythons"):
        (context / folder).mkdir(parents=True)
    (context / "ld.so.conf").write_text("")
    _link_or_copy(os.path.realpath(node), str(context / "node"))
    npm = [h for h in recipe.harnesses if h in PINS]
    packages = json.loads(lock.read_text()).get("packages", {})
    for rel in npm_closure(packages, [PINS[h].package for h in npm]):
        src = npm_dir / rel
        if not src.is_dir():
            continue
        shutil.copytree(src, context / rel, symlinks=True, copy_function=_link_or_copy,
                        ignore=lambda d, names, top=str(src): ["node_modules"] if d == top else [])
    for h in npm:
        link = npm_dir / "node_modules" / ".bin" / PINS[h].binary
        os.symlink(os.readlink(link), context / "node_modules" / ".bin" / PINS[h].binary)
        major = PINS[h].node_major
        if major is not None:
            _stage_node(context, npm_dir / PINS[h].node, major, PINS[h].binary)
    for h in recipe.harnesses:
        if h in PY_PINS and h not in recipe.left_out():
            _stage_venv(context, h)
    return context


def _stage_node(context: Path, node: Path, major: int, binary: str) -> None:
    """A CLI that needs Node.js ``major``: that node at ``nodes/node-MAJOR/bin/node`` and a wrapper ``bin/BINARY``
    that puts it first on PATH (the CLI starts with ``#!/usr/bin/env node``)."""
    if not node.is_file():
        raise RuntimeError(f"no Node.js {major} at {node} for {binary}: run `python -m polar_gym.harness.install`")
    target = context / "nodes" / f"node-{major}" / "bin" / "node"
    if not target.exists():
        target.parent.mkdir(parents=True)
        _link_or_copy(str(node), str(target))
    wrapper = context / "bin" / binary
    wrapper.write_text(f"#!/bin/sh\n# polar_gym: {binary} runs with Node.js {major}\n"
                       f"PATH={HARNESS_PREFIX}/nodes/node-{major}/bin:\"$PATH\"\nexport PATH\n"
                       f"exec {HARNESS_PREFIX}/node_modules/.bin/{binary} \"$@\"\n")
    wrapper.chmod(0o755)


def _stage_venv(context: Path, harness: str) -> None:
    """A Python harness's venv at ``py/HARNESS`` and a wrapper running its binary at ``bin/``. A venv names its
    own path in its scripts' ``#!`` lines, so those lines are rewritten to the image's path (into new files: the
    staged ones are hard links to the cache's). Its base interpreter is the image's when it is Debian's (``/usr``,
    the base's python3); else (pyenv's 3.12 for the OpenHands SDK) it goes in too (:func:`_stage_python`)."""
    source = py_install_dir(harness) / "venv"
    if not (source / "bin" / PY_PINS[harness].binary).exists():
        raise RuntimeError(f"{harness} is not installed at {source}: run `python -m polar_gym.harness.pyinstall "
                           f"{harness}` (bash scripts/setup.sh does)")
    staged = context / "py" / harness
    shutil.copytree(source, staged, symlinks=True, copy_function=_link_or_copy)
    old, new = f"#!{source}/bin/".encode(), f"#!{HARNESS_PREFIX}/py/{harness}/bin/".encode()
    for script in (staged / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        with open(script, "rb") as f:
            head = f.read(len(old))
        if head == old:
            body = new + script.read_bytes()[len(old):]
            mode = script.stat().st_mode
            script.unlink()
            script.write_bytes(body)
            script.chmod(mode)
    # a wrapper, not a link: a venv's python finds its pyvenv.cfg beside the path it was started by
    wrapper = context / "bin" / PY_PINS[harness].on_path
    wrapper.write_text(f'#!/bin/sh\nexec {HARNESS_PREFIX}/py/{harness}/bin/{PY_PINS[harness].binary} "$@"\n')
    wrapper.chmod(0o755)
    prefix = base_prefix(source)
    if prefix is not None and not prefix.is_relative_to("/usr"):
        _stage_python(context, staged, prefix, PY_PINS[harness].python)


def _stage_python(context: Path, venv: Path, prefix: Path, minor: str) -> None:
    """An interpreter from outside ``/usr`` at ``pythons/MINOR`` (its test suite left out), the staged ``venv``
    pointed at it (pyvenv.cfg and its ``python`` links), and its ``lib`` in the image's loader path: a pyenv build
    links libpython by an absolute RUNPATH that does not exist in the image."""
    image = f"{HARNESS_PREFIX}/pythons/{minor}"
    target = context / "pythons" / minor
    if not target.exists():
        shutil.copytree(prefix, target, symlinks=True, copy_function=_link_or_copy,
                        ignore=lambda d, names: ["test"] if Path(d).name.startswith("python") and
                        Path(d).parent.name == "lib" else [])
        with open(context / "ld.so.conf", "a") as conf:
            conf.write(f"{image}/lib\n")
    config = venv / "pyvenv.cfg"
    text = config.read_text().replace(str(prefix), image)
    config.unlink()
    config.write_text(text)
    for link in (venv / "bin").iterdir():
        if link.is_symlink() and os.readlink(link).startswith(f"{prefix}/"):
            pointed = image + os.readlink(link)[len(str(prefix)):]
            link.unlink()
            os.symlink(pointed, link)


def _image_label(cli: Sequence[str], tag: str) -> str | None:
    done = subprocess.run([*cli, "image", "inspect", "--format", '{{index .Labels "org.polar_gym.key"}}', tag],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _run(argv: Sequence[str]) -> int:  # pragma: no cover - the real builders; tests inject a runner
    return subprocess.run(list(argv), check=False).returncode


def _run_in(argv: Sequence[str], cwd: Path) -> int:  # pragma: no cover - the real fetch; tests inject a runner
    return subprocess.run(list(argv), check=False, cwd=cwd).returncode


def _pack_debootstrap(recipe: OfflineRecipe, tmp: Path, runner: Runner) -> Path:
    """As root: debootstrap into a folder, drop apt's caches, tar it."""
    rootfs = tmp / "rootfs"
    if runner(debootstrap_argv(recipe, rootfs)) != 0:
        raise RuntimeError(f"debootstrap failed: {' '.join(debootstrap_argv(recipe, rootfs))}")
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (rootfs / junk).glob("*"):
            if item.is_file():
                item.unlink()
    tar = tmp / "rootfs.tar"
    if runner(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tar), "."]) != 0:
        raise RuntimeError("packing the base root filesystem failed")
    return tar


def _pack_mmdebstrap(recipe: OfflineRecipe, tmp: Path, runner: Runner, cache: Path,
                     fetch_runner: Callable[[Sequence[str], Path], int]) -> Path:
    """As a user: mmdebstrap in a user namespace, straight to a tarball (polar_gym.apptainer.rootless)."""
    program = find_mmdebstrap(cache) or fetch_mmdebstrap(cache, fetch_runner)
    tar = tmp / "rootfs.tar"
    argv = mmdebstrap_argv(recipe, tar, program)
    if runner(argv) != 0:
        raise RuntimeError(f"rootless bootstrap failed: {' '.join(argv)} (it needs newuidmap (uidmap) and a "
                           "subordinate id range in /etc/subuid and /etc/subgid, as rootless podman does)")
    return tar


def ensure_base(recipe: OfflineRecipe, cli: Sequence[str] = ("podman",), *, runner: Runner = _run,
                cache: Path | None = None, rootless: bool | None = None,
                fetch_runner: Callable[[Sequence[str], Path], int] = _run_in) -> str:
    """The base image, made once per package list and imported with ``<cli> import``: as root with debootstrap,
    as a user (``rootless``, default: not root) with mmdebstrap in a user namespace, fetched into ``cache``
    ($POLAR_CACHE) when the system has none."""
    if _image_label(cli, recipe.base_tag) is not None:
        return recipe.base_tag
    rootless = os.geteuid() != 0 if rootless is None else rootless
    if not rootless and shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="polar-base-") as tmp:
        tar = (_pack_mmdebstrap(recipe, Path(tmp), runner, cache or cache_root(), fetch_runner) if rootless
               else _pack_debootstrap(recipe, Path(tmp), runner))
        if runner(import_argv(cli, tar, recipe.base_tag)) != 0:
            raise RuntimeError(f"importing the base image {recipe.base_tag} failed")
    return recipe.base_tag


def build_oci(recipe: OfflineRecipe, out_dir: Path, cli: Sequence[str] = ("podman",), *, runner: Runner = _run,
              npm_dir: Path | None = None, run_args: Sequence[str] = (), cache: Path | None = None) -> str:
    """Build (or reuse: same key label) the harness image, then check that its node runs (``run_args``: what the
    host needs to start a container); returns its tag."""
    if _image_label(cli, recipe.tag) == recipe.key[:16]:
        return recipe.tag
    ensure_base(recipe, cli, runner=runner, cache=cache)
    context = stage_context(recipe, out_dir / f"{recipe.name}.build", npm_dir=npm_dir)
    (context / "Dockerfile").write_text(render_offline_dockerfile(recipe))
    argv = [*cli, "build", "--pull=never", "-t", recipe.tag, "-f", str(context / "Dockerfile"), str(context)]
    try:
        if runner(argv) != 0:
            raise RuntimeError(f"image build failed: {' '.join(argv)}")
    finally:
        shutil.rmtree(context, ignore_errors=True)
    if runner([*cli, "run", "--rm", "--network", "none", *run_args, recipe.tag, "node", "--version"]) != 0:
        runner([*cli, "rmi", "-f", recipe.tag])
        raise RuntimeError("node does not run in the built image: the host's node must be a self-contained binary "
                           "(nodesource or nodejs.org builds are; Debian's links libnode)")
    return recipe.tag


def sif_path(recipe: OfflineRecipe, out_dir: Path) -> Path:
    """Where the SIF of ``recipe`` goes: named by its harnesses and a key over the recipe and the definition."""
    key = hashlib.sha256((recipe.key + _DEFINITION).encode()).hexdigest()[:16]
    return out_dir / f"{recipe.name}-{key}.sif"


def build_sif(recipe: OfflineRecipe, out_dir: Path, binary: str = "apptainer", *, runner: Runner = _run,
              npm_dir: Path | None = None, node: str | None = None, fakeroot: bool | None = None) -> Path:
    """The same image as a SIF for clusters with Apptainer and no container engine: the context staged from the
    cached CLIs, the definition rendered from the same recipe, ``apptainer build`` (``--fakeroot`` unless root;
    Bootstrap: debootstrap needs debootstrap on the build host), then a check that node runs in it. Reused when
    the SIF of the same key exists; built as ``.partial`` and renamed, so a failed build is never reused."""
    sif = sif_path(recipe, out_dir)
    if sif.is_file():
        return sif
    if runner is _run and shutil.which(binary) is None:
        raise RuntimeError(f"{binary} is not installed: build the OCI image with --format oci (podman), or print "
                           "the Apptainer definition with --dry-run and build it where Apptainer is")
    out_dir.mkdir(parents=True, exist_ok=True)
    context = stage_context(recipe, out_dir / f"{recipe.name}.sif-build", npm_dir=npm_dir, node=node)
    definition = context / "apptainer.def"
    definition.write_text(render_offline_definition(recipe, context))
    partial = sif.with_name(sif.name + ".partial")
    fakeroot = os.geteuid() != 0 if fakeroot is None else fakeroot
    argv = [binary, "build", *(["--fakeroot"] if fakeroot else []), "--force", str(partial), str(definition)]
    try:
        if runner(argv) != 0:
            raise RuntimeError(f"SIF build failed: {' '.join(argv)}")
    finally:
        shutil.rmtree(context, ignore_errors=True)
    if runner([binary, "exec", "--containall", str(partial), "node", "--version"]) != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError("node does not run in the built SIF: the host's node must be a self-contained binary")
    partial.replace(sif)
    return sif
