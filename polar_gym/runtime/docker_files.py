"""The tar streams of the docker backend's ``cp``: what an upload packs and how a download unpacks (never outside
its destination, no device nodes, no set-id bits). Pure file work, run in a thread by the backend."""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
import tempfile
import time
from pathlib import Path

from polar_gym.runtime.errors import SandboxError

__all__ = ["escape_check", "pack_upload", "unpack_download"]


def pack_upload(data: bytes | Path, dst: str) -> tuple[int, str]:
    """Write a temporary tar that ``cp -`` extracts at ``/`` to put ``data`` at the absolute path ``dst``; returns
    it opened for reading (fd, path)."""
    if not isinstance(data, bytes) and not data.exists():
        raise FileNotFoundError(f"upload source {data} does not exist")
    arcname = dst.lstrip("/")
    fd, out = tempfile.mkstemp(prefix="polar-upload-", suffix=".tar")
    os.close(fd)
    try:
        _write_tar(data, arcname, out)
    except BaseException:
        os.unlink(out)
        raise
    return os.open(out, os.O_RDONLY), out


def _write_tar(data: bytes | Path, arcname: str, out: str) -> None:
    """Root-owned members (as ``docker cp`` makes them), a fresh mtime for bytes."""

    def root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    with tarfile.open(out, "w") as tar:
        if isinstance(data, bytes):
            info = tarfile.TarInfo(arcname)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(root_owned(info), io.BytesIO(data))
        else:
            source = data.resolve() if data.is_symlink() else data
            tar.add(source, arcname=arcname, recursive=True, filter=root_owned)


def _safe_member(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's ``tar`` filter (no escaping the destination), and no device nodes or fifos."""
    if member.ischr() or member.isblk() or member.isfifo():
        return None
    if hasattr(tarfile, "tar_filter"):
        return tarfile.tar_filter(member, path)
    return escape_check(member, path)  # pragma: no cover - Python < 3.11.4 only (Debian 12's 3.11.2)


def escape_check(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo:
    """What the ``tar`` filter checks, for Pythons without extraction filters: the member and its link target stay
    inside the destination (absolute names lose their slash), and no set-id bits."""
    dest = os.path.realpath(path)
    name = member.name.lstrip("/")
    target = os.path.realpath(os.path.join(dest, name))
    links = []
    if member.issym():
        links.append(os.path.join(os.path.dirname(target), member.linkname))
    elif member.islnk():
        links.append(os.path.join(dest, member.linkname.lstrip("/")))
    for candidate in (target, *links):
        if os.path.commonpath([dest, os.path.realpath(candidate)]) != dest:
            raise SandboxError(f"archive member {member.name!r} would land outside {dest}")
    member.name = name
    member.mode &= 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
    return member


def unpack_download(archive: Path, dst: Path) -> None:
    """Extract the one top-level member of ``archive`` at ``dst``: a directory merges into an existing one (as the
    local backend does), anything else replaces what was there."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".polar-download-", dir=dst.parent))
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            tops = {m.name.lstrip("/").split("/", 1)[0] for m in members}
            if len(tops) != 1:
                raise SandboxError(f"unexpected archive from cp: top-level entries {sorted(tops)}")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, members=members, filter=_safe_member)
            else:  # pragma: no cover - Python < 3.11.4 (Debian 12's 3.11.2) has no extraction filters
                safe = [m for m in (_safe_member(m, str(staging)) for m in members) if m is not None]
                tar.extractall(staging, members=safe)
        top = staging / tops.pop()
        existing_dir = dst.is_dir() and not dst.is_symlink()
        if existing_dir and top.is_dir() and not top.is_symlink():
            shutil.copytree(top, dst, symlinks=True, dirs_exist_ok=True)
            return
        if existing_dir:
            shutil.rmtree(dst)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()
        os.replace(top, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
