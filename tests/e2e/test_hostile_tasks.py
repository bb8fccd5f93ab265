"""Issue 35's "done when", integrated: one real ``python -m polar_gym.launch tasks=harbor`` per runtime over a directory
of hostile Harbor tasks next to one good task, with the oracle engine and the real pi CLI.

The hostile tasks: ``[verifier]``/``[environment]``/``[solution]`` env naming what a host's dynamic loader reads
(``LD_PRELOAD`` of a library built now with gcc, by absolute host path and as ``./evil.so`` that the task's tests
write into the session first; ``LD_AUDIT``; ``LD_LIBRARY_PATH`` with a bare ``LD_PRELOAD`` name), an
``instruction.md`` linked to a 0600 host file holding a canary, a FIFO as ``instruction.md`` and as a ``COPY``
source, and verifiers whose reward is infinite, NaN or huge, by mean (``reward.json`` ``{"a": 1e308, "b": 1e308}``)
and by value. Besides the task directories, runtime requests a task directory cannot produce (its env is refused at
load): the good task's request with the verifier's exec env set to ``LD_PRELOAD``/``LD_AUDIT`` (tests/e2e/
_hostile_source.py, the ``tasks`` plug point).

Each attempt must end as a clear per-session ERROR (``invalid_task``, ``invalid_reward``, or the backend's refusal
of the exec env, also ``invalid_task``) while the run finishes (exit 1, bounded wait) and the good task scores 1; the
library never runs on the host (its marker directory stays empty) and the canary is in no file of the run's folder.

Run as root (the suite's user) on runtime=local and runtime=docker (podman, when it and the offline pi image are
here), and the local case again as uid 65534 (:func:`test_the_same_launch_holds_as_an_unprivileged_user`); so the
module loads no conftest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from tests._offline_images import image_with_pi
from tests._unprivileged import require_outer_root_run, run_as_nobody
from tests.e2e._hostile_source import REQUESTS
from tests.runtime.test_hostile_env import Kit

pytestmark = [pytest.mark.harness, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "tests" / "data" / "harbor" / "tasks" / "edit-greeting"
#: the launch's bounded wait (each launch takes ~20-40 s here)
LAUNCH_TIMEOUT = 600

REWARD_SCRIPT = "#!/bin/bash\n{}\n"
#: task -> what its tests/test.sh writes
REWARDS = {
    "reward-json-overflow": """echo '{"a": 1e308, "b": 1e308}' > /logs/verifier/reward.json""",
    "reward-json-inf": """echo '{"a": 1, "b": Infinity}' > /logs/verifier/reward.json""",
    "reward-txt-nan": "echo nan > /logs/verifier/reward.txt",
    "reward-txt-inf": "echo inf > /logs/verifier/reward.txt",
    "reward-txt-huge": "echo 1e300 > /logs/verifier/reward.txt",
}


@dataclass(frozen=True)
class Expected:
    cause: str
    #: what the reason must say besides its first word
    words: tuple[str, ...]

    @property
    def prefix(self) -> str:
        """How the reason starts: the cause, or the stage that failed (``postrun_failed``: ``postrun: ``)."""
        return f"{self.cause.removesuffix('_failed')}: "


def _toml_env(task: Path, section: str, env: dict[str, str]) -> None:
    pairs = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    toml = (task / "task.toml").read_text()
    if f"[{section}]\n" in toml:
        toml = toml.replace(f"[{section}]\n", f"[{section}]\nenv = {{ {pairs} }}\n")
    else:
        toml += f"\n[{section}]\nenv = {{ {pairs} }}\n"
    (task / "task.toml").write_text(toml)


def hostile_set(root: Path, kit: Kit, canary_file: Path, base_image: str | None = None) -> dict[str, Expected]:
    """The good task and every hostile one under ``root``; what each hostile task must end as."""
    root.mkdir()

    def task(name: str) -> Path:
        path = root / name
        shutil.copytree(GOOD, path)
        if base_image is not None:  # no registry here: FROM the offline image that carries pi
            dockerfile = path / "environment" / "Dockerfile"
            dockerfile.write_text(dockerfile.read_text().replace("FROM ubuntu:24.04", f"FROM {base_image}"))
        return path

    task("good")
    expected: dict[str, Expected] = {}
    _toml_env(task("preload-host"), "verifier", {"LD_PRELOAD": str(kit.lib)})
    written = task("preload-written")  # a file the container writes, named relatively
    shutil.copy(kit.lib, written / "tests" / "evil.so")
    (written / "tests" / "test.sh").write_text("#!/bin/bash\ncp /tests/evil.so ./evil.so\n"
                                               "echo 1 > /logs/verifier/reward.txt\n")
    _toml_env(written, "verifier", {"LD_PRELOAD": "./evil.so"})
    _toml_env(task("audit-host"), "environment", {"LD_AUDIT": str(kit.lib)})
    _toml_env(task("library-path"), "solution", {"LD_LIBRARY_PATH": str(kit.lib.parent), "LD_PRELOAD": "evil.so"})
    for name, variable in (("preload-host", "LD_PRELOAD"), ("preload-written", "LD_PRELOAD"),
                           ("audit-host", "LD_AUDIT"), ("library-path", "LD_LIBRARY_PATH")):
        expected[name] = Expected("invalid_task", (f"{root / name}:", f"env sets {variable!r}: refused"))
    linked = task("link-instruction")
    (linked / "instruction.md").unlink()
    (linked / "instruction.md").symlink_to(canary_file)
    expected["link-instruction"] = Expected("invalid_task", (f"{linked}: instruction.md: is a symbolic link to",
                                                             "leaves the task directory"))
    fifo = task("fifo-instruction")
    (fifo / "instruction.md").unlink()
    os.mkfifo(fifo / "instruction.md")
    expected["fifo-instruction"] = Expected("invalid_task", (f"{fifo}: instruction.md: is a FIFO",))
    copied = task("fifo-copy")
    (copied / "environment" / "greeting.txt").unlink()
    os.mkfifo(copied / "environment" / "greeting.txt")
    expected["fifo-copy"] = Expected("invalid_task", (f"{copied}", "environment/greeting.txt: is a FIFO"))
    for name, script in REWARDS.items():
        (task(name) / "tests" / "test.sh").write_text(REWARD_SCRIPT.format(script))
        expected[name] = Expected("invalid_reward", ("reward",))
    for name, (env, _) in REQUESTS.items():
        expected[name] = Expected("invalid_task", ("the exec's env may not set", *env, "(in postrun)"))
    return expected


@pytest.fixture
def kit() -> Iterator[Kit]:
    with Kit.made("polar-hostile-tasks-") as made:
        yield made


def _canary(tmp_path: Path) -> tuple[Path, str]:
    canary = f"polar-canary-{uuid.uuid4().hex}"
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.md"
    secret.write_text(f"{canary}\n")
    secret.chmod(0o600)
    return secret, canary


def launch_hostile(tmp_path: Path, kit: Kit, *overrides: str, base_image: str | None = None) -> None:
    """One launch over the hostile set; every assertion of the module's docstring."""
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    secret, canary = _canary(tmp_path)
    root = tmp_path / "tasks"
    expected = hostile_set(root, kit, secret, base_image)
    out = tmp_path / "run"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "polar_gym.launch", "tasks=harbor", "tasks._target_=tests.e2e._hostile_source:"
             "hostile_requests", f"+tasks.lib={kit.lib}", f"tasks.path={root}", "launcher.progress=false",
             f"out_dir={out}", *overrides],
            cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env={**os.environ, "COLUMNS": "200"})
    except subprocess.TimeoutExpired as exc:  # a task that hangs the launch (a FIFO opened, a reward retried)
        pytest.fail(f"the launch did not finish within {LAUNCH_TIMEOUT} s: {str(exc.stderr)[-3000:]}")
    console = done.stdout + done.stderr
    assert done.returncode == 1, console[-6000:]
    # first what must never happen: the library ran on the host, the host file was read into the run
    assert kit.ran() == [], f"the task's library ran on the host: {kit.ran()}"
    files = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    assert out / "server.sqlite" in files and out / "trajectories.jsonl" in files  # the check reads the run
    leaked = [str(p) for p in files if canary.encode() in p.read_bytes()]
    assert not leaked and canary not in console, f"the canary was read into {leaked or 'the console'}"
    rows = {r["task_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted(["good", *expected]), console[-3000:]
    good = rows["good"]
    assert (good["status"], good["evaluation"]["reward"]) == ("COMPLETED", 1.0), good.get("reason")
    wrong = {}
    for name, want in expected.items():
        row = rows[name]
        reason = row.get("reason") or ""
        if (row["status"], row["error_cause"]) != ("ERROR", want.cause) or not reason.startswith(want.prefix) \
                or not all(w in reason for w in want.words):
            wrong[name] = (row["status"], row["error_cause"], reason[:400])
        elif name not in REQUESTS and want.cause == "invalid_task" \
                and f"task {name} refused (invalid_task)" not in done.stderr:  # refused at load, before any run
            wrong[name] = ("not named on the console",)
    assert not wrong, json.dumps(wrong, indent=1)
    assert all(r["evaluation"] is None or r["evaluation"].get("reward") is None for n, r in rows.items() if n != "good")
    summary = (out / "summary.md").read_text()
    assert all(f"| {name} | 0 | pi | ERROR |" in summary for name in expected)
    assert f"| invalid_task | {7 + len(REQUESTS)} |" in summary and "| invalid_reward | 5 |" in summary
    assert f"1/{len(rows)} completed" in done.stderr
    assert "infrastructure reasons" not in console


def test_hostile_tasks_on_the_local_runtime_are_per_session_errors(tmp_path: Path, kit: Kit) -> None:
    launch_hostile(tmp_path, kit)


def _docker_base() -> str:
    """The offline image carrying pi the session images are built FROM (skip when podman or it is missing)."""
    if os.geteuid() != 0:
        pytest.skip("rootless podman as uid 65534 is the tests/unprivileged tier's")
    return image_with_pi()


def test_hostile_tasks_on_the_docker_runtime_are_per_session_errors(tmp_path: Path, kit: Kit,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    base = _docker_base()
    monkeypatch.delenv("POLAR_DOCKER_CLI", raising=False)
    launch_hostile(tmp_path, kit, "runtime=docker", base_image=base)


def test_the_same_launch_holds_as_an_unprivileged_user(tmp_path: Path) -> None:
    """The local-runtime launch again as uid 65534 under /usr/bin/python3.11 (gateway, pi and sandbox all that
    user). The cache (venv, tokenizer, pi install) lives under /root (0700): it is bound, read-only, where that user
    can reach it for the run."""
    require_outer_root_run()
    cache = tokenizer_dir().parent
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "pydantic").is_dir())
    if cache not in site.parents:
        pytest.skip(f"the venv's packages ({site}) are not under the cache ({cache})")
    work = Path(tempfile.mkdtemp(prefix="polar-hostile-tasks-unpriv-", dir="/tmp"))
    try:
        inner_cache = work / "cache"
        output = run_as_nobody(Path(__file__), work, bind=(cache, inner_cache), min_passed=1,
                               markers=("harness", "slow"), pythonpath=[inner_cache / site.relative_to(cache), ROOT],
                               env={"POLAR_CACHE": str(inner_cache)}, timeout=LAUNCH_TIMEOUT)
        assert "1 passed" in output
    finally:
        shutil.rmtree(work, ignore_errors=True)
