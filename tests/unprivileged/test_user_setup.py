"""The unprivileged-user tier: as ``polar-ci`` (tests/unprivileged/_user_kit.py), set-up with no root step, then the
README's main job, ``python -m polar_gym.launch`` on its embedded default: the pi CLI on the demo tasks in the local
bubblewrap sandbox, through unprivileged user namespaces. Also the local runtime's conformance suite, as that user."""

from __future__ import annotations

import json
import pwd

import pytest

from tests.unprivileged._user_kit import USER, UserClone, as_user, readme_run, readme_user_block

pytestmark = pytest.mark.slow


def test_setup_and_the_main_job_as_an_unprivileged_user(user_clone: UserClone) -> None:
    out = user_clone.setup_output
    # no root step ran; the system parts were reported with what each gives
    assert f"running as {USER} (not root): no apt-get" in out, out[-3000:]
    assert "apt-get update" not in out and "bubblewrap + userns" in out
    # every cache is the user's own
    cache = user_clone.home / ".cache" / "polar_gym"
    for pattern in ("venv-*", "harness-npm-*", "relay-*/relay", "tokenizer-*"):
        assert list(cache.glob(pattern)), f"{pattern} is not under {cache}"
    assert (user_clone.clone / ".venv" / ".polar_base").read_text().startswith(str(cache))

    # the README's walkthrough, line by line as written: the prerequisites table, then set-up and the main job
    prereqs, setup_and_run, _ = readme_user_block()
    table = as_user(prereqs, cwd=user_clone.clone, timeout=120)
    assert table.returncode == 0 and "bubblewrap" in table.stdout + table.stderr, (table.stdout, table.stderr)
    assert "scripts/setup.sh" in setup_and_run and "polar_gym.launch" in setup_and_run
    run_dir = readme_run(user_clone, setup_and_run)
    results = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert results, "the main job ran no session"
    for r in results:
        assert r["status"] == "COMPLETED", (r["session_id"], r.get("reason"))
        assert r["evaluation"]["reward"] == 1.0, (r["session_id"], r["evaluation"])
    assert run_dir.stat().st_uid == pwd.getpwnam(USER).pw_uid


def test_the_local_sandbox_conformance_suite_as_an_unprivileged_user(user_clone: UserClone) -> None:
    """tests/runtime's conformance suite on ``local``, run by the user in its clone: the sandbox's guarantees hold
    when bwrap gets its namespaces as an unprivileged user (no root anywhere); and a SIGKILLed gateway of the user's
    leaves no sandbox behind (the helper's watchdog in the user's own user namespace)."""
    proc = as_user(".venv/bin/python -m pytest -q -p no:cacheprovider -x -m 'not slow' "
                   "tests/runtime/test_conformance.py tests/runtime/test_orphans.py -k 'local or sigkilled'",
                   cwd=user_clone.clone, timeout=1200)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
