"""``python -m polar_gym.apptainer build``: render and build a harness image (SIF, or OCI with --format oci).

    python -m polar_gym.apptainer build --harness claude_code --base docker://node:22-bookworm \\
        --apt python3 --pip pytest --cache versioned --out images/ [--dry-run]

``--dry-run`` prints the rendered definition (or Dockerfile and setup script) and the build command, and builds
nothing. The last line printed by a real build is the image (SIF path or OCI tag), so scripts can capture it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from polar_gym.apptainer.images import DEFAULT_BASE, DEFAULT_NODE_VERSION, ImageRecipe, build, plan, reusable
from polar_gym.harness.install import PINS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.apptainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="render and build one image")
    b.add_argument("--harness", choices=sorted(PINS), help="the pinned harness CLI to bake in (default: none)")
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
    b.add_argument("--out", type=Path, required=True, help="directory for images, sidecars and build files")
    b.add_argument("--dry-run", action="store_true", help="print what would be built and how; build nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
        recipe = ImageRecipe(base=args.base, harness=args.harness, node_version=args.node_version,
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
