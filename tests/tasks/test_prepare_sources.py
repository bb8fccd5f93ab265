"""A RuntimeSpec's ``upload_file`` / ``upload_dir`` with a host ``src`` (request input) played by ``run_prepare``
into a real LocalRuntime: read only under a granted root and by the rules of task files (no link out of the root, no
FIFO, bounded); the old interpreter copied any host path a request named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import PrepareAction, RuntimeSpec
from polar_gym.tasks import PrepareError, run_prepare

SECRET = "prepare-src-secret-9c2e"


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    granted = tmp_path / "granted"
    (granted / "skills" / "sub").mkdir(parents=True)
    (granted / "skills" / "sub" / "a.md").write_text("skill a")
    (granted / "hints.md").write_text("hint")
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    return granted, secret


async def _play(tmp_path: Path, actions: list[PrepareAction], roots: list[Path]) -> LocalRuntime:
    session = tmp_path / "session"
    session.mkdir(exist_ok=True)
    runtime = LocalRuntime(RuntimeSpec(network="none"), session)
    await runtime.start()
    try:
        await run_prepare(runtime, actions, roots=roots)
    finally:
        await runtime.stop()
    return runtime


def _planted(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "session").rglob("*") if p.is_file() and not p.is_symlink()
            and SECRET.encode() in p.read_bytes()]


async def test_a_src_is_read_only_under_a_granted_root(tmp_path) -> None:
    granted, secret = _layout(tmp_path)
    steal = PrepareAction(type="upload_file", src=str(secret), dst="/workspace/loot")
    with pytest.raises(PrepareError, match=r"prepare action 0 \(upload_file .*\): .* not under a directory "
                                           r"requests may read from \(granted: none\)"):
        await _play(tmp_path, [steal], [])
    with pytest.raises(PrepareError, match="not under a directory requests may read from"):
        await _play(tmp_path, [steal], [granted])
    assert not _planted(tmp_path)
    fine = [PrepareAction(type="upload_file", src=str(granted / "hints.md"), dst="/workspace/HINTS.md"),
            PrepareAction(type="upload_dir", src=str(granted / "skills"), dst="/workspace/skills")]
    await _play(tmp_path, fine, [granted])
    workspace = next((tmp_path / "session").rglob("HINTS.md")).parent
    assert (workspace / "HINTS.md").read_text() == "hint"
    assert (workspace / "skills" / "sub" / "a.md").read_text() == "skill a"


@pytest.mark.parametrize("kind", ["link to a file", "link in a directory", "fifo"])
async def test_a_granted_root_does_not_lend_links_out_or_fifos(tmp_path, kind) -> None:
    granted, secret = _layout(tmp_path)
    if kind == "link to a file":
        (granted / "loot").symlink_to(secret)
        action = PrepareAction(type="upload_file", src=str(granted / "loot"), dst="/workspace/loot")
        reason = "is a symbolic link to"
    elif kind == "link in a directory":
        (granted / "skills" / "loot").symlink_to(secret)  # left out of the copy, never read
        action = PrepareAction(type="upload_dir", src=str(granted / "skills"), dst="/workspace/skills")
        reason = ""
    else:
        os.mkfifo(granted / "skills" / "pipe")
        action = PrepareAction(type="upload_dir", src=str(granted / "skills"), dst="/workspace/skills")
        reason = "skills/pipe: is a FIFO"
    if reason:
        with pytest.raises(PrepareError, match=reason):
            await _play(tmp_path, [action], [granted])
    else:
        await _play(tmp_path, [action], [granted])
    assert not _planted(tmp_path)


async def test_a_relative_src_is_refused(tmp_path) -> None:
    granted, _ = _layout(tmp_path)
    relative = PrepareAction(type="upload_file", src="granted/hints.md", dst="/workspace/HINTS.md")
    with pytest.raises(PrepareError, match="must be an absolute host path"):
        await _play(tmp_path, [relative], [granted])
