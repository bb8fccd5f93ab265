"""A tiny OCI image for testing the docker backend without a registry: a static busybox and its applet links.

This machine cannot pull images, so the test set-up makes one from a root filesystem: :func:`rootfs_entries` is the
pure recipe (directories, the binary, one symlink per applet, a minimal /etc), :func:`write_rootfs_tar` renders it
as a tar, and :func:`ensure_test_image` imports it with ``<cli> import`` unless the tag already exists. Set-up calls
``python -m polar_gym.runtime.testimage`` and test fixtures call :func:`ensure_test_image` directly.
"""

from __future__ import annotations

import argparse
import io
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "IMAGE_CHANGES",
    "TEST_IMAGE",
    "RootfsEntry",
    "busybox_applets",
    "ensure_test_image",
    "find_static_busybox",
    "import_argv",
    "is_static_elf",
    "rootfs_entries",
    "write_rootfs_tar",
]

#: the tag tests use; bump the version when the recipe changes
TEST_IMAGE = "localhost/polar-test-busybox:1"
#: image config set at import (a rootfs tar carries none: without PATH nothing resolves ``sh``)
IMAGE_CHANGES = (
    "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "WORKDIR=/",
    'CMD ["/bin/sh"]',
)
_DIRS = {"bin": 0o755, "dev": 0o755, "etc": 0o755, "proc": 0o555, "root": 0o700, "sys": 0o555, "tmp": 0o1777,
         "usr": 0o755, "usr/bin": 0o755, "var": 0o755, "var/tmp": 0o1777, "workspace": 0o755}
_ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1 localhost\n",
}


@dataclass(frozen=True)
class RootfsEntry:
    """One member of the root filesystem: a directory, a file (content or a host path) or a symlink."""

    path: str
    kind: str  # "dir" | "file" | "symlink"
    mode: int = 0o644
    data: bytes = b""
    source: Path | None = None
    target: str = ""


def rootfs_entries(busybox: Path, applets: Sequence[str]) -> list[RootfsEntry]:
    """The image recipe: pure, so a test can read it without building anything."""
    entries = [RootfsEntry(path, "dir", mode) for path, mode in sorted(_DIRS.items())]
    entries += [RootfsEntry(path, "file", 0o644, text.encode()) for path, text in sorted(_ETC.items())]
    entries.append(RootfsEntry("bin/busybox", "file", 0o755, source=busybox))
    for applet in sorted(set(applets) - {"busybox"}):
        if applet and "/" not in applet:
            entries.append(RootfsEntry(f"bin/{applet}", "symlink", 0o777, target="busybox"))
    return entries


def write_rootfs_tar(entries: Sequence[RootfsEntry], out: Path) -> Path:
    """Render the entries as a tar (root-owned, fixed mtime: the same recipe gives the same bytes)."""
    with tarfile.open(out, "w") as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.path)
            info.mode, info.uid, info.gid, info.mtime = entry.mode, 0, 0, 0
            if entry.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif entry.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, entry.target
                tar.addfile(info)
            else:
                data = entry.source.read_bytes() if entry.source is not None else entry.data
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out


def is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a program interpreter (it runs in an empty root filesystem)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
            return False
        endian = "<" if head[5] == 1 else ">"
        phoff, = struct.unpack_from(endian + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(endian + "HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, = struct.unpack_from(endian + "I", table, i * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def find_static_busybox() -> Path | None:
    """The host's busybox when it is statically linked (Debian ``busybox-static``)."""
    for candidate in (shutil.which("busybox"), "/bin/busybox", "/usr/bin/busybox"):
        if candidate and Path(candidate).is_file() and is_static_elf(Path(candidate)):
            return Path(candidate)
    return None


def busybox_applets(busybox: Path) -> list[str]:
    """The applets this busybox build provides (``busybox --list``)."""
    out = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout
    return out.split()


def import_argv(cli: Sequence[str], tar: Path, tag: str) -> list[str]:
    """``<cli> import --change ... TAR TAG``."""
    argv = [*cli, "import"]
    for change in IMAGE_CHANGES:
        argv += ["--change", change]
    return [*argv, str(tar), tag]


def ensure_test_image(cli: Sequence[str] = ("podman",), tag: str = TEST_IMAGE) -> str:
    """Import the busybox image under ``tag`` unless it exists; returns the tag. Blocking: set-up and fixtures only."""
    if subprocess.run([*cli, "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    busybox = find_static_busybox()
    if busybox is None:
        raise RuntimeError("no statically linked busybox found: apt-get install busybox-static")
    with tempfile.TemporaryDirectory(prefix="polar-rootfs-") as tmp:
        tar = write_rootfs_tar(rootfs_entries(busybox, busybox_applets(busybox)), Path(tmp) / "rootfs.tar")
        done = subprocess.run(import_argv(cli, tar, tag), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"image import failed: {done.stderr.strip()}")
    return tag


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - set-up glue
    parser = argparse.ArgumentParser(description="build the busybox test image for the docker backend")
    parser.add_argument("--cli", default="podman", help="the container CLI (space-separated argv)")
    parser.add_argument("--tag", default=TEST_IMAGE)
    args = parser.parse_args(argv)
    print(ensure_test_image(args.cli.split(), args.tag))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
