"""scripts/slurm_local.sh's /etc/hosts step alone (``hosts-block N`` / ``hosts-clear``), on a hosts file of the
test's own (issue 35): the lock lives in a root-only directory and is never opened through a symlink, and the file
is replaced whole (renamed over; a bind-mounted one written in place in one write), so a crash at any moment leaves
the old content or the new, never an empty or cut file. Real bash, real files, a real bind mount (root only)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from tests._waiting import until_sync

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm_local.sh"
BASE = "127.0.0.1 localhost\n::1 ip6-localhost\n# a comment kept as is: ünïcode\n"
BLOCK = ("# >>> slurm_local polar (/tmp/polar-slurm) >>>\n10.77.0.1 polar-ctl\n10.77.0.11 polar-node1\n"
         "10.77.0.12 polar-node2\n# <<< slurm_local polar <<<\n")

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="slurm_local.sh runs as root (bind mounts need it)")


def _env(hosts: Path, lock_dir: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_LOCAL_")}
    env["SLURM_LOCAL_HOSTS_FILE"] = str(hosts)
    if lock_dir is not None:
        env["SLURM_LOCAL_LOCK_DIR"] = str(lock_dir)
    return env


def _run(hosts: Path, lock_dir: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=_env(hosts, lock_dir), capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.fixture
def hosts(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "hosts"
    path.parent.mkdir()
    path.write_text(BASE)
    path.chmod(0o644)
    return path


@needs_root
def test_the_lock_is_never_opened_through_a_symlink_or_in_a_shared_directory(hosts: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "lock-link").symlink_to(victim)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)  # a /tmp-like directory
    for lock_dir in (tmp_path / "lock-link", shared):
        refused = _run(hosts, lock_dir, "hosts-block", "2")
        assert refused.returncode != 0 and f"refusing the lock directory {lock_dir}" in refused.stderr
        assert hosts.read_text() == BASE  # nothing written without the lock
    assert list(victim.iterdir()) == [] and list(shared.iterdir()) == []
    fresh = tmp_path / "run" / "polar-slurm"
    fresh.parent.mkdir()
    assert _run(hosts, fresh, "hosts-block", "2").returncode == 0
    info = fresh.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == 0
    assert (fresh / "hosts.lock").exists() and hosts.read_text() == BASE + BLOCK


@needs_root
def test_by_default_the_lock_is_in_run_not_tmp(hosts: Path) -> None:
    assert _run(hosts, None, "hosts-block", "2").returncode == 0
    lock_dir = Path("/run/polar-slurm")
    assert stat.S_IMODE(lock_dir.lstat().st_mode) == 0o700 and (lock_dir / "hosts.lock").exists()
    assert _run(hosts, None, "hosts-clear").returncode == 0 and hosts.read_text() == BASE


@needs_root
def test_hosts_is_replaced_whole_by_a_rename(hosts: Path, tmp_path: Path) -> None:
    before = hosts.stat()
    assert _run(hosts, tmp_path / "lock", "hosts-block", "2").returncode == 0
    after = hosts.stat()
    assert after.st_ino != before.st_ino  # a new file renamed over the old one, not a rewrite in place
    assert (stat.S_IMODE(after.st_mode), after.st_uid) == (0o644, before.st_uid)
    assert hosts.read_text() == BASE + BLOCK
    assert _run(hosts, tmp_path / "lock", "hosts-clear").returncode == 0 and hosts.read_text() == BASE
    assert sorted(p.name for p in hosts.parent.iterdir()) == ["hosts"]  # no temporary file left


def _in_namespace(hosts: Path, target: Path, lock_dir: Path, *args: str) -> list[str]:
    """The script run on ``target``, a bind mount of ``hosts`` in a mount namespace of its own (a container's
    /etc/hosts): rename cannot replace a mount point."""
    inner = f'mount --bind "{hosts}" "{target}" && exec bash "{SCRIPT}" {" ".join(args)}'
    return ["unshare", "-m", "--propagation", "private", "bash", "-c", inner]


@needs_root
def test_a_bind_mounted_hosts_is_written_in_place(hosts: Path, tmp_path: Path) -> None:
    target = tmp_path / "etc" / "mounted"
    target.touch()
    inode = hosts.stat().st_ino
    for args, expected in ((("hosts-block", "2"), BASE + BLOCK), (("hosts-clear",), BASE)):
        done = subprocess.run(_in_namespace(hosts, target, tmp_path / "lock", *args),
                              env=_env(target, tmp_path / "lock"), capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 0, done.stderr
        assert hosts.read_text() == expected and hosts.stat().st_ino == inode
    assert sorted(p.name for p in hosts.parent.iterdir()) == ["hosts", "mounted"]


@needs_root
@pytest.mark.parametrize("mounted", [False, True], ids=["renamed", "bind-mounted"])
def test_a_crash_at_any_moment_leaves_the_old_or_the_new_hosts(hosts: Path, tmp_path: Path, mounted: bool) -> None:
    """SIGKILL to the whole script (its children too) at random moments while it rewrites the file: what is left
    is always the old content or the new (with blank lines after it at most), never empty or cut. On today's
    script (``> /etc/hosts`` then printf) a kill between the two left the file empty."""
    rng = random.Random(35)
    target = tmp_path / "etc" / "mounted"
    target.touch()
    lock_dir = tmp_path / "lock"
    for attempt in range(40):
        before = hosts.read_text()
        args = ("hosts-block", str(1 + attempt % 3)) if attempt % 2 == 0 else ("hosts-clear",)
        argv = _in_namespace(hosts, target, lock_dir, *args) if mounted else ["bash", str(SCRIPT), *args]
        proc = subprocess.Popen(argv, env=_env(target if mounted else hosts, lock_dir), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if rng.random() < 0.8:  # most runs are killed somewhere in the middle; the others finish
            until_sync(lambda p=proc: p.poll() is not None or rng.random() < 0.02, timeout=30, interval=0.001,
                       what="a moment to kill the script")
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        after = hosts.read_text()
        assert after.strip(), f"attempt {attempt}: the hosts file was left empty"
        stripped = after.rstrip("\n") + "\n"
        block = "".join(f"10.77.0.{10 + i} polar-node{i}\n" for i in range(1, int(args[-1]) + 1)) \
            if args[0] == "hosts-block" else ""
        new = BASE + BLOCK.split("10.77.0.11")[0] + block + BLOCK.splitlines(keepends=True)[-1] \
            if args[0] == "hosts-block" else BASE
        old = before.rstrip("\n") + "\n"  # an earlier attempt killed in place may have left blank lines after it
        assert stripped in (old, new), f"attempt {attempt}: neither the old nor the new content: {after!r}"
        assert after.startswith(BASE)


@needs_root
def test_a_state_dir_that_is_a_link_or_anothers_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """The state dir (default /tmp/polar-slurm) holds what root's daemons read (slurm.conf, slurmdbd.conf, pid
    files): one another user made first, or a link they planted, is refused before anything is installed or written."""
    victim = tmp_path / "victim"
    victim.mkdir()
    link = tmp_path / "state-link"
    link.symlink_to(victim)
    theirs = tmp_path / "state-theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # another user's
    for state in (link, theirs):
        env = {"PATH": os.environ["PATH"], "SLURM_LOCAL_DIR": str(state)}
        done = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and f"refusing the state directory {state}" in done.stderr, done.stderr
    assert list(victim.iterdir()) == [] and list(theirs.iterdir()) == []
