"""Issue 35, faults 1 and 2: a task's environment never reaches a host process.

A task's ``[environment] env`` / ``[verifier] env`` (``RuntimeSpec.env`` and an exec's env) became the environment of
the host binaries a backend starts: ``LD_PRELOAD`` ran a library in podman and conmon as root (runtime=docker) and
inside bwrap before any namespace existed (runtime=local); podman ran with its working directory in the session
directory, so ``LD_PRELOAD=./evil.so`` loaded a file the container wrote there.

Here a real library (built now with gcc) writes a marker into a host directory the sandbox cannot see whenever a
process loads it; every attack tries it by absolute host path and by a file the sandbox wrote, through the spec's env
and an exec's env, with the backend's own refusal switched off (so the transport itself is proven, not only the
check), and asserts no marker appears. A recording wrapper in front of bwrap / podman shows the environment and
working directory they really start with. The module runs as root and again as uid 65534
(:func:`test_the_same_attacks_fail_as_an_unprivileged_user`), so it loads no conftest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from polar_gym.runtime import docker as docker_module
from polar_gym.runtime import local as local_module
from polar_gym.runtime.base import Runtime
from polar_gym.runtime.docker import DockerRuntime
from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec
from tests._unprivileged import require_outer_root_run, rerun_with_the_local_runtime

ROOT = Path(__file__).parents[2]
PODMAN_CLI = ["podman", "--runtime", "runc"]

EVIL_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
static void mark(const char *how) {
    char path[4096], comm[32] = "unknown";
    int c = open("/proc/self/comm", O_RDONLY);
    if (c >= 0) {
        ssize_t n = read(c, comm, sizeof comm - 1);
        comm[n > 0 ? n - 1 : 0] = 0;
        close(c);
    }
    snprintf(path, sizeof path, "%s/ran-%s-%s-%d", MARKER_DIR, how, comm, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT, 0666);
    if (fd >= 0) close(fd);
}
__attribute__((constructor)) static void evil(void) { mark("preload"); }
unsigned int la_version(unsigned int version) { mark("audit"); return version; }
"""

#: in front of bwrap or podman: records its environment (NUL-separated) and working directory, then runs the real one
RECORDER = """#!/bin/sh
cat /proc/$$/environ > "{out}/env.$$" 2>/dev/null
readlink /proc/$$/cwd > "{out}/cwd.$$" 2>/dev/null
exec "$@"
"""


