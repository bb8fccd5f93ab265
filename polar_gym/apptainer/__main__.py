"""``python -m polar_gym.apptainer build``: render and build a harness image (SIF, or OCI with --format oci).

    python -m polar_gym.apptainer build --harness claude_code --base docker://node:22-bookworm \\
        --apt python3 --pip pytest --cache versioned --out images/ [--dry-run]

``--dry-run`` prints the rendered definition (or Dockerfile and setup script) and the build command, and builds
nothing. The last line printed by a real build is the image (SIF path or OCI tag), so scripts can capture it.

``--offline`` builds from what set-up cached, with no image registry: a Debian base from the host's apt mirror (git,
python3, bash, coreutils; debootstrap as root, ``mmdebstrap --mode=unshare`` as a user, fetched into the cache with
``apt-get download`` when the system has none: no root step), the host's node and the cached pinned CLIs (all six by
default, or each ``--harness``). ``--format oci`` (podman) makes the image ``runtime=docker`` runs by default;
``--format sif`` builds the same recipe as a SIF with Apptainer (a cluster without a container engine), and
``--dry-run`` prints both renderings:

    python -m polar_gym.apptainer build --offline --format oci                 # localhost/polar-gym/harnesses:<pins>
    python -m polar_gym.apptainer build --offline --format oci --harness pi    # localhost/polar-gym/pi:<pins>
    python -m polar_gym.apptainer build --offline --format sif --harness pi    # OUT/pi-<key>.sif
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from polar_gym.apptainer.images import DEFAULT_BASE, DEFAULT_NODE_VERSION, ImageRecipe, build, plan, reusable
from polar_gym.apptainer.offline import (
    ALL_HARNESSES,
    BASE_PACKAGES,
    OfflineRecipe,
    build_oci,
    build_sif,
    debootstrap_argv,
    host_apt_source,
    render_offline_definition,
    render_offline_dockerfile,
)
from polar_gym.harness.install import PINS
from polar_gym.runtime.podman_host import default_cli, host_defaults

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.apptainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="render and build one image")
    b.add_argument("--harness", choices=sorted(PINS), action="append", default=[],
                   help="the pinned harness CLI to bake in (default: none; --offline: all; repeatable with --offline)")
    b.add_argument("--offline", action="store_true", help="no registry: Debian base + the cached CLIs (see above)")
    b.add_argument("--base", default=DEFAULT_BASE, help=f"base image (default {DEFAULT_BASE})")
    b.add_argument("--node-version", default=DEFAULT_NODE_VERSION, help="Node.js installed if the base lacks it")
    b.add_argument("--install-node", choices=["auto", "yes", "no"], default="auto")
    b.add_argument("--apt", action="append", default=[], metavar="PKG", help="apt package (repeatable)")
    b.add_argument("--pip", action="append", default=[], metavar="REQ", help="pip requirement (repeatable)")
    b.add_argument("--env", action="append", default=[], metavar="K=V", help="environment in the image")
    b.add_argument("--post", action="append", default=[], metavar="CMD", help="extra setup command, as root")
    b.add_argument("--workdir", default="/workspace")
    b.add_argument("--cache", choices=["scratch", "versioned", "lock"], default="versioned")
    b.add_argument("--lock", type=Path, help="lock file whose bytes key the image (--cache lock)")
    b.add_argument("--format", choices=["sif", "oci"], default="sif")
    b.add_argument("--binary", default="apptainer", help="apptainer CLI for SIF builds")
    b.add_argument("--engine", default="podman", help="docker or podman for OCI builds")
    b.add_argument("--build-arg", action="append", default=[], metavar="ARG", help="extra builder argument")
    b.add_argument("--out", type=Path, help="directory for images, sidecars and build files (--offline: "
                   "$POLAR_CACHE/images, else ~/.cache/polar_gym/images: the staged context, removed after)")
    b.add_argument("--dry-run", action="store_true", help="print what would be built and how; build nothing")
    return parser


def _offline(args: argparse.Namespace) -> int:
    """``build --offline``: the registry-free recipe (polar_gym.apptainer.offline)."""
    cache = Path(os.environ.get("POLAR_CACHE") or Path.home() / ".cache" / "polar_gym")
    out = (args.out or cache / "images").resolve()
    try:
        mirror, suite = host_apt_source()
        recipe = OfflineRecipe(harnesses=tuple(args.harness) or ALL_HARNESSES, mirror=mirror, suite=suite,
                               packages=tuple(dict.fromkeys([*BASE_PACKAGES, *args.apt])))
        if args.dry_run:
            context = out / f"{recipe.name}.build"
            bootstrap = shlex.join(debootstrap_argv(recipe, out / "rootfs"))
            print(f"# ---- {context / 'Dockerfile'} (base {recipe.base_tag}: {bootstrap})")
            print(render_offline_dockerfile(recipe), end="")
            print(f"# ---- {context / 'apptainer.def'}")
            print(render_offline_definition(recipe, context), end="")
            print(recipe.tag)
            return 0
        if args.format == "sif":
            print(build_sif(recipe, out, args.binary))
            return 0
        engine = tuple(args.engine.split())
        host = host_defaults(default_cli() if engine == ("podman",) else engine)
        image = build_oci(recipe, out, host.cli, run_args=host.run_args, cache=cache)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for harness, why in recipe.left_out().items():
        print(f"left out of the image: {harness} ({why})", file=sys.stderr)
    print(image)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.offline:
        return _offline(args)
    if args.out is None or len(args.harness) > 1:
        print("error: --out is required, and one --harness at most (without --offline)", file=sys.stderr)
        return 2
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"error: --env wants K=V, got {item!r}", file=sys.stderr)
            return 2
        env.append((key, value))
    if args.cache == "lock" and args.lock is None:
        print("error: --cache lock needs --lock FILE", file=sys.stderr)
        return 2
    install_node = {"auto": None, "yes": True, "no": False}[args.install_node]
    try:
        harness = args.harness[0] if args.harness else None
        recipe = ImageRecipe(base=args.base, harness=harness, node_version=args.node_version,
                             install_node=install_node, apt=tuple(args.apt), pip=tuple(args.pip), env=tuple(env),
                             post=tuple(args.post), workdir=args.workdir)
        lock = args.lock.read_bytes() if args.lock is not None else None
        the_plan = plan(recipe, args.out.resolve(), fmt=args.format, mode=args.cache, lock_bytes=lock,
                        binary=args.binary, engine=args.engine, extra=args.build_arg)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for rel, text in the_plan.files.items():
            print(f"# ---- {the_plan.work_dir / rel}")
            print(text, end="" if text.endswith("\n") else "\n")
        print(f"# ---- key {the_plan.key} ({the_plan.mode}); reuse: {'yes' if reusable(the_plan) else 'no'}")
        print(shlex.join(the_plan.argv))
        return 0
    try:
        image = build(the_plan)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(image)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
