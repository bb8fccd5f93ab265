"""The local sandbox's ``links`` request option (Harbor's /logs, /tests, /solution): a top-level symlink into the
session directory, whose files uploads and downloads reach through the link too; anything else is refused."""

from __future__ import annotations

import pytest

from polar_gym.runtime.errors import SandboxStartError
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec
from tests.evaluate._evalkit import needs_bwrap

pytestmark = needs_bwrap
LINKS = {"/logs": "/polar/harbor/logs", "/tests": "/polar/harbor/tests"}


async def test_links_reach_the_session_directory_from_inside_and_from_the_host(tmp_path) -> None:
    spec = RuntimeSpec(network="none", workdir="/app", options={"links": LINKS})
    async with LocalRuntime(spec, tmp_path / "s") as rt:
        await rt.upload(b"#!/bin/sh\nmkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt\n",
                        "/tests/test.sh")
        result = await rt.exec("sh /tests/test.sh && pwd && readlink /logs", timeout=30)
        assert result.ok and result.stdout.decode().split() == ["/app", "/polar/harbor/logs"]
        await rt.download("/logs/verifier", tmp_path / "out")
        assert (tmp_path / "out" / "reward.txt").read_text() == "1\n"
        assert (tmp_path / "s" / "harbor" / "logs" / "verifier" / "reward.txt").is_file()
        # the links are part of the read-only root: the sandbox cannot point them elsewhere
        moved = await rt.exec("rm /logs || ln -sfn /etc /logs", timeout=30)
        assert not moved.ok


@pytest.mark.parametrize(("links", "message"), [
    ({"/usr": "/polar/x"}, "must be a new top-level name"),
    ({"/logs/verifier": "/polar/x"}, "must be a new top-level name"),
    ({"/app": "/polar/x"}, "must be a new top-level name"),
    ({"/logs": "/etc"}, "must lie under /polar or /tmp"),
    ({"/logs": "/polar/../etc"}, "must lie under /polar or /tmp"),
    (["/logs"], "must map /name"),
])
async def test_links_that_would_cover_or_leave_the_sandbox_are_refused(tmp_path, links, message) -> None:
    spec = RuntimeSpec(network="none", workdir="/app", options={"links": links})
    with pytest.raises(SandboxStartError, match=message):
        async with LocalRuntime(spec, tmp_path / "s"):
            pass