class Kit:
    """The host side of the attack: the library, the marker directory, the recorder."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.markers = work / "markers"
        self.records = work / "records"
        for d in (work, self.markers, self.records):
            d.mkdir(exist_ok=True)
            d.chmod(0o777)  # the sandbox's host uid (65534 under a root gateway) may write there if it runs there
        self.lib = work / "evil.so"
        source = work / "evil.c"
        source.write_text(EVIL_C)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f'-DMARKER_DIR="{self.markers}"', "-o", str(self.lib),
                        str(source)], check=True, capture_output=True)
        self.lib.chmod(0o755)
        self.recorder = work / "record"
        self.recorder.write_text(RECORDER.format(out=self.records))
        self.recorder.chmod(0o755)

    @classmethod
    @contextlib.contextmanager
    def made(cls, prefix: str) -> Iterator[Kit]:
        """A kit in a fresh directory under /tmp (skips without gcc), removed afterwards. Its library is proven to
        run on the host when preloaded on purpose, so that "no marker" later means something."""
        if shutil.which("gcc") is None:
            pytest.skip("gcc is missing")
        work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        try:
            kit = cls(work)
            subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(kit.lib), "PATH": "/usr/bin:/bin"}, check=True)
            assert kit.ran(), "the test library did not run on the host when preloaded on purpose"
            kit.clear()
            yield kit
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def ran(self) -> list[str]:
        return sorted(p.name for p in self.markers.iterdir())

    def clear(self) -> None:
        for p in self.markers.iterdir():
            p.unlink()

    def recorded(self) -> list[tuple[dict[str, str], str]]:
        """(environment, working directory) of every process the recorder saw."""
        out = []
        for env_file in sorted(self.records.glob("env.*")):
            pairs = [item.split("=", 1) for item in env_file.read_bytes().decode(errors="replace").split("\0") if item]
            cwd = self.records / env_file.name.replace("env.", "cwd.")
            out.append(({k: v for k, v in (p for p in pairs if len(p) == 2)},
                        cwd.read_text().strip() if cwd.exists() else "?"))
        return out


@pytest.fixture
def kit() -> Iterator[Kit]:
    with Kit.made("polar-hostile-env-") as made:
        yield made


def _podman_reason() -> str | None:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman or runc is not installed"
    if os.environ.get("POLAR_UNPRIVILEGED_RUN"):
        return "rootless podman as uid 65534 is the tests/unprivileged tier's (a login user with subordinate ids)"
    from tests.runtime._docker import unavailable_reason

    return unavailable_reason()


@contextlib.asynccontextmanager
async def sandbox(backend: str, session: Path, kit: Kit, env: dict[str, str]) -> AsyncIterator[Runtime]:
    """A started sandbox whose spec env is ``env`` (built without the validator, as a hostile caller would) and whose
    host binary runs behind the recorder."""
    spec = RuntimeSpec.model_construct(**{**RuntimeSpec().model_dump(), "network": "none", "env": env})
    runtime: Runtime
    if backend == "local":
        if shutil.which("bwrap") is None:
            pytest.skip("bubblewrap is not installed")
        runtime = LocalRuntime(spec, session, options={"bwrap": str(kit.recorder)})
        # the recorder execs "$@": bwrap's real path goes first (the launcher runs the recorder as bwrap)
        kit.recorder.write_text(RECORDER.format(out=kit.records).replace('exec "$@"',
                                                                         f'exec {shutil.which("bwrap")} "$@"'))
    else:
        reason = _podman_reason()
        if reason is not None:
            pytest.skip(reason)
        from polar_gym.runtime.testimage import TEST_IMAGE
        from tests.runtime._docker import direct_run_args

        spec = spec.model_copy(update={"image": TEST_IMAGE})
        # the recorder hides podman's name from the backend's probe: the probed run options are given instead
        runtime = DockerRuntime(spec, session, options={"cli": [str(kit.recorder), *PODMAN_CLI],
                                                        "run_args": direct_run_args()})
    async with runtime:
        yield runtime


def _attack_env(kit: Kit, planted: str) -> dict[str, str]:
    return {"LD_PRELOAD": planted, "LD_AUDIT": str(kit.lib), "LD_LIBRARY_PATH": str(kit.work),
            "POLAR_TASK_MARK": "task-value-7f3a"}


BACKENDS = ["local", "docker"]


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the backends' own refusal of loader names off: what is left is the transport."""
    for module in (local_module, docker_module):
        monkeypatch.setattr(module, "check_sandbox_env", lambda env, where: None, raising=False)


def _assert_host_clean(kit: Kit, session: Path) -> None:
    assert kit.ran() == [], f"the task's library ran on the host: {kit.ran()}"
    records = kit.recorded()
    assert records, "the recorder saw no host process"
    for env, cwd in records:
        leaked = sorted(k for k, v in env.items() if k.startswith("LD_") or k == "POLAR_TASK_MARK"
                        or "task-value-7f3a" in v)
        assert leaked == [], f"a host process started with the task's {leaked}"
        assert not cwd.startswith(str(session.resolve())), f"a host process ran in the session directory ({cwd})"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_spec_env_stays_inside_the_sandbox(backend: str, kit: Kit, tmp_path: Path, unchecked: None
                                                     ) -> None:
    session = tmp_path / "session"
    session.mkdir()
    async with sandbox(backend, session, kit, _attack_env(kit, str(kit.lib))) as rt:
        result = await rt.exec(["sh", "-c", 'echo "$POLAR_TASK_MARK"'])
        assert result.ok, result
        assert result.stdout.strip() == b"task-value-7f3a"  # the command still gets its environment
    _assert_host_clean(kit, session)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_exec_env_naming_a_library_the_sandbox_wrote_stays_inside(backend: str, kit: Kit,
                                                                           tmp_path: Path, unchecked: None) -> None:
    """The container writes evil.so into its session directory (/polar, the host's session dir); the next exec's env
    names it by its host path and, as podman's working directory was the session directory, by ``./evil.so``."""
    session = tmp_path / "session"
    session.mkdir()
    async with sandbox(backend, session, kit, {}) as rt:
        wrote = await rt.exec(["sh", "-c", "cat > /polar/evil.so"], stdin=kit.lib.read_bytes())
        assert wrote.ok, wrote
        assert (session / "evil.so").read_bytes() == kit.lib.read_bytes()
        for planted in (str(session.resolve() / "evil.so"), "./evil.so"):
            result = await rt.exec(["sh", "-c", 'echo "$POLAR_TASK_MARK"'], env=_attack_env(kit, planted))
            assert result.ok, result
            assert result.stdout.strip() == b"task-value-7f3a"
    _assert_host_clean(kit, session)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_backend_refuses_loader_names_with_the_name(backend: str, kit: Kit, tmp_path: Path) -> None:
    """The second line of defence, in the backend itself (the spec's validator bypassed): a clear error."""
    session = tmp_path / "session"
    session.mkdir()
    with pytest.raises(SandboxEnvError, match="runtime env may not set 'LD_PRELOAD'"):
        async with sandbox(backend, session, kit, {"LD_PRELOAD": str(kit.lib)}):
            pass
    async with sandbox(backend, session, kit, {}) as rt:
        with pytest.raises(SandboxEnvError, match="exec's env may not set 'LD_AUDIT'"):
            await rt.exec(["true"], env={"HOME": "/polar/home", "LD_AUDIT": str(kit.lib)})
        ok = await rt.exec(["sh", "-c", 'echo "$HOME"'], env={"HOME": "/polar/home"})  # what harnesses pass
        assert ok.ok and ok.stdout.strip() == b"/polar/home"
    assert kit.ran() == []


async def test_docker_env_values_round_trip_and_a_newline_is_refused(kit: Kit, tmp_path: Path) -> None:
    """The env file carries any value but a newline verbatim (spaces, '=', '#', quotes, '$', unicode, empty); a
    newline, which that format cannot carry, is refused with the variable named, before podman runs."""
    session = tmp_path / "session"
    session.mkdir()
    values = {"A": " lead and trail ", "B": "x=y#z", "C": "'\"$HOME`id`\\", "D": "héllo ✓", "E": ""}
    async with sandbox("docker", session, kit, values) as rt:
        result = await rt.exec(["sh", "-c", 'printf "%s|" "$A" "$B" "$C" "$D" "$E"'])
        assert result.ok, result
        assert result.stdout.decode() == "|".join(values.values()) + "|"
        with pytest.raises(SandboxEnvError, match="'MULTI' holds a newline"):
            await rt.exec(["true"], env={"MULTI": "one\ntwo"})
    assert not any(session.rglob("env-*"))  # the env files never were in the session directory


async def test_local_exec_env_carries_any_value(kit: Kit, tmp_path: Path) -> None:
    """bwrap's args fd carries newlines and every other byte but NUL."""
    session = tmp_path / "session"
    session.mkdir()
    async with sandbox("local", session, kit, {}) as rt:
        value = "line one\nline two = 'x' $y"
        result = await rt.exec(["sh", "-c", 'printf %s "$V"'], env={"V": value})
        assert result.ok, result
        assert result.stdout.decode() == value
    for env, cwd in kit.recorded():
        assert "V" not in env and cwd == "/"


# -- the same, as an unprivileged user ---------------------------------------------------------------------------


def test_the_same_attacks_fail_as_an_unprivileged_user() -> None:
    """This module again as uid 65534 (runtime=local; rootless docker is the tests/unprivileged tier's)."""
    require_outer_root_run()
    if shutil.which("gcc") is None or shutil.which("bwrap") is None:
        pytest.skip("gcc or bubblewrap is missing")
    out = rerun_with_the_local_runtime(Path(__file__), min_passed=4, timeout=900)
    assert "failed" not in out
